"""`AdmissionLedger`: in-memory pool state that applies `admit` decisions, releases and refunds.

The simulator and the gateway's in-process store both drive this object; the Redis store keeps the
same quantities in Redis and calls the same pure `admit`. Every request offered ends in exactly one
outcome: rejected, or admitted (possibly after waiting) and then completed or evicted, or expired
while waiting (`wait_timeout_s`, the blog's acquire timeout) or cancelled while waiting.

Time is always passed in (`now`, seconds); randomness only jitters Retry-After and comes from an
injected `random.Random` (seeded in tests and in the simulator).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from apps.policy.admission import (
    CAPACITY_REASONS,
    DEFAULT_ADMISSION_CONFIG,
    AdmissionConfig,
    AdmissionDecision,
    AdmissionRequest,
    EntitlementLimits,
    EntitlementUsage,
    PoolUsage,
    Reason,
    admit,
)
from apps.policy.bucket import TokenBucket
from apps.policy.classes import ResourceVector
from apps.policy.errors import PolicyConfigError, require_non_negative
from apps.policy.priority import Dynamics, DynamicsConfig, update_dynamics

RUNNING = "running"
WAITING = "waiting"

OUTCOME_REJECTED = "rejected"
OUTCOME_COMPLETED = "completed"
OUTCOME_EVICTED = "evicted"
OUTCOME_EXPIRED = "expired"
OUTCOME_CANCELLED = "cancelled"
# A tick closer than this to the previous one measures nothing (rates over it would be infinite).
MIN_TICK_WINDOW_S = 1e-6


@dataclass(frozen=True, slots=True)
class LedgerResult:
    """A decision plus what it set in motion: requests that started (including this one when it
    was admitted straight away) and requests that were evicted to make room."""

    decision: AdmissionDecision
    started: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    outcome: str
    started: tuple[str, ...] = ()
    refunded_tokens: float = 0.0


class _Entitlement:
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
        "last_change",
        "slot_seconds",
        "kv_seconds",
        "waiting_seconds",
        "tokens_served",
        "completed",
        "rejected_count",
        "rejected_tokens",
        "rejected_kv",
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
        self.last_change = now
        self.reset_window()

    def reset_window(self) -> None:
        self.slot_seconds = 0.0
        self.kv_seconds = 0.0
        self.waiting_seconds = 0.0
        self.tokens_served = 0.0
        self.completed = 0
        self.rejected_count = 0
        self.rejected_tokens = 0.0
        self.rejected_kv = 0.0

    def count_refusal(self, tokens: float, kv: float) -> None:
        """A request turned away for lack of capacity (rejected, or expired while waiting): the demand
        that the next EWMA tick adds to what was served."""
        self.rejected_count += 1
        self.rejected_tokens += tokens
        self.rejected_kv += kv

    def accumulate(self, now: float) -> None:
        elapsed = now - self.last_change
        if elapsed > 0:
            self.slot_seconds += self.running * elapsed
            self.kv_seconds += self.kv_running * elapsed
            self.waiting_seconds += (self.in_flight - self.running) * elapsed
            self.last_change = now

    def reserved_idle(self) -> tuple[int, float]:
        limits = self.limits
        if not self.reserved:
            return 0, 0.0
        slots = max(0, (limits.concurrency or 0) - self.running)
        kv = max(0.0, (limits.kv_bytes or 0.0) - self.kv_running)
        return slots, kv


class _Request:
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
    )
    request_id: str
    entitlement: _Entitlement
    priority: float
    cost: int
    kv: float
    input_tokens: int
    max_tokens: int
    evictable: bool
    state: str
    enqueued_at: float
    seq: int


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
    ) -> None:
        self._check_capacity(concurrency_capacity, kv_capacity)
        self.concurrency_capacity = concurrency_capacity
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
        self._entitlements: dict[str, _Entitlement] = {}
        self._requests: dict[str, _Request] = {}
        self._priority_counts: dict[float, int] = {}
        self._priority_heap: list[float] = []
        self._evictable_heap: list[tuple[float, int, str]] = []
        self._waiting_heap: list[tuple[float, int, str]] = []
        # Waiting requests in arrival order: with one timeout for all, the oldest expire first.
        self._waiting_fifo: deque[_Request] = deque()
        self._waiting_count = 0
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

    def upsert_entitlement(self, limits: EntitlementLimits, now: float) -> None:
        record = self._entitlements.get(limits.entitlement_id)
        if record is None:
            record = _Entitlement(limits, now)
            self._entitlements[limits.entitlement_id] = record
        else:
            record.accumulate(now)
            record.limits = limits
            record.reserved = limits.traits.reserved
            capacity = limits.bucket_capacity
            if capacity is None:
                record.bucket = None
            elif record.bucket is None:
                record.bucket = TokenBucket(capacity, limits.tokens_per_second or 0.0, now=now)
            else:
                record.bucket.set_rate(capacity, limits.tokens_per_second or 0.0, now)
        self._refresh_reserved(record)
        self._refresh_mean_slo()
        self._drain(now)

    def remove_entitlement(self, entitlement_id: str) -> None:
        record = self._entitlements.get(entitlement_id)
        if record is None:
            return
        if record.in_flight:
            raise PolicyConfigError(
                f"entitlement {entitlement_id!r} still has {record.in_flight} requests in flight; "
                "mark it expired and remove it once they finish"
            )
        self.reserved_idle_slots -= record.idle_slots
        self.reserved_idle_kv -= record.idle_kv
        del self._entitlements[entitlement_id]
        self._refresh_mean_slo()

    def set_capacity(self, concurrency_capacity: int, now: float, kv_capacity: float | None = None) -> tuple[str, ...]:
        """Resize the pool. A shrink never cancels running work: new starts wait for releases."""
        kv = self.kv_capacity if kv_capacity is None else kv_capacity
        self._check_capacity(concurrency_capacity, kv)
        self.concurrency_capacity = concurrency_capacity
        self.kv_capacity = float(kv)
        return self._drain(now)

    def set_saturation(self, saturation: float, now: float) -> tuple[str, ...]:
        if saturation != saturation or saturation < 0:
            raise PolicyConfigError(f"saturation must be a number >= 0, got {saturation!r}")
        self.saturation = float(saturation)
        return self._drain(now)

    def limits(self, entitlement_id: str) -> EntitlementLimits | None:
        record = self._entitlements.get(entitlement_id)
        return None if record is None else record.limits

    def dynamics(self, entitlement_id: str) -> Dynamics:
        return self._entitlements[entitlement_id].dynamics

    def set_dynamics(self, entitlement_id: str, dynamics: Dynamics) -> None:
        """Restore debt/burst (e.g. from a shared store or a previous run)."""
        self._entitlements[entitlement_id].dynamics = dynamics

    def _refresh_reserved(self, record: _Entitlement) -> None:
        slots, kv = record.reserved_idle()
        self.reserved_idle_slots += slots - record.idle_slots
        self.reserved_idle_kv += kv - record.idle_kv
        record.idle_slots, record.idle_kv = slots, kv

    def _refresh_mean_slo(self) -> None:
        if self._fixed_mean_slo_ms is not None:
            return
        targets = [record.limits.slo_target_ms for record in self._entitlements.values()]
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
        return EntitlementUsage(
            in_flight=record.in_flight,
            kv_bytes_in_flight=record.kv_in_flight,
            running=record.running,
            kv_bytes_running=record.kv_running,
            tokens_available=math.inf if record.bucket is None else record.bucket.level(now),
            debt=record.dynamics.debt,
            burst=record.dynamics.burst,
        )

    def pool_usage(self) -> PoolUsage:
        lowest = self._lowest_evictable()
        return PoolUsage(
            concurrency_capacity=self.concurrency_capacity,
            kv_capacity=self.kv_capacity,
            running=self.running,
            kv_bytes_running=self.kv_running,
            reserved_idle_concurrency=self.reserved_idle_slots,
            reserved_idle_kv=self.reserved_idle_kv,
            saturation=self.saturation,
            admission_threshold=self.admission_threshold(),
            mean_slo_ms=self._mean_slo_ms,
            lowest_evictable_priority=None if lowest is None else lowest[0],
            evictable_running=self.evictable_running,
            evictable_kv_bytes=self.evictable_kv,
        )

    @property
    def waiting(self) -> int:
        return self._waiting_count

    def request_state(self, request_id: str) -> str | None:
        request = self._requests.get(request_id)
        return None if request is None else request.state

    def in_flight_ids(self) -> list[str]:
        return list(self._requests)

    # -- the request lifecycle -----------------------------------------------------------------

    def request(self, entitlement_id: str, request: AdmissionRequest, now: float) -> LedgerResult:
        """Offer a request: run the checks, then charge, start, queue or reject it."""
        counters = self.counters
        counters.offered += 1
        record = self._entitlements.get(entitlement_id)
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
        decision = admit(record.limits, self.usage(entitlement_id, now), self.pool_usage(), request, self.config)
        if not decision.admitted and not decision.queued:
            return self._rejected(record, decision)

        entry = _Request()
        entry.request_id = request.request_id
        entry.entitlement = record
        entry.priority = decision.priority
        entry.cost = decision.token_cost
        entry.kv = decision.kv_bytes
        entry.input_tokens = request.input_tokens
        entry.max_tokens = decision.max_tokens
        entry.evictable = record.limits.traits.evictable
        entry.enqueued_at = now
        entry.state = ""
        self._seq += 1
        entry.seq = self._seq
        if record.bucket is not None:
            record.bucket.try_consume(entry.cost, now)
        record.accumulate(now)
        record.in_flight += 1
        record.kv_in_flight += entry.kv
        self._requests[entry.request_id] = entry
        if decision.admitted:
            counters.admitted += 1
            self._start(entry, now)
            return LedgerResult(decision, started=(entry.request_id,))

        counters.queued += 1
        entry.state = WAITING
        self._waiting_count += 1
        heapq.heappush(self._waiting_heap, (-entry.priority, entry.seq, entry.request_id))
        self._waiting_fifo.append(entry)
        evicted: list[str] = []
        started: list[str] = []
        if decision.evict:
            evicted, started = self._evict_for(entry, now)
        started.extend(self._drain(now))
        return LedgerResult(decision, started=tuple(started), evicted=tuple(evicted))

    def release(self, request_id: str, now: float, output_tokens: int | None = None) -> ReleaseResult:
        """Completion callback: free the slot and KV, refund the unused `max_tokens`, start waiters.

        Releasing a waiting request cancels it (client went away) and refunds its whole charge.
        Unknown ids are ignored (a duplicate callback must not corrupt state)."""
        entry = self._requests.get(request_id)
        if entry is None:
            return ReleaseResult("unknown")
        if entry.state == WAITING:
            refunded = self._finish_waiting(entry, now)
            self.counters.cancelled += 1
            return ReleaseResult(OUTCOME_CANCELLED, self._drain(now), refunded)
        produced = entry.max_tokens
        if isinstance(output_tokens, int | float) and output_tokens == output_tokens:
            # A bogus count (negative, too large) is clamped; a missing or NaN one refunds nothing.
            produced = int(min(max(output_tokens, 0), entry.max_tokens))
        refund = float(entry.max_tokens - produced)
        record = entry.entitlement
        if refund and record.bucket is not None:
            record.bucket.refund(refund, now)
        self._stop(entry, now)
        record.tokens_served += entry.input_tokens + produced
        record.completed += 1
        self.counters.completed += 1
        return ReleaseResult(OUTCOME_COMPLETED, self._drain(now), refund)

    def expire_waiting(self, now: float) -> list[str]:
        """Reject requests that waited longer than `wait_timeout_s`; their charge is refunded."""
        timeout = self.config.wait_timeout_s
        fifo = self._waiting_fifo
        expired: list[_Request] = []
        while fifo:
            entry = fifo[0]
            if entry.state != WAITING or self._requests.get(entry.request_id) is not entry:
                fifo.popleft()  # started or cancelled since
                continue
            if now - entry.enqueued_at < timeout:
                break
            fifo.popleft()
            expired.append(entry)
        for entry in expired:
            self._finish_waiting(entry, now)
            entry.entitlement.count_refusal(entry.cost, entry.kv)
            self.counters.expired += 1
        return [entry.request_id for entry in expired]

    def evict(self, request_id: str, now: float) -> ReleaseResult:
        """Terminate a running request (preemption); its unproduced output is refunded."""
        entry = self._requests.get(request_id)
        if entry is None or entry.state != RUNNING:
            return ReleaseResult("unknown")
        refund = self._evict(entry, now)
        return ReleaseResult(OUTCOME_EVICTED, self._drain(now), refund)

    # -- internals -----------------------------------------------------------------------------

    def _rejected(self, record: _Entitlement | None, decision: AdmissionDecision) -> LedgerResult:
        counters = self.counters
        counters.rejected += 1
        counters.by_reason[decision.reason] = counters.by_reason.get(decision.reason, 0) + 1
        if record is not None and decision.reason in CAPACITY_REASONS:
            record.count_refusal(decision.token_cost, decision.kv_bytes)
        if self.retry_jitter and decision.retryable:
            # Spread retries so that a recovery does not meet a thundering herd (seed 000, 5.3).
            decision = decision._replace(
                retry_after_s=decision.retry_after_s * (1.0 + self.retry_jitter * self.rng.random())
            )
        return LedgerResult(decision)

    def _start(self, entry: _Request, now: float) -> None:
        record = entry.entitlement
        record.accumulate(now)
        if entry.state == WAITING:
            self._waiting_count -= 1
        entry.state = RUNNING
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

    def _stop(self, entry: _Request, now: float) -> None:
        record = entry.entitlement
        record.accumulate(now)
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

    def _finish_waiting(self, entry: _Request, now: float) -> float:
        record = entry.entitlement
        entry.state = OUTCOME_CANCELLED
        self._waiting_count -= 1
        record.accumulate(now)
        record.in_flight -= 1
        record.kv_in_flight -= entry.kv
        if record.bucket is not None:
            record.bucket.refund(entry.cost, now)
        del self._requests[entry.request_id]
        self._compact()
        return float(entry.cost)

    def _evict(self, entry: _Request, now: float) -> float:
        refund = float(entry.max_tokens)
        record = entry.entitlement
        if record.bucket is not None:
            record.bucket.refund(refund, now)
        self._stop(entry, now)
        self.counters.evicted += 1
        return refund

    def _fits(self, entry: _Request) -> bool:
        # Physically free and entitled: the same "free" as `admit` (the minimum of both views).
        missing_slots, missing_kv, entitled = self._room_for(entry)
        return entitled and missing_slots <= 0 and missing_kv <= 1e-9 and self.saturation < 1.0

    def _room_for(self, entry: _Request) -> tuple[int, float, bool]:
        """(slots lacking, KV bytes lacking, entitled): the first two count physical room (<= 0
        when it is there); `entitled` says whether the request may claim room at all once
        evictable work gives way (the same two views as `admit`)."""
        missing_slots = 1 - (self.concurrency_capacity - self.running)
        missing_kv = entry.kv - (self.kv_capacity - self.kv_running)
        if entry.evictable:
            return missing_slots, missing_kv, True
        record = entry.entitlement
        entitled = (
            missing_slots - self.evictable_running + (self.reserved_idle_slots - record.idle_slots) <= 0
            and missing_kv - self.evictable_kv + (self.reserved_idle_kv - record.idle_kv) <= 1e-9
        )
        return missing_slots, missing_kv, entitled

    def _evict_for(self, entry: _Request, now: float) -> tuple[list[str], list[str]]:
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
        """Start waiting requests, highest priority first, while the pool has room for them."""
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
        return tuple(started)

    # -- the EWMA tick (debt and burst) --------------------------------------------------------

    def tick(self, now: float) -> Mapping[str, Dynamics]:
        """Close the observation window: update debt (2) and burst (3) for every entitlement.

        Served rates come from what actually ran (slot-seconds, KV byte-seconds, tokens of completed
        requests); demand adds what was refused for lack of capacity or is still waiting, with a
        refused request counted as one mean holding time of slots (Little's law)."""
        elapsed = now - self._last_tick
        if elapsed < MIN_TICK_WINDOW_S:
            # Rates over a vanishing window are infinite (a tick right after another one, a clock that
            # stood still): keep the window open and let the next tick measure it.
            return {key: record.dynamics for key, record in self._entitlements.items()}
        updated: dict[str, Dynamics] = {}
        for key, record in self._entitlements.items():
            record.accumulate(now)
            hold_s = record.slot_seconds / record.completed if record.completed else self.config.expected_service_s
            served = ResourceVector(
                tokens_per_second=record.tokens_served / elapsed,
                kv_bytes=record.kv_seconds / elapsed,
                concurrency=record.slot_seconds / elapsed,
            )
            demand = ResourceVector(
                tokens_per_second=(record.tokens_served + record.rejected_tokens) / elapsed,
                kv_bytes=(record.kv_seconds + record.rejected_kv * hold_s) / elapsed,
                concurrency=(record.slot_seconds + record.waiting_seconds + record.rejected_count * hold_s) / elapsed,
            )
            limits = record.limits
            baseline = ResourceVector(
                tokens_per_second=limits.tokens_per_second or 0.0,
                kv_bytes=limits.kv_bytes or 0.0,
                concurrency=limits.concurrency or 0,
            )
            record.dynamics = update_dynamics(
                record.dynamics, limits.service_class, baseline, demand, served, self.dynamics_config
            )
            record.reset_window()
            updated[key] = record.dynamics
        self._last_tick = now
        return updated

    # -- checks used by tests and the simulator ------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError when the books do not balance (used by property tests)."""
        c = self.counters
        in_flight = len(self._requests)
        closed = c.rejected + c.completed + c.evicted + c.expired + c.cancelled
        assert c.offered == closed + in_flight, (c, in_flight)
        running = [r for r in self._requests.values() if r.state == RUNNING]
        assert self.running == len(running)
        assert self._waiting_count == sum(1 for r in self._requests.values() if r.state == WAITING)
        assert self.evictable_running == sum(1 for r in running if r.evictable)
        assert math.isclose(self.evictable_kv, sum(r.kv for r in running if r.evictable), abs_tol=1e-6)
        assert math.isclose(self.kv_running, sum(r.kv for r in running), abs_tol=1e-6)
        assert len(self._priority_heap) <= 2 * len(self._priority_counts) + 65
        assert len(self._evictable_heap) <= 2 * self.evictable_running + 65 + len(self._requests)
        reserved = [record.reserved_idle() for record in self._entitlements.values()]
        assert self.reserved_idle_slots == sum(slots for slots, _ in reserved)
        for key, record in self._entitlements.items():
            mine = [r for r in self._requests.values() if r.entitlement is record]
            assert record.in_flight == len(mine), key
            assert record.running == sum(1 for r in mine if r.state == RUNNING), key
            assert math.isclose(record.kv_in_flight, sum(r.kv for r in mine), abs_tol=1e-6), key
            if record.bucket is not None:
                assert -1e-9 <= record.bucket._level <= record.bucket.capacity + 1e-9, key

    def entitlement_ids(self) -> Iterable[str]:
        return self._entitlements.keys()
