"""Gateway state behind one interface: in-process (embedded) or Redis (shared by every process).

The policy decides, the store commits. `admit` reads the entitlement's and the pool's usage,
runs `apps.policy.admit` in Python and applies the reservation (in-flight +1, KV bytes +k, token
bucket -cost); `release` undoes it, refunds the unused part of the token charge and adds the served
tokens to the counters the debt/burst tick reads. Release is idempotent per request id.

`MemoryStateStore` does all of that without awaiting in between, so on one asyncio loop it is
atomic without locks. `RedisStateStore` (apps.gateway.redis_state) reads with one Lua script and
commits with another that compares the versions it read (compare-and-set), retrying on conflict.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from apps.gateway.snapshot import PoolInfo
from apps.policy import (
    AdmissionDecision,
    AdmissionRequest,
    EntitlementLimits,
    EntitlementUsage,
    PoolUsage,
    TokenBucket,
    admit,
)


class StateStoreUnavailable(Exception):
    """The shared state store cannot be reached; the app answers 503 (or admits, if failing open)."""


@dataclass(slots=True)
class Reservation:
    request_id: str
    entitlement: str
    pool: str
    token_cost: int
    kv_bytes: float
    priority: float
    max_tokens: int
    input_tokens: int
    evictable: bool
    # False when admitted without accounting (fail open while the store was unreachable).
    accounted: bool = True


@dataclass(frozen=True, slots=True)
class RateView:
    """What the x-ratelimit-* headers report, as seen right after the decision."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    limit_tokens: float | None = None
    remaining_tokens: float | None = None
    reset_tokens_s: float = 0.0


@dataclass(frozen=True, slots=True)
class AdmitResult:
    decision: AdmissionDecision
    reservation: Reservation | None
    view: RateView
    # A shared store took the request's slot of the pool budget along with the reservation (`SlotRequest`).
    slot_taken: bool = False


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """Ask `admit` to take a slot of the pool's shared budget with the reservation (shared stores only)."""

    capacity: int
    lease_s: float


@dataclass(frozen=True, slots=True)
class SlotGrant:
    """The answer of a shared store to a request for one slot of a pool's budget."""

    granted: bool
    # The budget the store enforced (the published AIMD budget, clipped to the pool's capacity).
    budget: int
    # Slots held on the pool, every process together, after this call.
    held: int


@dataclass(slots=True)
class ServedCounters:
    tokens: int = 0
    requests: int = 0
    demand_tokens: int = 0
    rejected: int = 0


def rate_view(limits: EntitlementLimits, in_flight: int, tokens_available: float) -> RateView:
    capacity = limits.bucket_capacity
    rate = limits.tokens_per_second
    remaining_tokens = None if capacity is None else max(0.0, min(tokens_available, capacity))
    reset = 0.0
    if capacity is not None and rate and remaining_tokens is not None:
        reset = (capacity - remaining_tokens) / rate
    limit_requests = limits.concurrency
    return RateView(
        limit_requests=limit_requests,
        remaining_requests=None if limit_requests is None else max(0, limit_requests - in_flight),
        limit_tokens=capacity,
        remaining_tokens=remaining_tokens,
        reset_tokens_s=reset,
    )


class GatewayStateStore(ABC):
    @abstractmethod
    async def admit(
        self, *, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, saturation: float = 0.0,
        slot: SlotRequest | None = None,
    ) -> AdmitResult: ...

    @abstractmethod
    async def release(self, *, reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> bool:
        """Undo a reservation, refund unused tokens, count what was served; False if already released."""

    @abstractmethod
    async def record_rejection(self, *, entitlement: str, token_cost: int) -> None:
        """Count unmet demand (a capacity rejection) for the debt tick."""

    @abstractmethod
    async def entitlement_usage(self, *, limits: EntitlementLimits) -> EntitlementUsage: ...

    @abstractmethod
    async def pool_running(self, *, pool: str) -> int: ...

    @abstractmethod
    async def served_drain(self, *, entitlement: str) -> ServedCounters:
        """Counters since the last drain (the debt/burst tick reads and resets them)."""

    @abstractmethod
    async def dynamics_set(self, *, entitlement: str, debt: float, burst: float) -> None: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass

    # Preemption across processes. The in-process store needs none of it: every request it knows
    # runs in this process, where the gateway cancels victims directly.
    async def leases_renew(self, *, request_ids: list[str]) -> None:  # noqa: B027 - optional hook
        """Keep the reservations of this process's running requests alive (shared stores only)."""

    async def leases_reap(self) -> int:
        """Release reservations of processes that died (shared stores only); returns how many."""
        return 0

    async def evict_candidates(self, *, pool: str, below_priority: float, limit: int) -> list[str]:
        return []

    async def evictions_publish(self, *, request_ids: list[str]) -> None:  # noqa: B027 - optional hook
        pass

    async def evictions_listen(self, handler: Callable[[str], None]) -> None:  # noqa: B027 - optional hook
        """Call `handler(request_id)` for each eviction any process publishes (runs until cancelled)."""

    # One pool budget for every gateway process (seed 002's "one controller per pool"). The in-process
    # store needs none of it: its process's `PoolScheduler` is the only one dispatching to the pool.
    shares_budget: bool = False

    async def slot_acquire(self, *, pool: str, request_id: str, capacity: int, lease_s: float) -> SlotGrant:
        """Take a slot of the pool's budget for `request_id` if fewer than the budget are held (a slot it
        already holds is renewed); slots whose lease ran out (their process died) are dropped first."""
        return SlotGrant(True, capacity, 0)

    async def slot_release(self, *, pool: str, request_id: str) -> None:  # noqa: B027 - optional hook
        """Give the slot back (idempotent)."""

    async def slots_renew(self, *, pool: str, request_ids: list[str], lease_s: float) -> None:  # noqa: B027
        """Extend the leases of slots this process holds."""

    async def pool_budgets_set(self, *, budgets: Mapping[str, int]) -> None:  # noqa: B027 - optional hook
        """Publish the pools' budgets (the shared AIMD tick)."""

    async def pool_budget(self, *, pool: str) -> int | None:
        """The published budget of the pool; None when none was published."""
        return None


@dataclass(slots=True)
class _EntitlementState:
    in_flight: int = 0
    kv_bytes: float = 0.0
    bucket: TokenBucket | None = None
    debt: float = 0.0
    burst: float = 0.0
    served: ServedCounters = field(default_factory=ServedCounters)


@dataclass(slots=True)
class _PoolState:
    running: int = 0
    kv_bytes: float = 0.0
    priorities: dict[str, float] = field(default_factory=dict)
    evictable: dict[str, float] = field(default_factory=dict)
    evictable_kv: float = 0.0


def _monotonic() -> float:
    return time.monotonic()


class MemoryStateStore(GatewayStateStore):
    """The embedded store: plain dicts on one event loop (no await between read and commit)."""

    def __init__(self, clock: object = None) -> None:
        self._now = clock if callable(clock) else _monotonic
        self._entitlements: dict[str, _EntitlementState] = {}
        self._pools: dict[str, _PoolState] = {}
        self._reservations: dict[str, Reservation] = {}

    def _entitlement(self, limits: EntitlementLimits, now: float) -> _EntitlementState:
        state = self._entitlements.get(limits.entitlement_id)
        if state is None:
            state = self._entitlements[limits.entitlement_id] = _EntitlementState()
        capacity = limits.bucket_capacity
        if capacity is None:
            state.bucket = None
        elif state.bucket is None:
            state.bucket = TokenBucket(capacity, limits.tokens_per_second or 0.0, now=now)
        elif state.bucket.capacity != capacity or state.bucket.refill_rate != limits.tokens_per_second:
            state.bucket.set_rate(capacity, limits.tokens_per_second or 0.0, now)
        return state

    def _pool(self, name: str) -> _PoolState:
        state = self._pools.get(name)
        if state is None:
            state = self._pools[name] = _PoolState()
        return state

    def _pool_usage(self, pool: PoolInfo, state: _PoolState, saturation: float) -> PoolUsage:
        idle_slots = 0
        idle_kv = 0.0
        for entitlement, concurrency, kv_bytes in pool.reserved:
            other = self._entitlements.get(entitlement)
            running, kv = (other.in_flight, other.kv_bytes) if other is not None else (0, 0.0)
            idle_slots += max(0, concurrency - running)
            idle_kv += max(0.0, kv_bytes - kv)
        return PoolUsage(
            concurrency_capacity=pool.concurrency_capacity,
            kv_capacity=pool.kv_capacity,
            running=state.running,
            kv_bytes_running=state.kv_bytes,
            reserved_idle_concurrency=idle_slots,
            reserved_idle_kv=idle_kv,
            saturation=saturation,
            admission_threshold=min(state.priorities.values(), default=-math.inf),
            mean_slo_ms=pool.mean_slo_ms,
            lowest_evictable_priority=min(state.evictable.values(), default=None),
            evictable_running=len(state.evictable),
            evictable_kv_bytes=state.evictable_kv,
        )

    async def admit(
        self, *, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, saturation: float = 0.0,
        slot: SlotRequest | None = None,
    ) -> AdmitResult:
        # One process: no shared budget, so `slot` is never taken here.
        now = self._now()
        ent = self._entitlement(limits, now)
        pool_state = self._pool(pool.name)
        tokens = ent.bucket.level(now) if ent.bucket is not None else math.inf
        usage = EntitlementUsage(ent.in_flight, ent.kv_bytes, ent.in_flight, ent.kv_bytes, tokens, ent.debt, ent.burst)
        decision = admit(limits, usage, self._pool_usage(pool, pool_state, saturation), request)
        if not decision.admitted:
            return AdmitResult(decision, None, rate_view(limits, ent.in_flight, tokens))
        if ent.bucket is not None:
            ent.bucket.try_consume(decision.token_cost, now)
            tokens = ent.bucket.level(now)
        ent.in_flight += 1
        ent.kv_bytes += decision.kv_bytes
        pool_state.running += 1
        pool_state.kv_bytes += decision.kv_bytes
        evictable = limits.traits.evictable
        pool_state.priorities[request.request_id] = decision.priority
        if evictable:
            pool_state.evictable[request.request_id] = decision.priority
            pool_state.evictable_kv += decision.kv_bytes
        reservation = Reservation(
            request_id=request.request_id,
            entitlement=limits.entitlement_id,
            pool=pool.name,
            token_cost=decision.token_cost,
            kv_bytes=decision.kv_bytes,
            priority=decision.priority,
            max_tokens=decision.max_tokens,
            input_tokens=request.input_tokens,
            evictable=evictable,
        )
        self._reservations[request.request_id] = reservation
        return AdmitResult(decision, reservation, rate_view(limits, ent.in_flight, tokens))

    async def release(self, *, reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> bool:
        if self._reservations.pop(reservation.request_id, None) is None:
            return False
        now = self._now()
        ent = self._entitlements[reservation.entitlement]
        ent.in_flight -= 1
        ent.kv_bytes = max(0.0, ent.kv_bytes - reservation.kv_bytes)
        used = max(0, prompt_tokens) + max(0, completion_tokens)
        if ent.bucket is not None and reservation.token_cost > used:
            ent.bucket.refund(reservation.token_cost - used, now)
        ent.served.tokens += used
        ent.served.requests += 1
        ent.served.demand_tokens += used
        pool_state = self._pools[reservation.pool]
        pool_state.running -= 1
        pool_state.kv_bytes = max(0.0, pool_state.kv_bytes - reservation.kv_bytes)
        pool_state.priorities.pop(reservation.request_id, None)
        if pool_state.evictable.pop(reservation.request_id, None) is not None:
            pool_state.evictable_kv = max(0.0, pool_state.evictable_kv - reservation.kv_bytes)
        return True

    async def record_rejection(self, *, entitlement: str, token_cost: int) -> None:
        state = self._entitlements.setdefault(entitlement, _EntitlementState())
        state.served.rejected += 1
        state.served.demand_tokens += max(0, token_cost)

    async def entitlement_usage(self, *, limits: EntitlementLimits) -> EntitlementUsage:
        now = self._now()
        ent = self._entitlement(limits, now)
        tokens = ent.bucket.level(now) if ent.bucket is not None else math.inf
        return EntitlementUsage(ent.in_flight, ent.kv_bytes, ent.in_flight, ent.kv_bytes, tokens, ent.debt, ent.burst)

    async def pool_running(self, *, pool: str) -> int:
        state = self._pools.get(pool)
        return 0 if state is None else state.running

    async def served_drain(self, *, entitlement: str) -> ServedCounters:
        state = self._entitlements.get(entitlement)
        if state is None:
            return ServedCounters()
        drained, state.served = state.served, ServedCounters()
        return drained

    async def dynamics_set(self, *, entitlement: str, debt: float, burst: float) -> None:
        state = self._entitlements.setdefault(entitlement, _EntitlementState())
        state.debt, state.burst = debt, burst
