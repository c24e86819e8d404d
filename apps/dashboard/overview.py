"""The operator's overview (issue 28): the figures of the home page, as pure functions of what the
selectors read (live samples, request-log rows, quota states). No ORM, no clock: `now` is passed in.

- `pool_load`: a pool's slots, tokens/s and KV bytes in use against its capacity, and its healthy replicas.
- `refusals_by_minute`: refusals per minute by reason over the last 15 minutes, and the tenants refused.
- `time_to_exhaustion`: when a quota runs out at the current rate (or that its window resets first).
- `slo_attainment`: p99 TTFT of an entitlement's served requests against its target.
- `pool_fairness`: Jain's index of served over entitled tokens/s across the entitlements with demand.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from apps.dashboard.samples import PoolSample
from apps.policy import jain_fairness

WINDOW_S = 15 * 60
# tokens/s is a one-second count per sample: the pool's figure is the mean of the last ten (~10 s).
RATE_SAMPLES = 10


@dataclass(frozen=True)
class PoolLoad:
    pool: str
    in_flight: int
    slots: int
    tokens_per_s: float
    tokens_per_s_capacity: float
    kv_bytes: float
    kv_capacity: float
    healthy_replicas: int
    replicas: int
    unchecked_replicas: int = 0  # enabled but not scraped yet: neither healthy nor not
    fairness: float | None = None
    fairness_entitlements: int = 0

    @staticmethod
    def _percent(used: float, capacity: float) -> float | None:
        return None if capacity <= 0 else round(100.0 * used / capacity, 1)

    @property
    def unhealthy_replicas(self) -> int:
        return self.replicas - self.healthy_replicas - self.unchecked_replicas

    @property
    def slots_percent(self) -> float | None:
        return self._percent(self.in_flight, self.slots)

    @property
    def tokens_percent(self) -> float | None:
        return self._percent(self.tokens_per_s, self.tokens_per_s_capacity)

    @property
    def kv_percent(self) -> float | None:
        return self._percent(self.kv_bytes, self.kv_capacity)


def pool_load(pool: str, samples: Sequence[PoolSample], *, slots: int, tokens_per_s: float, kv_bytes: float,
              healthy_replicas: int, replicas: int, unchecked_replicas: int = 0) -> PoolLoad:
    """The pool now, from its (already visibility-cut) samples: in flight and KV bytes of the last sample,
    tokens/s averaged over the last `RATE_SAMPLES`, summed over the entitlements the viewer may see."""
    last = samples[-1] if samples else None
    recent = samples[-RATE_SAMPLES:]
    rate = sum(sum(p.tokens_per_s for p in s.entitlements) for s in recent) / len(recent) if recent else 0.0
    fairness, count = pool_fairness(samples)
    return PoolLoad(
        pool=pool,
        in_flight=sum(p.in_flight for p in last.entitlements) if last else 0,
        slots=slots,
        tokens_per_s=round(rate, 1),
        tokens_per_s_capacity=tokens_per_s,
        kv_bytes=sum(p.kv_bytes for p in last.entitlements) if last else 0.0,
        kv_capacity=kv_bytes,
        healthy_replicas=healthy_replicas,
        replicas=replicas,
        unchecked_replicas=unchecked_replicas,
        fairness=fairness,
        fairness_entitlements=count,
    )


def pool_fairness(samples: Iterable[PoolSample]) -> tuple[float | None, int]:
    """Jain's index of x_i = served_i / entitled_i (mean tokens/s over the samples against the baseline)
    across the entitlements with demand (admitted, refused, waiting or running in some sample) and an
    entitled rate; with the count of them. None below two: one entitlement is trivially fair to itself.
    Jain's index is scale-free, so x_i as a ratio or as a share of the pool gives the same figure."""
    served: dict[str, float] = {}
    entitled: dict[str, float] = {}
    count: dict[str, int] = {}
    demand: set[str] = set()
    for sample in samples:
        for p in sample.entitlements:
            served[p.name] = served.get(p.name, 0.0) + p.tokens_per_s
            count[p.name] = count.get(p.name, 0) + 1
            entitled[p.name] = p.baseline_tokens_per_s
            if p.admitted or p.in_flight or p.queued or any(p.denied.values()):
                demand.add(p.name)
    ratios = [served[n] / count[n] / entitled[n] for n in sorted(demand) if entitled.get(n, 0.0) > 0]
    if len(ratios) < 2:
        return None, len(ratios)
    return round(jain_fairness(ratios), 3), len(ratios)


# --- refusals ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantRefusals:
    tenant: str
    total: int
    last_minute: int
    by_reason: Mapping[str, int]


@dataclass(frozen=True)
class Refusals:
    minutes: list[dt.datetime]  # the window's minutes, oldest first
    by_reason: dict[str, list[int]]  # reason -> count per minute (aligned with `minutes`)
    tenants: list[TenantRefusals] = field(default_factory=list)  # most refused first

    @property
    def total(self) -> int:
        return sum(sum(counts) for counts in self.by_reason.values())


def window_minutes(now: dt.datetime, seconds: int = WINDOW_S) -> list[dt.datetime]:
    """The minutes of the window ending now, oldest first (the current, partial minute included)."""
    current = now.replace(second=0, microsecond=0)
    return [current - dt.timedelta(minutes=i) for i in range(seconds // 60 - 1, -1, -1)]


def refusals_by_minute(rows: Iterable[tuple[str, str, dt.datetime, int]], now: dt.datetime) -> Refusals:
    """From (tenant, reason, minute, count) rows: per-minute counts by reason over the window and the tenants
    refused (those refused in the last minute first). Rows outside the window are ignored."""
    minutes = window_minutes(now)
    index = {m: i for i, m in enumerate(minutes)}
    by_reason: dict[str, list[int]] = {}
    tenants: dict[str, dict[str, int]] = {}
    last: dict[str, int] = {}
    for tenant, reason, minute, n in rows:
        i = index.get(minute.replace(second=0, microsecond=0))
        if i is None:
            continue
        reason = reason or "unknown"
        by_reason.setdefault(reason, [0] * len(minutes))[i] += n
        reasons = tenants.setdefault(tenant, {})
        reasons[reason] = reasons.get(reason, 0) + n
        if i == len(minutes) - 1:
            last[tenant] = last.get(tenant, 0) + n
    rows_out = [TenantRefusals(t, sum(r.values()), last.get(t, 0), dict(sorted(r.items())))
                for t, r in tenants.items()]
    rows_out.sort(key=lambda r: (-r.last_minute, -r.total, r.tenant))
    return Refusals(minutes, dict(sorted(by_reason.items())), rows_out)


# --- quota burn ----------------------------------------------------------------------------------


def time_to_exhaustion(remaining: float, rate_per_s: float) -> float | None:
    """Seconds until `remaining` is used up at `rate_per_s`; 0 when nothing remains; None when nothing is
    being used (it never runs out at this rate)."""
    if remaining <= 0:
        return 0.0
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        return None
    return remaining / rate_per_s


@dataclass(frozen=True)
class QuotaBurn:
    """One quota (an entitlement's own, or a tenant's shared one) and how fast it is being used."""

    scope: str  # "entitlement" or "tenant"
    name: str
    tenant: str
    unit: str
    limit: float
    used: float
    used_percent: float
    rate_per_s: float  # in the quota's unit, over the last 15 minutes
    resets_at: dt.datetime
    resets_in_s: float
    exhausted_in_s: float | None  # None: nothing used lately, it does not run out at this rate

    @property
    def resets_first(self) -> bool:
        """The window ends before the quota would run out: no refusal coming in this window."""
        return self.exhausted_in_s is None or self.exhausted_in_s > self.resets_in_s


def quota_burn(*, scope: str, name: str, tenant: str, status: Mapping[str, object], used_recently: float,
               now: dt.datetime, window_s: int = WINDOW_S) -> QuotaBurn:
    """A quota's burn from its status (`apps.gateway.quotas.quota_status`) and what was used over the last
    `window_s` (the current rate)."""
    resets_at = dt.datetime.fromisoformat(str(status["resets_at"]).replace("Z", "+00:00"))
    rate = max(0.0, used_recently) / window_s
    remaining = float(status["remaining"])  # type: ignore[arg-type]
    return QuotaBurn(
        scope=scope, name=name, tenant=tenant, unit=str(status["unit"]),
        limit=float(status["limit"]), used=float(status["used"]),  # type: ignore[arg-type]
        used_percent=float(status["used_percent"]),  # type: ignore[arg-type]
        rate_per_s=rate, resets_at=resets_at,
        resets_in_s=max(0.0, (resets_at - now).total_seconds()),
        exhausted_in_s=time_to_exhaustion(remaining, rate),
    )


def nearest_limits(burns: Iterable[QuotaBurn], limit: int = 10) -> list[QuotaBurn]:
    """Quotas nearest their limits first: those that run out before their window resets, soonest first,
    then by share used."""
    def key(b: QuotaBurn) -> tuple[int, float, float]:
        soon = b.exhausted_in_s if b.exhausted_in_s is not None and not b.resets_first else 0.0
        return (1 if b.resets_first else 0, soon, -b.used_percent)

    return sorted(burns, key=key)[:limit]


# --- SLO attainment ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0..1) of `values`; None when empty. Nearest rank, not interpolated:
    the p99 of what was measured is a TTFT some request actually had."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class SloAttainment:
    entitlement: str
    tenant: str
    target_ms: float
    requests: int
    p99_ms: float | None
    within_percent: float | None  # share of requests whose TTFT met the target

    @property
    def met(self) -> bool | None:
        if self.p99_ms is None or self.target_ms <= 0:
            return None
        return self.p99_ms <= self.target_ms


def slo_attainment(entitlement: str, tenant: str, target_ms: float, ttfts_ms: Sequence[float]) -> SloAttainment:
    """p99 TTFT of the served requests against the entitlement's target, and the share within it."""
    p99 = percentile(ttfts_ms, 0.99)
    within = None
    if ttfts_ms and target_ms > 0:
        within = round(100.0 * sum(1 for t in ttfts_ms if t <= target_ms) / len(ttfts_ms), 1)
    return SloAttainment(entitlement, tenant, target_ms, len(ttfts_ms),
                         None if p99 is None else round(p99, 1), within)
