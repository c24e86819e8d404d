"""`AdmissionLedger`: the one admission state machine of a pool.

Every request offered ends in exactly one outcome:

    offer ──> rejected                                  (one of the five ordered checks said no)
      │
      ├──> running ──> completed                         (release: unused tokens refunded, waiters start)
      │       └──────> evicted                           (preemptible work making room; output refunded)
      ├──> waiting ──> running                           (a release, eviction or capacity change made room,
      │       │                                          highest priority first, then arrival order)
      │       ├──────> expired                           (waited `wait_timeout_s`, the acquire timeout)
      │       └──────> cancelled                         (the client went away; the whole charge refunded)
      └──> queued ───> running | waiting                 (its entitlement's own limits let it go: a release, a
              │                                          bucket refill, new limits; first come first served)
              ├──────> expired                           (waited `queue_max_wait_ms`: queue_timeout)
              └──────> cancelled                         (the client went away)

A request refused only by its entitlement's own concurrency, token bucket or KV bytes (checks 3 and 4) waits
in the entitlement's queue (`EntitlementLimits.own_queue_max`, default by class; a full queue refuses it at
once with queue_full), and so does every request offered while that queue is not empty (first come first
served). A queued request holds nothing but its quota reservation: no slot, no tokens, no KV bytes. The head
leaves the queue when `within_own_limits` says its entitlement has room, then starts or waits in the pool's
waiting room by the priority it was offered at (a request leaving the queue evicts nobody); `next_wake`
says when a bucket refill or a deadline needs `wake`.

A request under quotas (`apps.policy.quota`) first reserves its prompt plus `max_tokens` in the shared
`QuotaBook` (refused: rejected with quota_exceeded, before the five checks); the reservation is refunded
when the request is rejected, expires or is cancelled, and settled at the tokens really used on release
(for an evicted request too: its release comes after the eviction).

Alongside, per entitlement, the served/demand window (`apps.policy.window`) that the EWMA tick turns
into debt (2) and burst (3).

The simulator and the gateway's in-process store drive this object; the gateway's Redis store applies
the same transitions in Lua (`apps/gateway/lua/`) and `make conformance` runs one table of scenarios
against all three. Time is always passed in (`now`, seconds); randomness only jitters Retry-After and
comes from an injected `random.Random`.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from apps.policy.admission import (
    CAPACITY_REASONS,
    DEFAULT_ADMISSION_CONFIG,
    AdmissionConfig,
    AdmissionDecision,
    AdmissionRequest,
    EntitlementLimits,
    EntitlementState,
    EntitlementUsage,
    PoolUsage,
    Reason,
    admit,
    budget_bound,
    dispatch_capacity,
    new_tuple,
)
from apps.policy.bucket import TokenBucket
from apps.policy.errors import PolicyConfigError, require_non_negative
from apps.policy.ledger_records import RUNNING, WAITING, EntitlementRecord, RequestRecord, check_invariants
from apps.policy.priority import Dynamics, DynamicsConfig
from apps.policy.queues import (
    ENQUEUE,
    offered_priority,
    own_limits_decision,
    own_retry_s,
    within_own_limits,
)
from apps.policy.quota import QuotaBook, QuotaClaim, QuotaVerdict
from apps.policy.quota_offer import (
    OUTCOME_CANCELLED,
    OUTCOME_COMPLETED,
    Decide,
    Refund,
    Reserve,
    Step,
    consumed,
    quota_offer,
    quota_refusal,
    run_sync,
    settlement,
)
from apps.policy.tiers import DEMOTED_CLASS, served_as, spills, tier_pool
from apps.policy.window import MIN_TICK_WINDOW_S, RESTING_READING, WindowReading, window_reading

OUTCOME_REJECTED = "rejected"
OUTCOME_EVICTED = "evicted"
OUTCOME_EXPIRED = "expired"
OUTCOME_UNKNOWN = "unknown"

__all__ = [
    "MIN_TICK_WINDOW_S",
    "OUTCOME_CANCELLED",
    "OUTCOME_COMPLETED",
    "OUTCOME_EVICTED",
    "OUTCOME_EXPIRED",
    "OUTCOME_REJECTED",
    "OUTCOME_UNKNOWN",
    "RUNNING",
    "WAITING",
    "AdmissionLedger",
    "LedgerCounters",
    "LedgerResult",
    "ReleaseResult",
    "WakeResult",
    "quota_refusal",
    "used_parts",
]


@dataclass(frozen=True, slots=True)
class LedgerResult:
    """A decision plus what it set in motion: requests that started (including this one when it
    was admitted straight away) and requests that were evicted to make room."""

    decision: AdmissionDecision
    started: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()
    # Where the request's quotas stand after the offer (None: no quota applies).
    quota: QuotaVerdict | None = None

    # Written out, as `AdmissionRequest.__init__` (mypyc compiles it; the generated one stays interpreted).
    def __init__(self, decision: AdmissionDecision, started: tuple[str, ...] = (), evicted: tuple[str, ...] = (),
                 quota: QuotaVerdict | None = None) -> None:
        object.__setattr__(self, "decision", decision)
        object.__setattr__(self, "started", started)
        object.__setattr__(self, "evicted", evicted)
        object.__setattr__(self, "quota", quota)


@dataclass(frozen=True, slots=True)
class WakeResult:
    started: tuple[str, ...] = ()
    expired: tuple[str, ...] = ()

    def __init__(self, started: tuple[str, ...] = (), expired: tuple[str, ...] = ()) -> None:
        object.__setattr__(self, "started", started)
        object.__setattr__(self, "expired", expired)


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    outcome: str
    started: tuple[str, ...] = ()
    refunded_tokens: float = 0.0

    def __init__(self, outcome: str, started: tuple[str, ...] = (), refunded_tokens: float = 0.0) -> None:
        object.__setattr__(self, "outcome", outcome)
        object.__setattr__(self, "started", started)
        object.__setattr__(self, "refunded_tokens", refunded_tokens)


@dataclass
class LedgerCounters:
    offered: int = 0
    rejected: int = 0
    admitted: int = 0
    queued: int = 0
    completed: int = 0
    evicted: int = 0
    expired: int = 0
    cancelled: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


def used_parts(record: RequestRecord, output_tokens: float | None, prompt_tokens: float | None) -> tuple[int, int]:
    """What a finished request consumed of its charge (`apps.policy.quota_offer.consumed`)."""
    return consumed(record.input_tokens, record.max_tokens, output_tokens, prompt_tokens)


class AdmissionLedger:
    def __init__(
        self,
        *,
        concurrency_capacity: int,
        kv_capacity: float = math.inf,
        mean_slo_ms: float | None = None,
        config: AdmissionConfig = DEFAULT_ADMISSION_CONFIG,
        dynamics_config: DynamicsConfig | None = None,
        rng: random.Random | None = None,
        retry_jitter: float = 0.0,
        now: float = 0.0,
        quotas: QuotaBook | None = None,
    ) -> None:
        self._check_capacity(concurrency_capacity, kv_capacity)
        self.concurrency_capacity = concurrency_capacity
        # The pool's dispatch budget (seed 002: the AIMD-tuned number of requests the pool may run; None: its
        # capacity): one more limit on running requests, checked with the slots (`dispatch_capacity`).
        self.budget: int | None = None
        self.dispatch_capacity = concurrency_capacity
        self.kv_capacity = float(kv_capacity)
        self.config = config
        self.dynamics_config = dynamics_config or DynamicsConfig()
        self._fixed_mean_slo_ms = mean_slo_ms
        self._mean_slo_ms = mean_slo_ms or 1000.0
        self.rng = rng or random.Random(0)
        self.retry_jitter = require_non_negative("retry_jitter", retry_jitter)
        self.saturation = 0.0
        self.running = 0
        self.kv_running = 0.0
        self.reserved_idle_slots = 0
        self.reserved_idle_kv = 0.0
        self.evictable_running = 0
        self.evictable_kv = 0.0
        self.counters = LedgerCounters()
        # Quotas span pools (a tenant's budget covers all its entitlements): the book may be shared.
        self.quotas = quotas if quotas is not None else QuotaBook()
        self._entitlements: dict[str, EntitlementRecord] = {}
        # Entitlements that may not be at rest (something in flight, a window with anything in it, debt or
        # burst): a superset, kept by every transition that can move one off rest (a start in flight, a
        # refusal counted, dynamics set), so that the tick and the in-flight view cost what is active, not the
        # pool's size (10,000 idle entitlements stalled the gateway's loop for 3 ms every second).
        self._unsettled: set[str] = set()
        self._requests: dict[str, RequestRecord] = {}
        self._priority_counts: dict[float, int] = {}
        self._priority_heap: list[float] = []
        self._evictable_heap: list[tuple[float, int, str]] = []
        self._waiting_heap: list[tuple[float, int, str]] = []
        # Waiting and queued requests by deadline (the pool's acquire timeout, the entitlement's queue wait).
        self._deadlines: list[tuple[float, int, str]] = []
        self._waiting_count = 0
        self._queued_count = 0
        # Entitlements whose queue holds requests.
        self._queued_ents: dict[str, EntitlementRecord] = {}
        self._seq = 0
        self._last_tick = now

    # -- configuration -------------------------------------------------------------------------

    @staticmethod
    def _check_capacity(concurrency_capacity: int, kv_capacity: float) -> None:
        if isinstance(concurrency_capacity, bool) or not isinstance(concurrency_capacity, int):
            raise PolicyConfigError(f"concurrency_capacity must be an integer, got {concurrency_capacity!r}")
        if concurrency_capacity < 0:
            raise PolicyConfigError(f"concurrency_capacity must be >= 0, got {concurrency_capacity!r}")
        if kv_capacity != kv_capacity or kv_capacity < 0:
            raise PolicyConfigError(f"kv_capacity must be >= 0, got {kv_capacity!r}")

    def upsert_entitlement(self, limits: EntitlementLimits, now: float) -> tuple[str, ...]:
        """Add or change an entitlement; returns the waiting requests that could start because of it."""
        record = self._entitlements.get(limits.entitlement_id)
        if record is None:
            record = EntitlementRecord(limits, now)
            self._entitlements[limits.entitlement_id] = record
        else:
            record.accumulate(now)
            record.limits = limits
            capacity = limits.bucket_capacity
            if capacity is None:
                record.bucket = None
            elif record.bucket is None:
                record.bucket = TokenBucket(capacity, limits.tokens_per_second or 0.0, now=now)
            else:
                record.bucket.set_rate(capacity, limits.tokens_per_second or 0.0, now)
        # Only a Bound reservation is held for its owner: a Degraded or Expired one holds nothing.
        record.reserved = limits.traits.reserved and limits.state is EntitlementState.BOUND
        self._refresh_reserved(record)
        self._refresh_mean_slo()
        return self._drain(now)

    def remove_entitlement(self, entitlement_id: str) -> None:
        record = self._entitlements.get(entitlement_id)
        if record is None:
            return
        if record.in_flight or record.queue:
            raise PolicyConfigError(
                f"entitlement {entitlement_id!r} still has {record.in_flight + len(record.queue)} requests in flight; "
                "mark it expired and remove it once they finish"
            )
        self.reserved_idle_slots -= record.idle_slots
        self.reserved_idle_kv -= record.idle_kv
        del self._entitlements[entitlement_id]
        self._unsettled.discard(entitlement_id)
        self._refresh_mean_slo()

    def set_capacity(self, concurrency_capacity: int, now: float, kv_capacity: float | None = None) -> tuple[str, ...]:
        """Resize the pool. A shrink never cancels running work: new starts wait for releases."""
        kv = self.kv_capacity if kv_capacity is None else kv_capacity
        self._check_capacity(concurrency_capacity, kv)
        self.concurrency_capacity = concurrency_capacity
        self.kv_capacity = float(kv)
        self._refresh_dispatch()
        return self._drain(now)

    def set_budget(self, budget: int | None, now: float) -> tuple[str, ...]:
        """The pool's dispatch budget (AIMD, seed 002): no more than this many requests run, whatever the
        capacity (None: the capacity alone). A smaller budget cancels nothing: new starts wait for releases; a
        larger one starts waiters."""
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise PolicyConfigError(f"budget must be a non-negative integer or None, got {budget!r}")
        self.budget = budget
        self._refresh_dispatch()
        return self._drain(now)

    def _budget_bound(self) -> bool:
        """The dispatch budget is what is full, not the capacity (`PoolUsage.budget_bound`)."""
        return budget_bound(self.budget, self.running, self.concurrency_capacity)

    def _refresh_dispatch(self) -> None:
        self.dispatch_capacity = dispatch_capacity(self.concurrency_capacity, self.budget)

    def set_saturation(self, saturation: float, now: float) -> tuple[str, ...]:
        if saturation != saturation or saturation < 0:
            raise PolicyConfigError(f"saturation must be a number >= 0, got {saturation!r}")
        self.saturation = float(saturation)
        return self._drain(now)

    def set_mean_slo_ms(self, mean_slo_ms: float | None) -> None:
        """Fix the pool's mean SLO of formula (1) (the gateway takes it from the pool's Bound
        entitlements); None goes back to the mean over the entitlements this ledger knows."""
        if mean_slo_ms is not None and not 0 < mean_slo_ms < math.inf:
            raise PolicyConfigError(f"mean_slo_ms must be a positive number, got {mean_slo_ms!r}")
        self._fixed_mean_slo_ms = mean_slo_ms
        self._mean_slo_ms = mean_slo_ms or 1000.0
        self._refresh_mean_slo()

    def limits(self, entitlement_id: str) -> EntitlementLimits | None:
        record = self._entitlements.get(entitlement_id)
        return None if record is None else record.limits

    def dynamics(self, entitlement_id: str) -> Dynamics:
        return self._entitlements[entitlement_id].dynamics

    def set_dynamics(self, entitlement_id: str, dynamics: Dynamics) -> None:
        """Restore debt/burst (e.g. from a shared store or a previous run)."""
        self._entitlements[entitlement_id].dynamics = dynamics
        self._unsettled.add(entitlement_id)

    def _refresh_reserved(self, record: EntitlementRecord) -> None:
        slots, kv = record.reserved_idle()
        self.reserved_idle_slots += slots - record.idle_slots
        self.reserved_idle_kv += kv - record.idle_kv
        record.idle_slots, record.idle_kv = slots, kv

    def _refresh_mean_slo(self) -> None:
        if self._fixed_mean_slo_ms is not None:
            return
        # An entitlement's tiers (`tier_limits`) are not entitlements of the pool: they carry their owner's SLO.
        targets = [record.limits.slo_target_ms for record in self._entitlements.values() if not record.limits.tier_of]
        self._mean_slo_ms = sum(targets) / len(targets) if targets else 1000.0

    # -- snapshots -----------------------------------------------------------------------------

    @property
    def mean_slo_ms(self) -> float:
        return self._mean_slo_ms

    def admission_threshold(self) -> float:
        heap, counts = self._priority_heap, self._priority_counts
        while heap and not counts.get(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else -math.inf

    def _lowest_evictable(self) -> tuple[float, int, str] | None:
        heap = self._evictable_heap
        while heap:
            entry = heap[0]
            request = self._requests.get(entry[2])
            if request is not None and request.state == RUNNING and request.seq == -entry[1]:
                return entry
            heapq.heappop(heap)
        return None

    def usage(self, entitlement_id: str, now: float) -> EntitlementUsage:
        record = self._entitlements[entitlement_id]
        bucket = record.bucket
        dynamics = record.dynamics
        # Every field, in EntitlementUsage's order (`new_tuple`): every decision builds one (make bench-sim).
        return new_tuple(EntitlementUsage, (
            record.in_flight,  # in_flight
            record.kv_in_flight,  # kv_bytes_in_flight
            record.running,  # running
            record.kv_running,  # kv_bytes_running
            math.inf if bucket is None else bucket.level(now),  # tokens_available
            dynamics.debt,
            dynamics.burst,
        ))

    def pool_usage(self) -> PoolUsage:
        lowest = self._lowest_evictable() if self._evictable_heap else None
        budget = self.budget
        # Every field, in PoolUsage's order (`new_tuple`): every decision builds one (make bench-sim).
        return new_tuple(PoolUsage, (
            self.dispatch_capacity,  # concurrency_capacity
            self.kv_capacity,  # kv_capacity
            self.running,  # running
            self.kv_running,  # kv_bytes_running
            self.reserved_idle_slots,  # reserved_idle_concurrency
            self.reserved_idle_kv,  # reserved_idle_kv
            self.saturation,  # saturation
            self.admission_threshold() if self._priority_heap else -math.inf,  # admission_threshold
            self._mean_slo_ms,  # mean_slo_ms
            None if lowest is None else lowest[0],  # lowest_evictable_priority
            self.evictable_running,  # evictable_running
            self.evictable_kv,  # evictable_kv_bytes
            budget is not None and budget <= self.running < self.concurrency_capacity,  # budget_bound
        ))

    @property
    def waiting(self) -> int:
        return self._waiting_count

    @property
    def queued(self) -> int:
        """Requests waiting in their entitlements' own queues."""
        return self._queued_count

    def queue_depths(self) -> dict[str, int]:
        return {key: len(record.queue) for key, record in self._queued_ents.items()}

    def request_state(self, request_id: str) -> str | None:
        request = self._requests.get(request_id)
        return None if request is None else request.state

    def in_flight_ids(self) -> list[str]:
        return list(self._requests)

    # -- the request lifecycle -----------------------------------------------------------------

    def request(
        self, entitlement_id: str, request: AdmissionRequest, now: float, limits: EntitlementLimits | None = None,
        quota: QuotaClaim | None = None,
    ) -> LedgerResult:
        """Offer a request: reserve its quota, run the checks, then charge, start, queue or reject it.

        `limits`, when given, are the entitlement's limits as the caller sees them now (the gateway's
        snapshot, with the backend's context window); they replace the stored ones first."""
        if quota is not None:
            return self._request_under_quota(entitlement_id, request, now, limits, quota)
        counters = self.counters
        counters.offered += 1
        record = self._entitlements.get(entitlement_id)
        if limits is not None and (record is None or (limits is not record.limits and limits != record.limits)):
            self.upsert_entitlement(limits, now)
            record = self._entitlements[entitlement_id]
        if record is None:
            return self._rejected(
                None, AdmissionDecision(False, Reason.ENTITLEMENT_NOT_BOUND.value, self.config.never_retry_s,
                                        retryable=False, check=1)
            )
        if request.request_id in self._requests:
            return self._rejected(
                None, AdmissionDecision(False, Reason.INVALID_REQUEST.value, self.config.never_retry_s,
                                        retryable=False, check=0)
            )
        limits = record.limits
        if limits.tier_of:  # an entitlement's tier (apps.policy.tiers): no queue, no spillover of its own
            decision = served_as(admit(limits, self.usage(entitlement_id, now), self._tier_pool(limits, now),
                                       request, self.config), limits)
        else:
            decision = admit(limits, self.usage(entitlement_id, now), self.pool_usage(), request, self.config)
            if record.queue or not (decision.admitted or decision.queued):  # the common admission skips the queue
                spilled = self._spillover(record, request, now) if spills(limits, decision, len(record.queue)) else None
                if spilled is not None:
                    record, decision = spilled
                else:
                    owner, dynamics = record, record.dynamics
                    decision, route = own_limits_decision(
                        limits, decision, len(record.queue), lambda refused: self._own_retry_s(owner, refused, now),
                        lambda: offered_priority(limits, request, self._mean_slo_ms, dynamics.burst, dynamics.debt,
                                                 self.config))
                    if route == ENQUEUE:
                        return self._enqueue(record, request, decision, now)
        if not decision.admitted and not decision.queued:
            return self._rejected(record, decision)

        self._seq += 1
        entry = RequestRecord(request.request_id, record, decision, request.input_tokens, now, self._seq)
        # `_charge`, written out: every admission runs it (make bench-policy)
        if record.bucket is not None:
            record.bucket.try_consume(entry.cost, now)
        record.accumulate(now)
        record.in_flight += 1
        record.kv_in_flight += entry.kv
        self._unsettled.add(record.limits.entitlement_id)
        self._requests[entry.request_id] = entry
        if decision.admitted:
            counters.admitted += 1
            self._start(entry, now)
            return LedgerResult(decision, started=(entry.request_id,))

        counters.queued += 1
        self._wait(entry, now + self.config.wait_timeout_s)
        evicted: list[str] = []
        started: list[str] = []
        if decision.evict:
            evicted, started = self._evict_for(entry, now)
        started.extend(self._drain(now))
        return LedgerResult(decision, started=tuple(started), evicted=tuple(evicted))

    def _spillover(self, record: EntitlementRecord, request: AdmissionRequest,
                   now: float) -> tuple[EntitlementRecord, AdmissionDecision] | None:
        """The entitlement's spillover tier and its decision when that tier starts the request at once; else None
        (the entitlement's own decision stands: its queue, or its refusal). `apps.policy.tiers`."""
        spillover = record.limits.spillover_class
        assert spillover is not None
        tier = self._tier(record.limits.tier_limits(spillover), now)
        tier_id = tier.limits.entitlement_id
        spilled = admit(tier.limits, self.usage(tier_id, now), self._tier_pool(tier.limits, now), request,
                        self.config)
        if not spilled.admitted:
            return None
        return tier, served_as(spilled, tier.limits)

    def _tier_pool(self, limits: EntitlementLimits, now: float) -> PoolUsage:
        owner = self._entitlements.get(limits.tier_of)
        if owner is None:
            return self.pool_usage()
        return tier_pool(self.pool_usage(), owner.limits, self.usage(limits.tier_of, now))

    def _tier(self, limits: EntitlementLimits, now: float) -> EntitlementRecord:
        """The record of an entitlement's tier (`EntitlementLimits.tier_limits`), kept in step with its limits."""
        record = self._entitlements.get(limits.entitlement_id)
        if record is None or record.limits != limits:
            self.upsert_entitlement(limits, now)
            record = self._entitlements[limits.entitlement_id]
        return record

    def _charge(self, entry: RequestRecord, now: float) -> None:
        """An offer's charge on its entitlement: its tokens from the bucket, one more in flight, its KV bytes."""
        record = entry.entitlement
        if record.bucket is not None:
            record.bucket.try_consume(entry.cost, now)
        record.accumulate(now)
        record.in_flight += 1
        record.kv_in_flight += entry.kv
        self._unsettled.add(record.limits.entitlement_id)

    def _wait(self, entry: RequestRecord, deadline: float) -> None:
        """offered | queued -> waiting: in the pool's waiting room, by priority."""
        entry.state = WAITING
        self._waiting_count += 1
        heapq.heappush(self._waiting_heap, (-entry.priority, entry.seq, entry.request_id))
        if deadline != entry.deadline:
            entry.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, entry.seq, entry.request_id))

    def _enqueue(self, record: EntitlementRecord, request: AdmissionRequest, queued: AdmissionDecision,
                 now: float) -> LedgerResult:
        """offered -> queued in the entitlement's own queue (holding nothing), as `own_limits_decision` decided."""
        limits = record.limits
        self._seq += 1
        entry = RequestRecord(request.request_id, record, queued, request.input_tokens, now, self._seq)
        entry.state, entry.own, entry.request = WAITING, True, request
        entry.deadline = now + limits.own_queue_wait_s
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, entry.request_id))
        self._requests[entry.request_id] = entry
        record.queue.append(entry)
        self._queued_ents[limits.entitlement_id] = record
        self._queued_count += 1
        self.counters.queued += 1
        return LedgerResult(queued)

    def _own_retry_s(self, record: EntitlementRecord, decision: AdmissionDecision, now: float) -> float:
        return own_retry_s(decision, next(iter(record.starts.values()), None), now, self.config.expected_service_s)

    def _request_under_quota(self, entitlement_id: str, request: AdmissionRequest, now: float,
                             limits: EntitlementLimits | None, quota: QuotaClaim) -> LedgerResult:
        """The quota's reservation first (refused: quota_exceeded, before the five checks), then the offer;
        an offer the checks reject gives the reservation back (`apps.policy.quota_offer.quota_offer`)."""
        if request.request_id in self._requests:
            return self.request(entitlement_id, request, now, limits)  # rejected as a duplicate, quota untouched
        record = self._entitlements.get(entitlement_id)
        if limits is not None and (record is None or limits != record.limits):
            self.upsert_entitlement(limits, now)  # a demoted request's tier counts its idle reservation (`_tier_pool`)
            record = self._entitlements[entitlement_id]
        bound = record is not None and record.limits.state is EntitlementState.BOUND

        def answer(step: Step) -> Any:
            if isinstance(step, Reserve):
                return self.quotas.reserve(step.claim, now)
            if isinstance(step, Decide):
                if not step.demoted:
                    return self.request(entitlement_id, request, now, limits)
                assert record is not None
                tier = record.limits.tier_limits(DEMOTED_CLASS)
                return self.request(tier.entitlement_id, request, now, tier)  # which keeps the tier's record in step
            if isinstance(step, Refund):
                return self.quotas.refund(step.claim.request_id)
            return self.quotas.verdict(step.claim)

        outcome = run_sync(quota_offer(quota, bound=bound), answer)
        if outcome.offer is None:
            assert outcome.refusal is not None
            self.counters.offered += 1
            return LedgerResult(self._rejected(None, outcome.refusal).decision, quota=outcome.verdict)
        result: LedgerResult = outcome.offer
        return LedgerResult(result.decision, result.started, result.evicted, outcome.verdict)

    def release(
        self, request_id: str, now: float, output_tokens: float | None = None, prompt_tokens: float | None = None
    ) -> ReleaseResult:
        """Completion callback: free the slot and KV, refund the unused charge, start waiters.

        Releasing a waiting request cancels it (client went away) and refunds its whole charge.
        Unknown ids change nothing in the pool (a duplicate callback must not corrupt state); the quota
        of a request evicted before its release is settled here, at what it used."""
        entry = self._requests.get(request_id)
        if entry is None:
            self.quotas.settle(request_id, *settlement(OUTCOME_UNKNOWN, 0, 0, output_tokens, prompt_tokens))
            return ReleaseResult(OUTCOME_UNKNOWN)
        if entry.own:
            self._leave_queue(entry)
            self.counters.cancelled += 1
            return ReleaseResult(OUTCOME_CANCELLED, self._drain(now))
        if entry.state == WAITING:
            refunded = self._finish_waiting(entry, now)
            self.counters.cancelled += 1
            return ReleaseResult(OUTCOME_CANCELLED, self._drain(now), refunded)
        prompt, produced = used_parts(entry, output_tokens, prompt_tokens)
        used = float(prompt + produced)
        self.quotas.settle(request_id, prompt, produced)
        refund = max(0.0, entry.cost - used)
        record = entry.entitlement
        if refund and record.bucket is not None:
            record.bucket.refund(refund, now)
        self._stop(entry, now)
        record.window.count_completion(used)
        self.counters.completed += 1
        return ReleaseResult(OUTCOME_COMPLETED, self._drain(now), refund)

    def expire_waiting(self, now: float) -> list[str]:
        """`wake`, returning the requests it turned away."""
        return list(self.wake(now).expired)

    def wake(self, now: float) -> WakeResult:
        """Turn away the requests whose wait reached its deadline (the pool's acquire timeout for the waiting
        room, the entitlement's `queue_max_wait_ms` for its queue: queue_timeout), refunding what they held,
        then let queued requests go whose entitlement has room now (a bucket refilled)."""
        heap = self._deadlines
        expired: list[str] = []
        while heap and heap[0][0] <= now:
            _, seq, request_id = heapq.heappop(heap)
            entry = self._requests.get(request_id)
            if entry is None or entry.state != WAITING or entry.seq != seq:
                continue  # started, cancelled or moved since
            if entry.own:
                self._leave_queue(entry)
            else:
                self._finish_waiting(entry, now)
            entry.entitlement.window.count_refusal(entry.cost, entry.kv)
            self._unsettled.add(entry.entitlement.limits.entitlement_id)
            self.counters.expired += 1
            expired.append(request_id)
        return WakeResult(self._drain(now), tuple(expired))

    def next_wake(self, now: float) -> float:
        """The next time `wake` has something to do: a deadline, or a queue head's bucket refilled to its
        cost (math.inf: nothing; a release wakes queues blocked by concurrency or KV bytes)."""
        heap = self._deadlines
        while heap and ((entry := self._requests.get(heap[0][2])) is None or entry.state != WAITING
                        or entry.seq != heap[0][1]):
            heapq.heappop(heap)
        at = heap[0][0] if heap else math.inf
        for record in self._queued_ents.values():
            bucket = record.bucket
            if bucket is not None and record.queue and bucket.refill_rate > 0:
                missing = record.queue[0].cost - bucket.level(now)
                if missing > 0:
                    at = min(at, now + missing / bucket.refill_rate)
        return at

    def evict(self, request_id: str, now: float) -> ReleaseResult:
        """Terminate a running request (preemption); its unproduced output is refunded."""
        entry = self._requests.get(request_id)
        if entry is None or entry.state != RUNNING:
            return ReleaseResult(OUTCOME_UNKNOWN)
        refund = self._evict(entry, now)
        return ReleaseResult(OUTCOME_EVICTED, self._drain(now), refund)

    # -- internals -----------------------------------------------------------------------------

    def _rejected(self, record: EntitlementRecord | None, decision: AdmissionDecision) -> LedgerResult:
        counters = self.counters
        counters.rejected += 1
        counters.by_reason[decision.reason] = counters.by_reason.get(decision.reason, 0) + 1
        if record is not None and decision.reason in CAPACITY_REASONS:
            record.window.count_refusal(decision.token_cost, decision.kv_bytes)
            self._unsettled.add(record.limits.entitlement_id)
        if self.retry_jitter and decision.retryable:
            # Spread retries so that a recovery does not meet a thundering herd (seed 000, 5.3).
            decision = decision._replace(
                retry_after_s=decision.retry_after_s * (1.0 + self.retry_jitter * self.rng.random())
            )
        return LedgerResult(decision)

    def _start(self, entry: RequestRecord, now: float) -> None:
        record = entry.entitlement
        record.accumulate(now)
        if entry.state == WAITING:
            self._waiting_count -= 1
        entry.state = RUNNING
        record.starts[entry.request_id] = now
        self._seq += 1
        entry.seq = self._seq  # dispatch order: newest dispatch is evicted first among equals
        record.running += 1
        record.kv_running += entry.kv
        self.running += 1
        self.kv_running += entry.kv
        if record.reserved:
            self._refresh_reserved(record)
        priority = entry.priority
        count = self._priority_counts.get(priority, 0)
        if not count:
            heapq.heappush(self._priority_heap, priority)
        self._priority_counts[priority] = count + 1
        if entry.evictable:
            self.evictable_running += 1
            self.evictable_kv += entry.kv
            heapq.heappush(self._evictable_heap, (priority, -entry.seq, entry.request_id))

    def _stop(self, entry: RequestRecord, now: float) -> None:
        record = entry.entitlement
        record.accumulate(now)
        del record.starts[entry.request_id]
        record.running -= 1
        record.kv_running -= entry.kv
        record.in_flight -= 1
        record.kv_in_flight -= entry.kv
        self.running -= 1
        self.kv_running -= entry.kv
        if record.reserved:
            self._refresh_reserved(record)
        if entry.evictable:
            self.evictable_running -= 1
            self.evictable_kv -= entry.kv
        self._priority_counts[entry.priority] -= 1
        if not self._priority_counts[entry.priority]:
            del self._priority_counts[entry.priority]
        del self._requests[entry.request_id]
        self._compact()

    def _compact(self) -> None:
        """Drop stale entries of the lazily cleaned heaps once they outnumber the live ones, so a
        long simulation (debt moves priorities every tick) does not grow them without bound."""
        if len(self._priority_heap) > 2 * len(self._priority_counts) + 64:
            self._priority_heap = list(self._priority_counts)
            heapq.heapify(self._priority_heap)
        if len(self._evictable_heap) > 2 * self.evictable_running + 64:
            self._evictable_heap = [
                item for item in self._evictable_heap
                if (request := self._requests.get(item[2])) is not None
                and request.state == RUNNING and request.seq == -item[1]
            ]
            heapq.heapify(self._evictable_heap)
        if len(self._waiting_heap) > 2 * self._waiting_count + 64:
            self._waiting_heap = [
                item for item in self._waiting_heap
                if (request := self._requests.get(item[2])) is not None
                and request.state == WAITING and request.seq == item[1]
            ]
            heapq.heapify(self._waiting_heap)
        if len(self._deadlines) > 2 * (self._waiting_count + self._queued_count) + 64:
            self._deadlines = [
                item for item in self._deadlines
                if (request := self._requests.get(item[2])) is not None
                and request.state == WAITING and request.seq == item[1]
            ]
            heapq.heapify(self._deadlines)

    def _leave_queue(self, entry: RequestRecord) -> None:
        """queued -> gone (cancelled or expired): it held nothing but its quota reservation."""
        record = entry.entitlement
        record.queue.remove(entry)
        if not record.queue:
            self._queued_ents.pop(record.limits.entitlement_id, None)
        entry.state = OUTCOME_CANCELLED
        self._queued_count -= 1
        self.quotas.refund(entry.request_id)
        del self._requests[entry.request_id]

    def _finish_waiting(self, entry: RequestRecord, now: float) -> float:
        record = entry.entitlement
        entry.state = OUTCOME_CANCELLED
        self._waiting_count -= 1
        record.accumulate(now)
        record.in_flight -= 1
        record.kv_in_flight -= entry.kv
        if record.bucket is not None:
            record.bucket.refund(entry.cost, now)
        self.quotas.refund(entry.request_id)
        del self._requests[entry.request_id]
        self._compact()
        return float(entry.cost)

    def _evict(self, entry: RequestRecord, now: float) -> float:
        refund = float(entry.max_tokens)
        record = entry.entitlement
        if record.bucket is not None:
            record.bucket.refund(refund, now)
        self._stop(entry, now)
        self.counters.evicted += 1
        return refund

    def _fits(self, entry: RequestRecord) -> bool:
        # Physically free and entitled: the same "free" as `admit` (the minimum of both views).
        missing_slots, missing_kv, entitled = self._room_for(entry)
        return entitled and missing_slots <= 0 and missing_kv <= 1e-9 and self.saturation < 1.0

    def _room_for(self, entry: RequestRecord) -> tuple[int, float, bool]:
        """(slots lacking, KV bytes lacking, entitled): the first two count physical room (<= 0
        when it is there); `entitled` says whether the request may claim room at all once
        evictable work gives way (the same two views as `admit`)."""
        missing_slots = 1 - (self.dispatch_capacity - self.running)
        missing_kv = entry.kv - (self.kv_capacity - self.kv_running)
        if entry.evictable:
            return missing_slots, missing_kv, True
        record = entry.entitlement
        # As in `admit`: other reservations' idle room is off limits, except that a request within its
        # own reservation may claim that much of it.
        unreachable_slots = missing_slots - self.evictable_running
        unreachable_kv = missing_kv - self.evictable_kv
        entitled = (
            unreachable_slots + (self.reserved_idle_slots - record.idle_slots) <= 0
            or (record.idle_slots > 0 and unreachable_slots <= 0)
        ) and (
            unreachable_kv + (self.reserved_idle_kv - record.idle_kv) <= 1e-9
            or (record.idle_kv > 0 and entry.kv - record.idle_kv <= 1e-9 and unreachable_kv <= 1e-9)
        )
        return missing_slots, missing_kv, entitled

    def _evict_for(self, entry: RequestRecord, now: float) -> tuple[list[str], list[str]]:
        """Evict lower-priority preemptible work so that `entry` can start (seed 004's in-flight
        eviction: lowest priority first, newest dispatch first among equals).

        All or nothing: victims are evicted only when at most `max_evictions_per_request` of them
        make room. Saturation alone does not trigger eviction: it is an external metric that an
        eviction here cannot be seen to lower, so evicting for it could empty the pool."""
        if self.saturation >= 1.0:
            return [], []
        missing_slots, missing_kv, entitled = self._room_for(entry)
        limit = self.config.max_evictions_per_request
        if not entitled or missing_slots > limit:
            return [], []
        chosen: list[tuple[float, int, str]] = []
        while missing_slots > 0 or missing_kv > 0:
            victim = self._lowest_evictable() if len(chosen) < limit else None
            if victim is None or victim[0] >= entry.priority:
                for item in chosen:  # not enough room even with every allowed victim: keep them
                    heapq.heappush(self._evictable_heap, item)
                return [], []
            heapq.heappop(self._evictable_heap)
            chosen.append(victim)
            victim_entry = self._requests[victim[2]]
            missing_slots -= 1
            missing_kv -= victim_entry.kv
        evicted: list[str] = []
        for _, _, request_id in chosen:
            self._evict(self._requests[request_id], now)
            evicted.append(request_id)
        return evicted, list(self._drain(now))

    def _drain(self, now: float) -> tuple[str, ...]:
        """Start waiting requests, highest priority first, while the pool has room for them; then let the
        entitlements' queues go, oldest head first."""
        started = self._drain_waiting(now) if self._waiting_heap else []
        if self._queued_ents:
            started += self._drain_queues(now)
        return tuple(started)

    def _drain_queues(self, now: float) -> list[str]:
        started: list[str] = []
        queued = self._queued_ents
        # Oldest head first; one queue (the usual case) needs no sort.
        order = list(queued.values()) if len(queued) == 1 else sorted(queued.values(), key=lambda r: r.queue[0].seq)
        for record in order:
            while record.queue:
                entry = record.queue[0]
                limits = record.limits
                if limits.state is not EntitlementState.BOUND:
                    break  # it may bind again before the deadline; else it expires
                fits = self._fits(entry)
                if not within_own_limits(limits, self.usage(limits.entitlement_id, now), entry.cost, entry.kv, fits):
                    break
                if not fits and entry.priority <= self.admission_threshold() and not self._budget_bound():
                    break
                # queued -> charged like an offer (bucket, in flight, KV bytes), then started or waiting
                record.queue.popleft()
                self._queued_count -= 1
                entry.own, entry.request, entry.state = False, None, ""
                self._charge(entry, now)
                if fits:
                    self._start(entry, now)
                    started.append(entry.request_id)
                else:
                    self._wait(entry, entry.deadline)
            if not record.queue:
                self._queued_ents.pop(record.limits.entitlement_id, None)
        return started

    def _drain_waiting(self, now: float) -> list[str]:
        heap = self._waiting_heap
        started: list[str] = []
        while heap:
            _, seq, request_id = heap[0]
            entry = self._requests.get(request_id)
            if entry is None or entry.state != WAITING or entry.seq != seq:
                heapq.heappop(heap)
                continue
            if not self._fits(entry):
                break
            heapq.heappop(heap)
            self._start(entry, now)
            started.append(request_id)
        return started

    # -- the EWMA tick (debt and burst) --------------------------------------------------------

    def tick(self, now: float) -> Mapping[str, Dynamics]:
        """Close the observation window: update debt (2) and burst (3) for every entitlement."""
        readings = self.tick_readings(now)
        if readings is None:
            return {key: record.dynamics for key, record in self._entitlements.items()}
        return {key: reading.dynamics for key, reading in readings.items()}

    def tick_readings(self, now: float) -> dict[str, WindowReading] | None:
        """`tick`, with the served and demanded rates each new EWMA state was computed from
        (`apps.policy.window.window_reading`, the same computation the Redis store's tick runs), for every
        entitlement: one at rest has the reading the formulas give from rest (`RESTING_READING`). None when
        the window was too short to measure (it stays open)."""
        closed = self._close_window(now)
        if closed is None:
            return None
        changes, tiers = closed
        # (2) and (3) from zero over a window with nothing in it give zero again: an entitlement at rest gets
        # that reading without being looked at.
        readings: dict[str, WindowReading] = dict.fromkeys(self._entitlements, RESTING_READING)
        for key in tiers:
            del readings[key]
        readings.update(changes)
        return readings

    def tick_changes(self, now: float) -> dict[str, WindowReading] | None:
        """`tick_readings` of the entitlements that were not at rest only (the others' readings are
        `RESTING_READING`): what a tick costs grows with the active entitlements, not with all of them."""
        closed = self._close_window(now)
        return None if closed is None else closed[0]

    def _close_window(self, now: float) -> tuple[dict[str, WindowReading], list[str]] | None:
        """Close the window of each entitlement not at rest: their readings, and the tiers closed (a tier has
        no reading)."""
        elapsed = now - self._last_tick
        if elapsed < MIN_TICK_WINDOW_S:
            # Rates over a vanishing window are infinite (a tick right after another one, a clock that
            # stood still): keep the window open and let the next tick measure it.
            return None
        readings: dict[str, WindowReading] = {}
        tiers: list[str] = []
        entitlements = self._entitlements
        for key in list(self._unsettled):
            record = entitlements[key]
            if record.at_rest():  # nothing runs or waits to integrate, nothing to decay
                self._unsettled.discard(key)
                continue
            record.accumulate(now)
            if record.limits.tier_of:
                # A tier has no baseline or share of its own to owe or exceed: its debt and burst stay nil (the
                # Redis store ticks the snapshot's entitlements, which tiers are not).
                record.window.reset()
                tiers.append(key)
                continue
            reading = window_reading(
                record.window.figures(), record.limits, record.dynamics, elapsed,
                expected_service_s=self.config.expected_service_s, config=self.dynamics_config,
            )
            record.dynamics = reading.dynamics
            record.window.reset()
            readings[key] = reading
        self._last_tick = now
        return readings, tiers

    # -- checks used by tests and the simulator ------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError when the books do not balance (used by property tests)."""
        check_invariants(self)

    def entitlement_ids(self) -> Iterable[str]:
        return self._entitlements.keys()

    def in_flight_counts(self) -> dict[str, int]:
        """The entitlements with requests in flight (waiting or running) and how many: what is active only."""
        entitlements = self._entitlements
        return {key: count for key in self._unsettled if (count := entitlements[key].in_flight)}

    def entitlement_records(self) -> Mapping[str, EntitlementRecord]:
        return self._entitlements

    def request_records(self) -> Mapping[str, RequestRecord]:
        return self._requests
