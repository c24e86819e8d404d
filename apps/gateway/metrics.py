"""The gateway's Prometheus metrics, hand-rolled (text exposition format 0.0.4, no dependency).

Counters and histograms are updated on the request path with a dict lookup and an add; gauges are
computed at scrape time from callbacks, so they cost nothing per request.

Every series keyed by an `entitlement` label also carries `tenant` (the tenant's slug) and `pool`: they are
resolved at scrape time from the entitlement (entitlement names are unique across tenants), through the
`owners` map the gateway keeps from its snapshot, so the request path still keys its series by the
entitlement alone (no extra label work per request). The map remembers entitlements that left the snapshot,
so a deleted entitlement's counters keep their labels rather than change series.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence

from apps.policy.aimd import DEFAULT_TTFT_BUCKETS_S

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

LabelValues = tuple[str, ...]
NO_HIDDEN: frozenset[str] = frozenset()
# entitlement -> (tenant slug, pool)
Owners = Mapping[str, tuple[str, str]]
NO_OWNERS: Owners = {}
OWNER_LABELS = ("tenant", "pool")


def owned_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """A family's label names as rendered: `tenant` and `pool` in front of a family keyed by entitlement."""
    if "entitlement" not in names:
        return names
    return tuple(label for label in OWNER_LABELS if label not in names) + names


def _owned(names: tuple[str, ...], owners: Owners, items: Iterable[tuple[LabelValues, list[float]]]
           ) -> tuple[tuple[str, ...], Iterable[tuple[LabelValues, list[float]]]]:
    """The series of a family keyed by entitlement with `tenant` and `pool` put in front (those of them the
    family does not carry already); other families as they are. One dict lookup per series, at scrape time."""
    if "entitlement" not in names:
        return names, items
    at = names.index("entitlement")
    missing = tuple(label for label in OWNER_LABELS if label not in names)
    if not missing:
        return names, items
    # the family's own label wins where it has one (a TTFT's pool is the pool that served it)
    pick = [OWNER_LABELS.index(label) for label in missing]

    def resolved() -> Iterable[tuple[LabelValues, list[float]]]:
        unknown = ("", "")
        for labels, values in items:
            owner = owners.get(labels[at], unknown)
            yield tuple(owner[i] for i in pick) + labels, values

    return missing + names, resolved()


def _summed(names: Sequence[str], hidden: frozenset[str],
            items: Iterable[tuple[LabelValues, list[float]]]) -> tuple[tuple[str, ...], dict[LabelValues, list[float]]]:
    """The series with the `hidden` labels removed and the series that then coincide added up."""
    if hidden.isdisjoint(names):
        return tuple(names), dict(items)
    keep = [i for i, name in enumerate(names) if name not in hidden]
    merged: dict[LabelValues, list[float]] = {}
    for labels, values in items:
        key = tuple(labels[i] for i in keep)
        total = merged.get(key)
        merged[key] = list(values) if total is None else [a + b for a, b in zip(total, values, strict=True)]
    return tuple(names[i] for i in keep), merged


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


# A queue's wait is bounded by `queue_max_wait_ms` (at most 10 minutes) or the acquire timeout.
QUEUE_WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)


class Counter:
    def __init__(self, name: str, help_text: str, labels: Sequence[str]) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self.values: dict[LabelValues, float] = {}

    def inc(self, labels: LabelValues, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, labels: LabelValues) -> float:
        return self.values.get(labels, 0.0)

    def render(self, hidden: frozenset[str] = NO_HIDDEN, owners: Owners = NO_OWNERS) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        names, items = _owned(self.label_names, owners, ((k, [v]) for k, v in list(self.values.items())))
        names, series = _summed(names, hidden, items)
        for labels, (value,) in series.items():
            yield f"{self.name}{_labels(names, labels)} {_number(value)}"


class Histogram:
    def __init__(self, name: str, help_text: str, labels: Sequence[str], buckets: Sequence[float]) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self.buckets = tuple(buckets)
        self.series: dict[LabelValues, list[float]] = {}

    def observe(self, labels: LabelValues, value: float) -> None:
        series = self.series.get(labels)
        if series is None:
            # bucket counts (non-cumulative), then +Inf, sum, count
            series = self.series[labels] = [0.0] * (len(self.buckets) + 3)
        series[bisect.bisect_left(self.buckets, value)] += 1
        series[-2] += value
        series[-1] += 1

    def count(self, labels: LabelValues) -> int:
        series = self.series.get(labels)
        return 0 if series is None else int(series[-1])

    def render(self, hidden: frozenset[str] = NO_HIDDEN, owners: Owners = NO_OWNERS) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        names, items = _owned(self.label_names, owners, list(self.series.items()))
        names, merged = _summed(names, hidden, items)
        # The `le` matchers and each series' labels are escaped once, not once per bucket line.
        bounds = [f'le="{_number(bound)}"' for bound in (*self.buckets, float("inf"))]
        bucket, total, count_name = f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count"
        for labels, series in merged.items():
            own = _labels(names, labels)
            prefix = own[:-1] + "," if own else "{"
            cumulative = 0.0
            for le, count in zip(bounds, series[: len(self.buckets) + 1], strict=True):
                cumulative += count
                yield f"{bucket}{prefix}{le}}} {_number(cumulative)}"
            yield f"{total}{own} {_number(series[-2])}"
            yield f"{count_name}{own} {_number(series[-1])}"


class Gauge:
    """Values computed at scrape time by `collect() -> {labels: value}`."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str],
                 collect: Callable[[], dict[LabelValues, float]]) -> None:
        self.name, self.help, self.label_names, self.collect = name, help_text, tuple(labels), collect

    def render(self, hidden: frozenset[str] = NO_HIDDEN, owners: Owners = NO_OWNERS) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} gauge"
        if hidden.intersection(owned_names(self.label_names)):
            # A gauge per entitlement or tenant (debt, a quota's limit) does not add up to anything meaningful:
            # left out.
            return
        names, items = _owned(self.label_names, owners, ((k, [v]) for k, v in self.collect().items()))
        for labels, (value,) in items:
            yield f"{self.name}{_labels(names, labels)} {_number(value)}"


class GatewayMetrics:
    def __init__(self) -> None:
        self.ttft = Histogram(
            "gateway_ttft_seconds", "Gateway entry to first response chunk, queue wait included.",
            ("pool", "entitlement"), DEFAULT_TTFT_BUCKETS_S,
        )
        self.duration = Histogram(
            "gateway_request_duration_seconds", "Gateway entry to the end of the response.",
            ("pool",), DURATION_BUCKETS_S,
        )
        self.admitted = Counter(
            "gateway_requests_admitted_total", "Requests admitted.", ("entitlement", "service_class")
        )
        self.rejected = Counter(
            "gateway_requests_rejected_total", "Requests rejected, by reason.", ("entitlement", "service_class", "reason")
        )
        self.tokens = Counter(
            "gateway_tokens_total", "Tokens served, by kind (prompt, completion).", ("entitlement", "kind")
        )
        # Issue 24: what each served class (tier) carried; a request spilled over or demoted counts under the
        # lower class it ran as, so that spillover and demoted traffic are series of their own.
        self.tier_requests = Counter(
            "gateway_tier_requests_total", "Requests a backend served, by entitlement and the class that served them.",
            ("entitlement", "tier"),
        )
        self.tier_tokens = Counter(
            "gateway_tier_tokens_total", "Tokens served, by entitlement, the class that served them and kind.",
            ("entitlement", "tier", "kind"),
        )
        self.queue_wait = Histogram(
            "tokenpools_queue_wait_seconds",
            "Time a request waited in its entitlement's queue or the pool's waiting room before it started or was "
            "turned away.", ("entitlement",), QUEUE_WAIT_BUCKETS_S,
        )
        self.gauges: list[Gauge] = []
        # Where the entitlement -> (tenant, pool) map comes from (the gateway's snapshot), and what it said
        # (kept: an entitlement gone from the snapshot keeps its labels).
        self.owners_source: Callable[[], Owners] = lambda: NO_OWNERS
        self.owners: Owners = {}
        self._owners_seen: Owners | None = None

    def add_gauge(self, name: str, help_text: str, labels: Sequence[str],
                  collect: Callable[[], dict[LabelValues, float]]) -> None:
        self.gauges.append(Gauge(name, help_text, labels, collect))

    def _owners(self) -> Owners:
        current = self.owners_source()
        if current is not self._owners_seen:  # a new snapshot: merged once, not at every scrape
            self._owners_seen = current
            self.owners = {**self.owners, **current}
        return self.owners

    def render(self, hidden: frozenset[str] = NO_HIDDEN) -> bytes:
        """The exposition text; `hidden` label names are summed away (counters, histograms) or their gauges
        left out (apps/gateway/metrics_access.py: what an anonymous reader may see)."""
        owners = self._owners()
        lines: list[str] = []
        metrics: list[Counter | Histogram | Gauge] = [self.ttft, self.duration, self.admitted, self.rejected,
                                                      self.tokens, self.tier_requests, self.tier_tokens,
                                                      self.queue_wait, *self.gauges]
        for metric in metrics:
            lines.extend(metric.render(hidden, owners))
        return ("\n".join(lines) + "\n").encode()
