"""Flow control as seed 004 describes it ("Flow Control Admission"): the queue is the admission.

Requests go into priority bands (one per SLO priority); inside a band each tenant has its own
queue (the flow key is (tenant, priority)). Dispatch order:
- `fifo`: the globally earliest arrival across all bands;
- `priority`: bands highest priority first, the fairness policy picks the flow, its head leaves;
- `slo-deadline`: as `priority`, but inside the picked flow the earliest deadline leaves, where
  deadline = enqueue time + SLO target (per request, else per tier, else far future), ties by arrival.
Fairness inside a band: `global-strict` (flow head with the lowest sequence number), `round-robin`
(tenants in sorted key order, a cursor per band, empty flows skipped) or `weighted-drr` (deficit
round robin with per-tenant integer weights).
Capacity: per band and global (0 = unlimited). A full band rejects; a full queue rejects, or with
`queue_shedding` evicts the lowest-priority sheddable queued entry (newest first) when that entry's
priority is strictly below the incoming one. Dispatch is gated on saturation < 1.0.
`select_eviction_victim` picks the in-flight request to terminate: sheddable only, lowest priority
first, newest dispatch first among equals.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from apps.policy.errors import PolicyConfigError, require_non_negative
from apps.policy.fairness import DeficitRoundRobin
from apps.policy.slo import is_sheddable, merged_priorities, priority_in

DISPATCH_ORDERS = ("fifo", "priority", "slo-deadline")
FAIRNESS_POLICIES = ("global-strict", "round-robin", "weighted-drr")

REASON_BAND_FULL = "band_full"
REASON_QUEUE_FULL = "queue_full"
REASON_DUPLICATE = "duplicate_request"


@dataclass(frozen=True, slots=True)
class FlowRequest:
    request_id: str
    tenant_id: str
    slo_class: str = "standard"
    slo_target_s: float | None = None


@dataclass(frozen=True, slots=True)
class QueuedEntry:
    request: FlowRequest
    priority: int
    seq: int
    enqueued_at: float
    deadline: float


@dataclass(frozen=True, slots=True)
class EnqueueOutcome:
    accepted: bool
    reason: str = ""
    shed: QueuedEntry | None = None


@dataclass(frozen=True, slots=True)
class InFlight:
    """A dispatched request as the eviction trigger sees it."""

    request_id: str
    priority: int
    dispatched_at: float


def select_eviction_victim(in_flight: Iterable[InFlight]) -> InFlight | None:
    """Lowest priority first, newest dispatch first among equals; only sheddable requests."""
    victim: InFlight | None = None
    for candidate in in_flight:
        if not is_sheddable(candidate.priority):
            continue
        if victim is None or (candidate.priority, -candidate.dispatched_at) < (victim.priority, -victim.dispatched_at):
            victim = candidate
    return victim


class _Band:
    __slots__ = ("priority", "flows", "size", "keys", "cursor", "drr")

    def __init__(self, priority: int, drr: DeficitRoundRobin | None) -> None:
        self.priority = priority
        # tenant -> heap of (order key, seq, entry); the order key is seq or the deadline.
        self.flows: dict[Hashable, list[tuple[float, int, QueuedEntry]]] = {}
        self.size = 0
        self.keys: list[str] = []  # sorted tenant keys for round-robin
        self.cursor = 0
        self.drr = drr


class FlowController:
    def __init__(
        self,
        *,
        dispatch_order: str = "fifo",
        fairness: str = "global-strict",
        per_band_capacity: int = 0,
        max_queue_depth: int = 0,
        queue_shedding: bool = False,
        slo_priorities: Mapping[str, int] | None = None,
        slo_targets_s: Mapping[str, float] | None = None,
        weights: Mapping[str, int] | None = None,
    ) -> None:
        if dispatch_order not in DISPATCH_ORDERS:
            raise PolicyConfigError(f"dispatch_order must be one of {', '.join(DISPATCH_ORDERS)}, got {dispatch_order!r}")
        if fairness not in FAIRNESS_POLICIES:
            raise PolicyConfigError(f"fairness must be one of {', '.join(FAIRNESS_POLICIES)}, got {fairness!r}")
        for name, value in (("per_band_capacity", per_band_capacity), ("max_queue_depth", max_queue_depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PolicyConfigError(f"{name} must be a non-negative integer (0 = unlimited), got {value!r}")
        self.dispatch_order = dispatch_order
        self.fairness = fairness
        self.per_band_capacity = per_band_capacity
        self.max_queue_depth = max_queue_depth
        self.queue_shedding = queue_shedding
        self.priorities = merged_priorities(slo_priorities)
        self.slo_targets_s = {
            str(tier).lower(): require_non_negative(f"slo_targets_s[{tier!r}]", target)
            for tier, target in (slo_targets_s or {}).items()
        }
        # Validated now so a bad weight fails at construction, not at the first enqueue.
        self.weights = dict(DeficitRoundRobin(weights)._weights) if weights else {}
        self._bands: dict[int, _Band] = {}
        self._band_order: list[int] = []  # descending priority
        self._entries: dict[str, QueuedEntry] = {}
        self._seq = 0

    # -- enqueue -------------------------------------------------------------------------------

    def _deadline(self, request: FlowRequest, now: float) -> float:
        target = request.slo_target_s
        if target is None:
            target = self.slo_targets_s.get(request.slo_class.lower())
        return math.inf if target is None else now + target

    def _band(self, priority: int) -> _Band:
        band = self._bands.get(priority)
        if band is None:
            drr = DeficitRoundRobin(self.weights) if self.fairness == "weighted-drr" else None
            band = self._bands[priority] = _Band(priority, drr)
            position = bisect.bisect_left([-p for p in self._band_order], -priority)
            self._band_order.insert(position, priority)
        return band

    def enqueue(self, request: FlowRequest, now: float) -> EnqueueOutcome:
        if request.request_id in self._entries:
            return EnqueueOutcome(False, REASON_DUPLICATE)
        priority = priority_in(self.priorities, request.slo_class)
        band = self._band(priority)
        if self.per_band_capacity and band.size >= self.per_band_capacity:
            return EnqueueOutcome(False, REASON_BAND_FULL)
        shed: QueuedEntry | None = None
        if self.max_queue_depth and len(self._entries) >= self.max_queue_depth:
            victim = self._shedding_victim(priority) if self.queue_shedding else None
            if victim is None:
                return EnqueueOutcome(False, REASON_QUEUE_FULL)
            self.remove(victim.request.request_id)
            shed = victim
        self._seq += 1
        deadline = self._deadline(request, now)
        entry = QueuedEntry(request, priority, self._seq, now, deadline)
        order_key = deadline if self.dispatch_order == "slo-deadline" else float(entry.seq)
        flow = band.flows.get(request.tenant_id)
        if flow is None:
            flow = band.flows[request.tenant_id] = []
            bisect.insort(band.keys, request.tenant_id)
        heapq.heappush(flow, (order_key, entry.seq, entry))
        band.size += 1
        if band.drr is not None:
            band.drr.enqueue(request.tenant_id, request.tenant_id)
        self._entries[request.request_id] = entry
        return EnqueueOutcome(True, shed=shed)

    def _shedding_victim(self, incoming_priority: int) -> QueuedEntry | None:
        for priority in reversed(self._band_order):  # lowest priority first
            if priority >= incoming_priority or not is_sheddable(priority):
                return None
            band = self._bands[priority]
            if band.size:
                return max((item[2] for flow in band.flows.values() for item in flow), key=lambda e: e.seq)
        return None

    # -- removal and dispatch ------------------------------------------------------------------

    def remove(self, request_id: str) -> QueuedEntry | None:
        """Withdraw a queued request (shed, cancelled, timed out)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        band = self._bands[entry.priority]
        flow = band.flows[entry.request.tenant_id]
        for index, item in enumerate(flow):
            if item[2] is entry:
                flow[index] = flow[-1]
                flow.pop()
                heapq.heapify(flow)
                break
        band.size -= 1
        if band.drr is not None:
            band.drr.remove(entry.request.tenant_id, entry.request.tenant_id)
        return entry

    def _take(self, band: _Band, tenant: Hashable) -> QueuedEntry:
        _, _, entry = heapq.heappop(band.flows[tenant])
        band.size -= 1
        del self._entries[entry.request.request_id]
        return entry

    def _pick_flow(self, band: _Band) -> Hashable:
        if self.fairness == "global-strict":
            return min((flow[0][2].seq, tenant) for tenant, flow in band.flows.items() if flow)[1]
        if self.fairness == "round-robin":
            keys = band.keys
            for step in range(len(keys)):
                index = (band.cursor + step) % len(keys)
                if band.flows[keys[index]]:
                    band.cursor = (index + 1) % len(keys)
                    return keys[index]
            raise AssertionError("a non-empty band has no non-empty flow")
        picked = band.drr.dispatch() if band.drr is not None else None
        assert picked is not None, "a non-empty band has an empty DRR"
        return picked[0]

    def dispatch(self, now: float, saturation: float = 0.0) -> QueuedEntry | None:
        """The next request to send to the pool, or None (empty, or saturation >= 1.0)."""
        if not self._entries or saturation >= 1.0:
            return None
        if self.dispatch_order == "fifo":
            best: tuple[int, _Band, Hashable] | None = None
            for band in self._bands.values():
                for tenant, flow in band.flows.items():
                    if flow and (best is None or flow[0][2].seq < best[0]):
                        best = (flow[0][2].seq, band, tenant)
            assert best is not None
            band, tenant = best[1], best[2]
            if band.drr is not None:
                band.drr.remove(tenant, tenant)
            return self._take(band, tenant)
        for priority in self._band_order:
            band = self._bands[priority]
            if band.size:
                return self._take(band, self._pick_flow(band))
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def band_sizes(self) -> dict[int, int]:
        return {priority: band.size for priority, band in self._bands.items() if band.size}

    def entries(self) -> list[QueuedEntry]:
        return list(self._entries.values())
