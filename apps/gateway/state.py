"""The gateway's state: the admission state machine of every pool it serves, behind one interface.

The transitions are `apps.policy.AdmissionLedger`'s (offer, wait, start, complete, cancel, expire, evict,
tick). `MemoryStateStore` (apps.gateway.memory_state) drives one ledger per pool; `RedisStateStore`
(apps.gateway.redis_state) applies the same transitions in Lua so that every gateway process shares one
set of pools, and `make conformance` proves the two equal to the ledger on one table of scenarios. Every
method of the interface is the state machine's (a transition or a read) and both stores implement each one;
what several processes on one store share besides (other processes' events, request leases, usage counted by
the release, one budget controller) is not the store's: `apps.gateway.peers`.

What both share lives here: the types of an offer's outcome, and the waiting room of this process, where a
request whose offer ended `waiting` waits until a transition anywhere starts it (a release, an eviction, more
capacity), or until the acquire timeout expires it, or until its client goes away (the caller releases it,
which cancels it).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from apps.gateway.snapshot import PoolInfo
from apps.policy import (
    AdmissionConfig,
    AdmissionDecision,
    AdmissionRequest,
    Dynamics,
    EntitlementLimits,
    EntitlementUsage,
    ServiceClass,
)
from apps.policy.admission import DEFAULT_ADMISSION_CONFIG
from apps.policy.ledger import RUNNING, WAITING, ReleaseResult
from apps.policy.quota import QuotaCharge, QuotaClaim, QuotaStanding
from apps.policy.window import WindowReading

REJECTED = "rejected"
# A waiter the state machine expects to fit without a release (its bucket refilling) wakes it then, no sooner than
# MIN_WAKE_S, and again every WAKE_AGAIN_S while it still waits (another request may have taken the refill).
MIN_WAKE_S = 0.005
WAKE_AGAIN_S = 0.05
# How long after its deadline a waiter keeps asking the store to expire it (the store's clock may run a
# little behind this process's), before it cancels itself.
EXPIRY_GRACE_S = 1.0
# Start notifications that arrived before their waiter registered (another process's release raced the
# offer's reply), kept this long.
EARLY_NOTICE_S = 30.0


class StateStoreUnavailable(Exception):
    """The shared state store cannot be reached; the app answers 503 (or admits, if failing open)."""

    # Whether GATEWAY_FAIL_OPEN may admit past it: only when the store is really away.
    may_fail_open = True


class StateStoreBusy(StateStoreUnavailable):
    """The store is there but this call could not be served in time (no connection of the pool came free,
    Redis busy running a script): never a reason to fail open, and a release that met it is tried again."""

    may_fail_open = False


@dataclass(slots=True)
class Reservation:
    """A request the state machine holds (waiting or running): what the gateway needs to release it."""

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
    # Whose quotas the request reserved against (`QuotaClaim.scope`); None: no quota applies.
    quota_scope: str | None = None
    # The class the request is served as (its entitlement's, or a lower one: spilled over, demoted).
    service_tier: str = ""


@dataclass(frozen=True, slots=True)
class UsageKey:
    """Where a released request's usage is counted: its tenant, and the minute of the release."""

    tenant_id: int
    minute: int
    # The class that served it (the usage records count tokens per served tier).
    service_tier: str = ""


@dataclass(frozen=True, slots=True)
class RateView:
    """What the x-ratelimit-* headers report, as seen right after the decision."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    limit_tokens: float | None = None
    remaining_tokens: float | None = None
    reset_tokens_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Offer:
    """How an offer ended: `state` is running, waiting or rejected. `started` and `evicted` are the other
    requests the transition started (waiters) or evicted (preemptible work making room)."""

    decision: AdmissionDecision
    reservation: Reservation | None
    view: RateView
    state: str
    started: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()
    # The binding quota after the offer (the x-tokenpools-quota-* headers); None: no quota applies.
    quota: QuotaStanding | None = None


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


def reservation_for(limits: EntitlementLimits, pool: str, request: AdmissionRequest,
                    decision: AdmissionDecision, quota: QuotaClaim | None = None) -> Reservation:
    # A request served at a lower tier (spilled over, demoted: apps.policy.tiers) is that class's: a preemptible
    # one may be evicted.
    served = ServiceClass.parse(decision.served_class) if decision.served_class else limits.service_class
    assert isinstance(served, ServiceClass)
    return Reservation(
        request_id=request.request_id, entitlement=limits.entitlement_id, pool=pool,
        token_cost=decision.token_cost, kv_bytes=decision.kv_bytes, priority=decision.priority,
        max_tokens=decision.max_tokens, input_tokens=request.input_tokens, evictable=served.traits.evictable,
        quota_scope=None if quota is None else quota.scope, service_tier=served.value,
    )


class GatewayStateStore(ABC):
    """The admission state machine of every pool, as the gateway drives it."""

    # Seconds between checks of a waiter's state in the store, for stores whose start notifications can be
    # lost (another process's, over pub/sub); None: every start is notified in this process.
    poll_s: float | None = None
    # The state machine's parameters (the acquire timeout of a waiter among them).
    config: AdmissionConfig = DEFAULT_ADMISSION_CONFIG

    def __init__(self) -> None:
        self._waiters: dict[str, asyncio.Future[bool]] = {}
        self._early: OrderedDict[str, tuple[float, bool]] = OrderedDict()
        # Called with the id of every request of this process that a transition evicted (the gateway cancels it).
        self.on_evict: Callable[[str], None] = lambda request_id: None

    # --- the transitions -------------------------------------------------------------------------------

    @abstractmethod
    async def sync_pool(self, *, pool: PoolInfo, saturation: float = 0.0) -> None:
        """Capacity, reservations and saturation as the snapshot has them; more room starts waiters."""

    @abstractmethod
    async def offer(
        self, *, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, saturation: float = 0.0,
        quota: QuotaClaim | None = None,
    ) -> Offer:
        """Reserve the request's quota, run the ordered checks and start, queue or reject the request (with
        its evictions); a rejection refunds the quota."""

    @abstractmethod
    async def release(
        self, *, reservation: Reservation, prompt_tokens: int | None = None, completion_tokens: int | None = None,
        usage: UsageKey | None = None,
    ) -> ReleaseResult:
        """Complete a running request (refunding what it did not use) or cancel a waiting one; the outcome
        is `completed`, `cancelled`, or `unknown` when it was released, evicted or expired already. With a
        `usage` key (`apps.gateway.peers.Peers.usage_key`: only a shared store's peers give one) the tokens
        served are counted under it in the same step. The request's quota reservation is settled at what it
        used (given prompt, or as counted at admission, plus output).

        Ordered: once its coroutine has run its first step (a task started, then one turn of the event loop),
        the release comes before any later offer of this process, even before its own answer is back. So the
        end of an answer need not wait for that answer (`apps.gateway.account`): the client's next request,
        sent as soon as it sees the end, finds the room free."""

    @abstractmethod
    async def quota_leases(self, *, scope: str, request_ids: Sequence[str], lease_s: float) -> list[str]:
        """Renew the leases of these requests' quota holds in `scope`, then settle the holds whose lease
        lapsed at their whole amount (`QuotaBook.reap`); returns the ids settled."""

    @abstractmethod
    async def quota_standings(self, *, scope: str, charges: Sequence[QuotaCharge]) -> list[QuotaStanding]:
        """Where each of a scope's quotas stands in the charge's window (nothing reserved)."""

    @abstractmethod
    async def expire(self, *, pool: str) -> list[str]:
        """Turn away the pool's requests that waited the acquire timeout; returns their ids."""

    @abstractmethod
    async def tick(
        self, *, entitlements: Mapping[str, Sequence[EntitlementLimits]]
    ) -> dict[str, dict[str, WindowReading]]:
        """Close every pool's served/demand window: debt and burst of each entitlement (`entitlements` by pool
        name). By pool, the readings of its entitlements that were not at rest: one absent had nothing in flight,
        nothing in its window and no debt or burst, and its reading is `RESTING_READING` (so a tick costs what is
        active, not every entitlement). A pool is absent when its window stayed open (too short to measure)."""

    # --- reads ------------------------------------------------------------------------------------------

    @abstractmethod
    async def entitlement_usage(self, *, limits: EntitlementLimits, pool: str) -> EntitlementUsage: ...

    @abstractmethod
    async def pool_running(self, *, pool: str) -> int: ...

    @abstractmethod
    async def request_state(self, *, reservation: Reservation) -> str | None:
        """`running`, `waiting`, or None once it left the state machine."""

    @abstractmethod
    async def in_flight(self, *, pool: PoolInfo) -> dict[str, int]:
        """The store's own count of requests in flight (waiting or running) by entitlement of the pool, of
        the entitlements holding any (one absent holds none): what it holds, whichever process admitted them (a
        leak shows here). Its cost is that of the busy entitlements, not of the pool's size."""

    @abstractmethod
    async def dynamics(self, *, pool: str, entitlements: Sequence[str]) -> dict[str, Dynamics]:
        """The debt and burst of the pool's `entitlements` as the last tick left them (at rest for one the store
        never saw): many in one read, for the gauges."""

    @abstractmethod
    async def close(self) -> None:
        """Let go of what the store holds outside the state machine (connections)."""

    @abstractmethod
    async def ping(self, *, timeout_s: float) -> None:
        """Raise when the store does not answer within `timeout_s` (/readyz)."""

    # --- waiting ----------------------------------------------------------------------------------------

    def _expect(self, request_id: str) -> asyncio.Future[bool]:
        """The future a waiter awaits: True once started, False once turned away (expired or cancelled)."""
        future = self._waiters.get(request_id)
        if future is None:
            future = self._waiters[request_id] = asyncio.get_running_loop().create_future()
            early = self._early.pop(request_id, None)
            if early is not None:
                future.set_result(early[1])
        return future

    def _notify(self, started: Sequence[str] = (), gone: Sequence[str] = (), evicted: Sequence[str] = (),
                *, remember: bool = False) -> None:
        """Deliver the outcome of a transition to this process's waiters and victims. `remember`: keep
        notices for requests not (yet) waiting here (they came from another process)."""
        for ids, result in ((started, True), (gone, False)):
            for request_id in ids:
                future = self._waiters.pop(request_id, None)
                if future is not None:
                    if not future.done():
                        future.set_result(result)
                elif remember:
                    self._remember(request_id, result)
        for request_id in evicted:
            self.on_evict(request_id)

    def _remember(self, request_id: str, result: bool) -> None:
        now = time.monotonic()
        early = self._early
        early[request_id] = (now, result)
        while early and (len(early) > 10_000 or next(iter(early.values()))[0] < now - EARLY_NOTICE_S):
            early.popitem(last=False)

    def _forget(self, request_id: str) -> None:
        future = self._waiters.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    async def wait(self, *, reservation: Reservation, timeout_s: float, wake_s: float | None = None) -> bool:
        """Wait until the waiting `reservation` starts (True) or is turned away (False): at `timeout_s` the
        store expires whoever waited that long. `wake_s`: when the state machine expects room without a release
        (a queue's bucket refilling), it is woken then (`expire`), and again every `WAKE_AGAIN_S` after. A
        cancellation (client gone) propagates; the caller then releases the reservation, which cancels it in the
        store."""
        request_id = reservation.request_id
        future = self._expect(request_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        wake_at = None if wake_s is None else loop.time() + max(wake_s, MIN_WAKE_S)
        while not future.done():
            now = loop.time()
            remaining = deadline - now
            if remaining <= 0:
                break
            step = remaining if self.poll_s is None else min(remaining, self.poll_s)
            if wake_at is not None:
                step = min(step, max(wake_at - now, 0.0))
            try:
                return await asyncio.wait_for(asyncio.shield(future), step)
            except TimeoutError:
                if wake_at is not None and loop.time() >= wake_at:
                    wake_at = loop.time() + WAKE_AGAIN_S
                    await self.expire(pool=reservation.pool)
                    if future.done():
                        break
                if self.poll_s is not None:
                    state = await self.request_state(reservation=reservation)
                    if state != WAITING:
                        self._waiters.pop(request_id, None)
                        return state == RUNNING
        if future.done():
            return future.result()
        return await self._expire_me(reservation, future)

    async def _expire_me(self, reservation: Reservation, future: asyncio.Future[bool]) -> bool:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + EXPIRY_GRACE_S
        while True:
            await self.expire(pool=reservation.pool)
            if future.done():
                return future.result()
            state = await self.request_state(reservation=reservation)
            if state != WAITING:
                self._waiters.pop(reservation.request_id, None)
                return state == RUNNING
            if loop.time() >= give_up:
                self._forget(reservation.request_id)
                await self.release(reservation=reservation)
                return False
            await asyncio.sleep(0.01)

    # --- the pools' dispatch budgets (seed 002's AIMD: a check of the state machine) ---------------------

    @abstractmethod
    async def pool_budgets_set(self, *, budgets: Mapping[str, int | None]) -> list[str]:
        """The pools' dispatch budgets in their state machines (None: the capacity alone); a larger budget
        starts waiters (returned), a smaller one cancels nothing."""

    @abstractmethod
    async def pool_budget(self, *, pool: str) -> int | None:
        """The pool's dispatch budget; None when none is set."""
