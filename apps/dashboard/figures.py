"""Plotly figures of the live dashboards, built by pure functions from `PoolSample`s.

Every figure is a plain dict (`{"data": [...], "layout": {...}}`, what `go.Figure(...).to_plotly_json()`
gives) whose traces carry a stable `uid` (and their readable key in `meta`). A figure is a list of trace specs, each a template and a
function of one sample giving its y value (or None: no point); the whole figure maps the specs over the
history, and `figure_update` maps the same specs over one new sample, so the points the browser appends
(`Plotly.extendTraces`, by uid) are exactly those a reload would draw.

Tenant filtering happens before: callers pass samples already cut by `telemetry.sample_visible`, and
`visible_entitlements` (None: all) is applied again here so that no builder can leak a series.

The figures follow seed 000, section 5 (Figure 2 queue depth, 3 and 6a p99 TTFT against SLO, 4 in-flight
stacked by entitlement against slots, 5 debt and priority, admissions and denials, 6b tokens/s against
the baseline) and seed 002 (the AIMD budget with its increase and decrease actions), plus KV per replica.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from apps.dashboard.colors import PALETTE, entitlement_colors
from apps.dashboard.samples import EntitlementPoint, PoolSample

Figure = dict[str, Any]
ValueOf = Callable[[PoolSample], float | None]

INCREASE_COLOR = "#2ca02c"
DECREASE_COLOR = "#d62728"
POOL_COLOR = "#333333"
_UID_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
# Legends sit below the plot, anchored by their top to the bottom of the figure's box, so they never cover
# an axis (issue 28: 16 entries on the admissions chart grew upwards over it); past this height they scroll.
LEGEND_MAX_HEIGHT_PX = 80
FIGURE_HEIGHT_PX = 340


@dataclass(frozen=True)
class TraceSpec:
    key: str
    template: Mapping[str, Any]
    value: ValueOf


def ms(sample: PoolSample) -> float:
    """Plotly date axes take epoch milliseconds (shown in UTC)."""
    return round(sample.time * 1000.0, 3)


def trace_uid(key: str) -> str:
    """The Plotly uid of the trace `key` ("inflight:acme-chat"). plotly.js puts uids into CSS selectors
    (legend patterns), so only letters, digits, `-` and `_` survive; the checksum keeps keys that
    differ only in other characters (replica URLs, entitlement names) apart."""
    return f"{_UID_UNSAFE.sub('_', key)}-{zlib.crc32(key.encode()):08x}"


def _trace(spec: TraceSpec, samples: Sequence[PoolSample]) -> dict[str, Any]:
    xs: list[float] = []
    ys: list[float] = []
    for sample in samples:
        value = spec.value(sample)
        if value is None:
            continue
        xs.append(ms(sample))
        ys.append(value)
    # `meta` keeps the readable key (tests and the browser test find traces by it).
    return {**spec.template, "uid": trace_uid(spec.key), "meta": spec.key, "x": xs, "y": ys}


def legend_below() -> dict[str, Any]:
    """A horizontal legend in the figure's bottom margin: anchored by its top just under the tick labels
    (`yref: container` measures from the figure's box, so the plot keeps its size whatever the entry count)
    and scrolling past `LEGEND_MAX_HEIGHT_PX` instead of growing over the axes."""
    return {"orientation": "h", "x": 0, "xanchor": "left", "yref": "container", "y": 0, "yanchor": "bottom",
            "maxheight": LEGEND_MAX_HEIGHT_PX, "font": {"size": 11}}


def _layout(title: str, y_title: str, **extra: Any) -> dict[str, Any]:
    layout: dict[str, Any] = {
        "title": {"text": title},
        # The time zone goes in the title, not an axis title the legend would have to clear as well.
        # automargin: the tick labels get room of their own above the legend's (reserved) margin.
        "xaxis": {"type": "date", "automargin": True},
        "yaxis": {"title": {"text": y_title}, "rangemode": "tozero"},
        "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
        "legend": legend_below(),
        "height": FIGURE_HEIGHT_PX,
    }
    layout.update(extra)
    return layout


def entitlement_names(samples: Iterable[PoolSample], visible: Iterable[str] | None) -> list[str]:
    """The entitlements to draw: those seen in the samples and allowed, sorted (stable trace order)."""
    allowed = None if visible is None else set(visible)
    seen = {e.name for s in samples for e in s.entitlements}
    return sorted(n for n in seen if allowed is None or n in allowed)


def _point(sample: PoolSample, name: str) -> EntitlementPoint | None:
    for point in sample.entitlements:
        if point.name == name:
            return point
    return None


def _ent_value(name: str, read: Callable[[EntitlementPoint], float | None]) -> ValueOf:
    def value(sample: PoolSample) -> float | None:
        point = _point(sample, name)
        return None if point is None else read(point)

    return value


def _line(name: str, color: str, *, dash: str = "solid", width: float = 2, **extra: Any) -> dict[str, Any]:
    return {"type": "scatter", "mode": "lines", "name": name, "line": {"color": color, "dash": dash, "width": width},
            **extra}


@dataclass(frozen=True)
class _EntitlementLine:
    """One line per entitlement: trace key `<key>:<name>`, legend `<name> <label>`, `style` for `_line`."""

    key: str
    label: str
    read: Callable[[EntitlementPoint], float | None]
    style: Mapping[str, Any] = field(default_factory=dict)


def _specs_line_pairs(names: Sequence[str], main: _EntitlementLine, companion: _EntitlementLine) -> list[TraceSpec]:
    """Two lines per entitlement in its colour: a measurement and what it is read against (SLO, baseline)
    or shown beside on a second axis (priority)."""
    colors = entitlement_colors(names)
    return [
        TraceSpec(f"{line.key}:{n}", _line(f"{n} {line.label}", colors[n], **line.style), _ent_value(n, line.read))
        for n in names
        for line in (main, companion)
    ]


# --- the trace specs of each figure --------------------------------------------------------------


def _specs_inflight(names: Sequence[str]) -> list[TraceSpec]:
    colors = entitlement_colors(names)
    specs = [
        TraceSpec(f"inflight:{n}", {**_line(n, colors[n]), "stackgroup": "inflight", "fill": "tonexty"},
                  _ent_value(n, lambda p: p.in_flight))
        for n in names
    ]
    specs.append(TraceSpec("inflight:slots", _line("pool slots", POOL_COLOR, dash="dash"), lambda s: s.slots))
    specs.append(TraceSpec("inflight:budget", _line("budget", "#888888", dash="dot"), lambda s: s.budget))
    return specs


def _specs_queue(names: Sequence[str]) -> list[TraceSpec]:
    colors = entitlement_colors(names)
    specs = [
        TraceSpec(f"queue:{n}", {**_line(n, colors[n]), "stackgroup": "queued"},
                  _ent_value(n, lambda p: p.queued))
        for n in names
    ]
    specs.append(TraceSpec("queue:running", _line("running (pool)", POOL_COLOR, dash="dash"), lambda s: s.running))
    specs.append(TraceSpec("queue:waiting", _line("waiting (pool)", DECREASE_COLOR, dash="dot"), lambda s: s.queued))
    return specs


def _specs_ttft(names: Sequence[str]) -> list[TraceSpec]:
    specs = _specs_line_pairs(
        names,
        _EntitlementLine("ttft", "p99", lambda p: p.p99_ttft_s),
        _EntitlementLine("slo", "SLO", lambda p: p.slo_ms / 1000.0 if p.slo_ms > 0 else None,
                         {"dash": "dash", "width": 1}),
    )
    specs.append(TraceSpec("ttft:pool", _line("pool p99", POOL_COLOR, dash="dot"), lambda s: s.p99_ttft_s))
    return specs


def _specs_queue_wait(names: Sequence[str]) -> list[TraceSpec]:
    return _specs_line_pairs(
        names,
        _EntitlementLine("wait", "p99", lambda p: p.queue_wait_p99_s),
        _EntitlementLine("waitmean", "mean", lambda p: p.queue_wait_mean_s, {"dash": "dot", "width": 1}),
    )


def _specs_debt_priority(names: Sequence[str]) -> list[TraceSpec]:
    return _specs_line_pairs(
        names,
        _EntitlementLine("debt", "debt", lambda p: p.debt),
        _EntitlementLine("priority", "priority", lambda p: p.priority, {"dash": "dot", "yaxis": "y2"}),
    )


def _denial_reasons(samples: Iterable[PoolSample], names: Sequence[str]) -> list[tuple[str, str]]:
    wanted = set(names)
    return sorted({(e.name, r) for s in samples for e in s.entitlements if e.name in wanted for r in e.denied})


def _denied_of(reason: str) -> Callable[[EntitlementPoint], float | None]:
    def value(point: EntitlementPoint) -> float | None:
        count = point.denied.get(reason)
        return -count if count else None

    return value


def _kv_of(replica: str) -> ValueOf:
    def value(sample: PoolSample) -> float | None:
        usage = sample.kv_usage.get(replica)
        return None if usage is None else 100.0 * usage

    return value


def _specs_admissions(names: Sequence[str], reasons: Sequence[tuple[str, str]]) -> list[TraceSpec]:
    colors = entitlement_colors(names)
    specs = [
        TraceSpec(f"admitted:{n}", {"type": "bar", "name": f"{n} admitted",
                                    "marker": {"color": colors[n]}},
                  _ent_value(n, lambda p: p.admitted))
        for n in names
    ]
    for n, reason in reasons:
        # Denials are drawn below zero (barmode "relative"), as in seed 000's Figure 5, panel 3.
        specs.append(TraceSpec(
            f"denied:{n}:{reason}",
            {"type": "bar", "name": f"{n} denied: {reason}",
             "marker": {"color": colors[n], "pattern": {"shape": "x"}, "opacity": 0.6}},
            _ent_value(n, _denied_of(reason)),
        ))
    return specs


def _specs_aimd(names: Sequence[str]) -> list[TraceSpec]:
    del names  # pool-level only
    return [
        TraceSpec("aimd:budget", {**_line("budget", "#1f77b4"), "line": {"color": "#1f77b4", "shape": "hv", "width": 2}},
                  lambda s: s.budget),
        TraceSpec("aimd:running", _line("in flight (pool)", POOL_COLOR, dash="dot", width=1), lambda s: s.running),
        TraceSpec("aimd:increase", {"type": "scatter", "mode": "markers", "name": "increase",
                                    "marker": {"color": INCREASE_COLOR, "symbol": "triangle-up", "size": 10}},
                  lambda s: s.budget if s.aimd_action > 0 else None),
        TraceSpec("aimd:decrease", {"type": "scatter", "mode": "markers", "name": "decrease",
                                    "marker": {"color": DECREASE_COLOR, "symbol": "triangle-down", "size": 10}},
                  lambda s: s.budget if s.aimd_action < 0 else None),
    ]


def _replicas(samples: Iterable[PoolSample]) -> list[str]:
    return sorted({r for s in samples for r in s.kv_usage})


def _specs_kv(replicas: Sequence[str]) -> list[TraceSpec]:
    specs = [
        TraceSpec(f"kv:{r}", _line(r, PALETTE[i % len(PALETTE)]), _kv_of(r))
        for i, r in enumerate(replicas)
    ]
    specs.append(TraceSpec("kv:admitted", _line("reserved by admitted requests", POOL_COLOR, dash="dot"),
                           lambda s: None if s.kv_admitted is None else 100.0 * s.kv_admitted))
    return specs


def _tier_tokens(tier: str) -> Callable[[EntitlementPoint], float | None]:
    return lambda point: point.tier_tokens_per_s.get(tier)


def _specs_tokens(names: Sequence[str], samples: Sequence[PoolSample] = ()) -> list[TraceSpec]:
    specs = _specs_line_pairs(
        names,
        _EntitlementLine("tokens", "served", lambda p: p.tokens_per_s),
        _EntitlementLine("baseline", "baseline", lambda p: p.baseline_tokens_per_s or None,
                         {"dash": "dash", "width": 1}),
    )
    # Issue 24: what an entitlement had served below its class (spilled over, demoted): a dotted line per class.
    colors = entitlement_colors(names)
    for name in names:
        tiers = sorted({t for s in samples for p in s.entitlements if p.name == name for t in p.tier_tokens_per_s})
        specs += [TraceSpec(f"tokens:{name}@{tier}", _line(f"{name} as {tier}", colors[name], dash="dot", width=1),
                            _ent_value(name, _tier_tokens(tier)))
                  for tier in tiers]
    return specs


# --- the figures ---------------------------------------------------------------------------------


def _figure(specs: Sequence[TraceSpec], samples: Sequence[PoolSample], layout: dict[str, Any]) -> Figure:
    return {"data": [_trace(spec, samples) for spec in specs], "layout": layout}


def figure_inflight_stacked(samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None) -> Figure:
    """Seed 000, Figure 4: in-flight requests stacked by entitlement against the pool's slots."""
    names = entitlement_names(samples, visible_entitlements)
    return _figure(_specs_inflight(names), samples, _layout("In-flight requests by entitlement (UTC)", "requests"))


def figure_queue_depth(samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None) -> Figure:
    """Seed 000, Figure 2: requests waiting now, in their entitlement's queue or the pool's waiting room (per
    entitlement), with the pool's running and waiting."""
    names = entitlement_names(samples, visible_entitlements)
    return _figure(_specs_queue(names), samples, _layout("Queue depth (UTC)", "requests"))


def figure_queue_wait(samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None) -> Figure:
    """Issue 23: how long each entitlement's requests waited before they started or were turned away, p99 and
    mean (dotted) over the last samples (`tokenpools_queue_wait_seconds`)."""
    names = entitlement_names(samples, visible_entitlements)
    return _figure(_specs_queue_wait(names), samples, _layout("Queue wait (UTC)", "seconds"))


def figure_ttft_vs_slo(samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None) -> Figure:
    """Seed 000, Figures 3 and 6a: p99 TTFT per entitlement against its SLO (dashed)."""
    names = entitlement_names(samples, visible_entitlements)
    return _figure(_specs_ttft(names), samples, _layout("p99 TTFT against SLO (UTC)", "seconds"))


def figure_debt_priority(samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None) -> Figure:
    """Seed 000, Figure 5 panel 2: service debt (left axis) and priority weight (right axis, dotted)."""
    names = entitlement_names(samples, visible_entitlements)
    layout = _layout("Debt and priority weight (UTC)", "debt",
                     yaxis2={"title": {"text": "priority weight"}, "overlaying": "y", "side": "right",
                             "rangemode": "tozero"})
    layout["yaxis"]["rangemode"] = "normal"  # debt goes negative (credit) after a burst
    layout["margin"] = {**layout["margin"], "r": 70}  # room for the right axis' title
    return _figure(_specs_debt_priority(names), samples, layout)


def figure_admissions_by_reason(
    samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None
) -> Figure:
    """Seed 000, Figure 5 panel 3 and seed 002's submitted/admitted/shed: admits up, denials by reason down."""
    names = entitlement_names(samples, visible_entitlements)
    layout = _layout("Admitted and denied per second (UTC)", "requests per sample", barmode="relative", bargap=0.1)
    layout["yaxis"]["rangemode"] = "normal"
    return _figure(_specs_admissions(names, _denial_reasons(samples, names)), samples, layout)


def figure_aimd_budget(samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None) -> Figure:
    """Seed 002: the pool budget the AIMD controller tunes, with its increase and decrease actions."""
    del visible_entitlements  # pool-level; running is already None for viewers without pool totals
    return _figure(_specs_aimd(()), samples, _layout("AIMD budget (UTC)", "concurrent requests"))


def figure_kv_usage(samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None) -> Figure:
    """KV cache in use per replica (scraped from vLLM) and reserved by the gateway's admissions, in %."""
    del visible_entitlements
    layout = _layout("KV cache usage (UTC)", "% of KV cache")
    layout["yaxis"]["range"] = [0, 100]
    return _figure(_specs_kv(_replicas(samples)), samples, layout)


def figure_tokens_vs_baseline(
    samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None
) -> Figure:
    """Seed 000, Figure 6b: tokens/s served per entitlement against its entitled baseline (dashed), and what of
    it ran below the entitlement's class (spillover, quota demotion: dotted, one line per class)."""
    names = entitlement_names(samples, visible_entitlements)
    return _figure(_specs_tokens(names, samples), samples, _layout("Tokens/s served against baseline (UTC)", "tokens/s"))


Builder = Callable[..., Figure]

# Page order. The ids name the <div>s of the page and the keys of every payload. The first four are what an
# operator reads first (issue 28): who is admitted and refused, who waits, whether TTFT meets the SLO and
# whether each entitlement gets its entitled tokens/s; the live page puts them above the fold.
FIGURES: tuple[tuple[str, Builder], ...] = (
    ("admissions", figure_admissions_by_reason),
    ("queue", figure_queue_depth),
    ("ttft", figure_ttft_vs_slo),
    ("tokens", figure_tokens_vs_baseline),
    ("inflight", figure_inflight_stacked),
    ("wait", figure_queue_wait),
    ("debt", figure_debt_priority),
    ("aimd", figure_aimd_budget),
    ("kv", figure_kv_usage),
)
PRIMARY_FIGURES = ("admissions", "queue", "ttft", "tokens")
POOL_ONLY_FIGURES = frozenset({"kv"})  # nothing of an entitlement's own in it: left off entitlement pages


def figure_ids(*, pool_totals: bool = True) -> list[str]:
    return [fid for fid, _ in FIGURES if pool_totals or fid not in POOL_ONLY_FIGURES]


def figures_all(
    samples: Sequence[PoolSample], *, visible_entitlements: Iterable[str] | None, ids: Iterable[str] | None = None
) -> dict[str, Figure]:
    """Every figure (or those in `ids`) from the history, keyed by figure id."""
    wanted = None if ids is None else set(ids)
    visible = None if visible_entitlements is None else list(visible_entitlements)
    return {fid: build(samples, visible_entitlements=visible) for fid, build in FIGURES
            if wanted is None or fid in wanted}


def figure_update(
    sample: PoolSample, visible: Iterable[str] | None, *, ids: Iterable[str] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The points one new sample adds, per figure: traces with a uid, x and y (and their template, so the
    browser can add a trace it does not have yet, e.g. a new entitlement or denial reason). Traces
    without a point in this sample are left out."""
    figures = figures_all([sample], visible_entitlements=visible, ids=ids)
    return {fid: [t for t in figure["data"] if t["x"]] for fid, figure in figures.items()}


def live_payload_history(
    samples: Sequence[PoolSample], visible: Iterable[str] | None, *, ids: Iterable[str] | None = None
) -> dict[str, Any]:
    """The first message of a websocket: the whole recent history as figures."""
    return {"type": "history", "figures": figures_all(samples, visible_entitlements=visible, ids=ids),
            "last": ms(samples[-1]) if samples else None}


def live_payload_update(
    sample: PoolSample, visible: Iterable[str] | None, *, ids: Iterable[str] | None = None
) -> dict[str, Any]:
    """Every later message: one sample's points."""
    return {"type": "update", "time": ms(sample), "traces": figure_update(sample, visible, ids=ids)}
