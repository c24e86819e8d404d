"""The records `AdmissionLedger` keeps per entitlement and per request, and its bookkeeping check."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from apps.policy.admission import AdmissionDecision, AdmissionRequest, EntitlementLimits
from apps.policy.bucket import TokenBucket
from apps.policy.priority import AT_REST, Dynamics
from apps.policy.window import ServiceWindow

if TYPE_CHECKING:
    from apps.policy.ledger import AdmissionLedger

RUNNING = "running"
WAITING = "waiting"


class EntitlementRecord:
    """One entitlement's levels (in flight, running, KV bytes), bucket, EWMA state and window."""

    __slots__ = (
        "limits",
        "reserved",
        "bucket",
        "in_flight",
        "kv_in_flight",
        "running",
        "kv_running",
        "dynamics",
        "idle_slots",
        "idle_kv",
        "window",
        "queue",
        "starts",
    )

    def __init__(self, limits: EntitlementLimits, now: float) -> None:
        self.limits = limits
        self.reserved = limits.traits.reserved
        capacity = limits.bucket_capacity
        self.bucket = None if capacity is None else TokenBucket(capacity, limits.tokens_per_second or 0.0, now=now)
        self.in_flight = 0
        self.kv_in_flight = 0.0
        self.running = 0
        self.kv_running = 0.0
        self.dynamics = Dynamics()
        self.idle_slots = 0
        self.idle_kv = 0.0
        self.window = ServiceWindow(now)
        # Requests over the entitlement's own limits, first come first served; they hold nothing.
        self.queue: deque[RequestRecord] = deque()
        # Running requests by start time, oldest first (the earliest expected end of Retry-After).
        self.starts: dict[str, float] = {}

    def accumulate(self, now: float) -> None:
        """Integrate the current levels up to `now` (call before changing them)."""
        self.window.accumulate(now, self.running, self.kv_running, self.in_flight - self.running)

    def at_rest(self) -> bool:
        """Nothing in flight, nothing in its window, no debt or burst: a tick leaves it as it is (the ledger's
        `_unsettled` set holds every entitlement that may not be)."""
        return not self.in_flight and self.dynamics == AT_REST and self.window.is_empty()

    def reserved_idle(self) -> tuple[int, float]:
        limits = self.limits
        if not self.reserved:
            return 0, 0.0
        slots = max(0, (limits.concurrency or 0) - self.running)
        kv = max(0.0, (limits.kv_bytes or 0.0) - self.kv_running)
        return slots, kv


class RequestRecord:
    """One offered request that is waiting or running."""

    __slots__ = (
        "request_id",
        "entitlement",
        "priority",
        "cost",
        "kv",
        "input_tokens",
        "max_tokens",
        "evictable",
        "state",
        "enqueued_at",
        "seq",
        "deadline",
        "own",
        "request",
    )

    def __init__(
        self, request_id: str, entitlement: EntitlementRecord, decision: AdmissionDecision, input_tokens: int,
        now: float, seq: int,
    ) -> None:
        self.request_id = request_id
        self.entitlement = entitlement
        self.priority = decision.priority
        self.cost = decision.token_cost
        self.kv = decision.kv_bytes
        self.input_tokens = input_tokens
        self.max_tokens = decision.max_tokens
        self.evictable = entitlement.limits.traits.evictable
        self.state = ""
        self.enqueued_at = now
        self.seq = seq
        # When a wait ends in expiry (set when the request starts waiting).
        self.deadline = math.inf
        # Waiting in its entitlement's own queue (holding nothing), not in the pool's waiting room.
        self.own = False
        # The request as offered, kept while it waits in its entitlement's queue.
        self.request: AdmissionRequest | None = None


def check_invariants(ledger: AdmissionLedger) -> None:
    """Raise AssertionError when the ledger's books do not balance (used by property tests)."""
    c = ledger.counters
    requests = ledger.request_records()
    entitlements = ledger.entitlement_records()
    in_flight = len(requests)
    closed = c.rejected + c.completed + c.evicted + c.expired + c.cancelled
    assert c.offered == closed + in_flight, (c, in_flight)
    running = [r for r in requests.values() if r.state == RUNNING]
    assert ledger.running == len(running)
    assert ledger.waiting == sum(1 for r in requests.values() if r.state == WAITING and not r.own)
    assert ledger.queued == sum(1 for r in requests.values() if r.own)
    held = {key: r for key, r in requests.items() if not r.own}
    assert ledger.evictable_running == sum(1 for r in running if r.evictable)
    assert math.isclose(ledger.evictable_kv, sum(r.kv for r in running if r.evictable), abs_tol=1e-6)
    assert math.isclose(ledger.kv_running, sum(r.kv for r in running), abs_tol=1e-6)
    assert len(ledger._priority_heap) <= 2 * len(ledger._priority_counts) + 65
    assert len(ledger._evictable_heap) <= 2 * ledger.evictable_running + 65 + len(requests)
    reserved = [record.reserved_idle() for record in entitlements.values()]
    assert ledger.reserved_idle_slots == sum(slots for slots, _ in reserved)
    for key, record in entitlements.items():
        mine = [r for r in held.values() if r.entitlement is record]
        assert list(record.queue) == sorted((r for r in requests.values() if r.own and r.entitlement is record),
                                            key=lambda r: r.seq), key
        assert set(record.starts) == {r.request_id for r in mine if r.state == RUNNING}, key
        assert record.in_flight == len(mine), key
        assert record.running == sum(1 for r in mine if r.state == RUNNING), key
        assert math.isclose(record.kv_in_flight, sum(r.kv for r in mine), abs_tol=1e-6), key
        if record.bucket is not None:
            assert -1e-9 <= record.bucket._level <= record.bucket.capacity + 1e-9, key
        if not record.at_rest():
            assert key in ledger._unsettled, f"{key} is off rest but the tick would pass it by"
