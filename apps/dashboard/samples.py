"""The dashboards' samples: one `PoolSample` per pool per second, with an `EntitlementPoint` per entitlement,
frozen and JSON-round-trippable (the figure builders in apps.dashboard.figures are pure functions of them), and
`Visibility`, what one viewer may see of them (cut before any figure is built)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class EntitlementPoint:
    """One entitlement at one instant; counts (`admitted`, `denied`) are since the previous sample."""

    name: str
    tenant: str = ""
    service_class: str = ""
    in_flight: int = 0
    queued: int = 0  # waiting now: its queue or the pool's waiting room (this process)
    p99_ttft_s: float | None = None
    slo_ms: float = 0.0
    debt: float = 0.0
    priority: float | None = None
    admitted: int = 0
    denied: Mapping[str, int] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    baseline_tokens_per_s: float = 0.0
    kv_bytes: float = 0.0
    # Of `tokens_per_s`, what was served below the entitlement's class (spilled over, demoted), by class.
    tier_tokens_per_s: Mapping[str, float] = field(default_factory=dict)
    # The waits that ended over the last samples: p99 and mean, seconds (None: no wait ended in the window).
    queue_wait_p99_s: float | None = None
    queue_wait_mean_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tenant": self.tenant,
            "service_class": self.service_class,
            "in_flight": self.in_flight,
            "queued": self.queued,
            "queue_wait_p99_s": self.queue_wait_p99_s,
            "queue_wait_mean_s": self.queue_wait_mean_s,
            "p99_ttft_s": self.p99_ttft_s,
            "slo_ms": self.slo_ms,
            "debt": self.debt,
            "priority": self.priority,
            "admitted": self.admitted,
            "denied": dict(self.denied),
            "tokens_per_s": self.tokens_per_s,
            "baseline_tokens_per_s": self.baseline_tokens_per_s,
            "kv_bytes": self.kv_bytes,
            "tier_tokens_per_s": dict(self.tier_tokens_per_s),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EntitlementPoint:
        return cls(
            name=str(data["name"]),
            tenant=str(data.get("tenant", "")),
            service_class=str(data.get("service_class", "")),
            in_flight=int(data.get("in_flight", 0)),
            queued=int(data.get("queued", 0)),
            queue_wait_p99_s=_opt_float(data.get("queue_wait_p99_s")),
            queue_wait_mean_s=_opt_float(data.get("queue_wait_mean_s")),
            p99_ttft_s=_opt_float(data.get("p99_ttft_s")),
            slo_ms=float(data.get("slo_ms", 0.0)),
            debt=float(data.get("debt", 0.0)),
            priority=_opt_float(data.get("priority")),
            admitted=int(data.get("admitted", 0)),
            denied={str(k): int(v) for k, v in (data.get("denied") or {}).items()},
            tokens_per_s=float(data.get("tokens_per_s", 0.0)),
            baseline_tokens_per_s=float(data.get("baseline_tokens_per_s", 0.0)),
            kv_bytes=float(data.get("kv_bytes", 0.0)),
            tier_tokens_per_s={str(k): float(v) for k, v in (data.get("tier_tokens_per_s") or {}).items()},
        )


@dataclass(frozen=True, slots=True)
class PoolSample:
    """A pool at one instant (`time` in epoch seconds). Pool totals are None once filtered for a tenant user."""

    time: float
    pool: str
    slots: int = 0
    budget: int = 0
    aimd_action: int = 0  # +1 the budget grew since the previous sample, -1 it shrank, 0 held
    running: int | None = None
    queued: int | None = None
    p99_ttft_s: float | None = None
    kv_usage: Mapping[str, float] = field(default_factory=dict)  # replica -> fraction of its KV cache in use
    kv_admitted: float | None = None  # KV bytes the gateway reserved over the pool's KV capacity
    entitlements: tuple[EntitlementPoint, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "pool": self.pool,
            "slots": self.slots,
            "budget": self.budget,
            "aimd_action": self.aimd_action,
            "running": self.running,
            "queued": self.queued,
            "p99_ttft_s": self.p99_ttft_s,
            "kv_usage": dict(self.kv_usage),
            "kv_admitted": self.kv_admitted,
            "entitlements": [e.to_dict() for e in self.entitlements],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolSample:
        return cls(
            time=float(data["time"]),
            pool=str(data["pool"]),
            slots=int(data.get("slots", 0)),
            budget=int(data.get("budget", 0)),
            aimd_action=int(data.get("aimd_action", 0)),
            running=_opt_int(data.get("running")),
            queued=_opt_int(data.get("queued")),
            p99_ttft_s=_opt_float(data.get("p99_ttft_s")),
            kv_usage={str(k): float(v) for k, v in (data.get("kv_usage") or {}).items()},
            kv_admitted=_opt_float(data.get("kv_admitted")),
            entitlements=tuple(EntitlementPoint.from_dict(e) for e in data.get("entitlements") or ()),
        )


def _opt_float(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True, slots=True)
class Visibility:
    """What one viewer may see: `entitlements` None means every entitlement (operators);
    `pool_totals` adds the aggregates that mix every tenant's load (running, queued, KV usage)."""

    entitlements: frozenset[str] | None = None
    pool_totals: bool = True

    def allows(self, entitlement: str) -> bool:
        return self.entitlements is None or entitlement in self.entitlements


OPERATOR = Visibility()


def sample_visible(sample: PoolSample, visibility: Visibility) -> PoolSample:
    """The sample cut down to what the viewer may see (applied before any figure is built)."""
    kept = tuple(e for e in sample.entitlements if visibility.allows(e.name))
    if visibility.pool_totals:
        return sample if len(kept) == len(sample.entitlements) else replace(sample, entitlements=kept)
    return replace(sample, entitlements=kept, running=None, queued=None, kv_usage={}, kv_admitted=None)


def samples_visible(samples: Iterable[PoolSample], visibility: Visibility) -> list[PoolSample]:
    return [sample_visible(s, visibility) for s in samples]
