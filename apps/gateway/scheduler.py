"""Per-pool flow control (seed 002): DRR over a global budget, per-entitlement queue_max, acquire
timeout, and the budget tuned by AIMD on the gateway's own p99 TTFT (one controller per pool).

`PoolScheduler` wraps `apps.policy.BudgetScheduler` for asyncio: a request whose ticket is dispatched
at once goes straight on (no future, no timer: the common path stays cheap); otherwise it waits for
its ticket up to the acquire timeout.

In one process (the in-process state store) the scheduler is the pool's only dispatcher: its own
AIMD controller tunes its budget (`aimd_tick_all`, every `aimd_tick_s`). With a shared store (Redis,
several gateway processes) the budget is the pool's, not the process's: the local DRR queue still
orders this process's waiters, but a dispatch also takes one of the budget's slots in the store: in the
admission script itself when this process would dispatch at once (`slot_request`), else in a script of its
own; the reservation's release gives it back. The head of this process's dispatched-but-slotless
waiters polls for a slot (woken at once by a release in this process) until the acquire timeout.
Slots carry a lease the gateway's lease tick renews, so a dead process's slots come back. The budget
itself is tuned by the one shared controller (`apps.gateway.control.aimd_tick_shared`), which reads the TTFT
counts every process flushes (`take_ttft`) and publishes the budget the slot script enforces.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Coroutine, Iterable
from dataclasses import replace
from typing import Any

from apps.gateway.errors import GatewayError, rejected, unavailable
from apps.gateway.state import (
    GatewayStateStore,
    SlotGrant,
    SlotRequest,
    StateStoreBusy,
    StateStoreUnavailable,
)
from apps.policy import (
    CLASS_TRAITS,
    AimdParams,
    BudgetScheduler,
    FlowConfig,
    LatencyHistogram,
    aimd_step,
    ttft_histogram_bounds,
)
from apps.policy.aimd import aimd_bounds

logger = logging.getLogger(__name__)

# DRR weights per service class: integer shares of the budget when every flow is backlogged.
CLASS_DRR_WEIGHTS = {str(cls): traits.drr_weight for cls, traits in CLASS_TRAITS.items()}
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
# A shared slot's lease: renewed every LEASE_RENEW_S (10 s) by the gateway's lease tick while its request
# runs; a slot not renewed for this long belonged to a process that died and is dropped on the next dispatch.
SLOT_LEASE_S = 60.0
# How often the head of the waiters polls for a shared slot freed by another process (a release in
# this process wakes it at once): from the first value, doubling up to the second.
SLOT_POLL_S = (0.002, 0.025)


class PoolScheduler:
    def __init__(
        self,
        name: str,
        capacity: int,
        *,
        acquire_timeout_s: float,
        ttft_target_s: float,
        min_budget: int = 1,
        min_budget_fraction: float = 0.0,
        window_ticks: int = 6,
        store: GatewayStateStore | None = None,
        fail_open: bool = False,
        slot_lease_s: float = SLOT_LEASE_S,
    ) -> None:
        self.name = name
        self.capacity = max(1, capacity)
        self.acquire_timeout_s = acquire_timeout_s
        self.scheduler = BudgetScheduler(self.capacity, default_flow=FlowConfig(), acquire_timeout_s=acquire_timeout_s)
        self.aimd_params = AimdParams(target_p99_s=ttft_target_s, window_ticks=window_ticks, min_budget=min_budget,
                                      min_budget_fraction=min_budget_fraction)
        # This process's own controller between ticks (`apps.policy.aimd_step`, the shared controller's step).
        self.aimd = aimd_bounds(None, self.capacity, self.aimd_params)
        # Bounds at the deadband's edges: the controller's p99 is then a measurement, not interpolation.
        self.histogram = LatencyHistogram(ttft_histogram_bounds(ttft_target_s, self.aimd_params.band),
                                          window_ticks=window_ticks)
        # Shared budget (a store shared by several processes): None keeps this process's own controller.
        self.store = store if store is not None and store.shares_budget else None
        self.fail_open, self.slot_lease_s = fail_open, slot_lease_s
        self.held: set[str] = set()  # request ids holding a shared slot
        self._gate: deque[tuple[str, asyncio.Future[None]]] = deque()  # dispatched here, no shared slot yet
        self._pump: asyncio.Task | None = None
        self._slot_freed: asyncio.Event | None = None
        self._background: set[asyncio.Task] = set()
        self._pending = [0] * (len(self.histogram.bounds) + 1)  # TTFT counts not flushed yet

    def resize(self, capacity: int) -> None:
        """Pool capacity changed (replicas enabled/disabled): new AIMD bounds, the cap clipped into them."""
        capacity = max(1, capacity)
        if capacity == self.capacity:
            return
        self.capacity = capacity
        # New floor and ceiling, the cap clipped into them; a resize ends a cooldown (a new controller).
        self.aimd = replace(aimd_bounds(self.aimd, capacity, self.aimd_params), cooldown_left=0)
        self._set_budget(min(self.budget, capacity) if self.shared else self.aimd.cap)

    @property
    def shared(self) -> bool:
        """The budget is the pool's, enforced in a store shared by several gateway processes."""
        return self.store is not None

    def _set_budget(self, budget: int) -> None:
        if budget != self.scheduler.budget:
            self._wake(self.scheduler.set_budget(max(0, budget), time.monotonic()))

    def _flow(self, flow: str, weight: int, queue_max: int) -> None:
        config = self.scheduler.flows.get(flow)
        if config is None or config.weight != weight or config.queue_max != queue_max:
            # Entitlements appear (and change class or queue depth) after the pool's scheduler exists.
            self.scheduler.set_flow(flow, FlowConfig(weight=weight, queue_max=queue_max))

    def slot_request(self) -> SlotRequest | None:
        """With a shared store, what to ask the admission script for when this process would dispatch the
        request at once (nobody of it queued, local budget free): its shared slot, in the same round trip."""
        if (self.store is None or self.scheduler.in_flight >= self.scheduler.budget or self.scheduler.queued
                or self._slotless_waiting()):
            return None
        return SlotRequest(self.capacity, self.slot_lease_s)

    async def acquire(self, *, flow: str, service_class: str, queue_max: int, request_id: str | None = None,
                      slot_taken: bool = False) -> None:
        """Wait for a slot of the pool budget; raises a 429 `queue_full` / `queue_timeout` GatewayError
        (a 503 `state_store_unavailable` when a shared store is away and the gateway fails closed).
        With a shared store, `request_id` names the slot; give the same to `release_request`.
        `slot_taken`: the admission already took the shared slot (`slot_request`)."""
        self._flow(flow, CLASS_DRR_WEIGHTS.get(service_class, 1), queue_max)
        now = time.monotonic()
        if self.store is not None:
            deadline = now + self.acquire_timeout_s
            await self._acquire_local(flow, now)
            if slot_taken and request_id is not None:
                self.held.add(request_id)
                return
            try:
                await self._acquire_shared(request_id or uuid.uuid4().hex, deadline)
            except BaseException:
                self.release()
                raise
            return
        await self._acquire_local(flow, now)

    async def _acquire_local(self, flow: str, now: float) -> None:
        """This process's DRR queue: who of its waiters goes next."""
        waiter: asyncio.Future[None] | None = None
        if self.scheduler.in_flight >= self.scheduler.budget or self.scheduler.queued:
            waiter = asyncio.get_running_loop().create_future()
        result = self.scheduler.submit(flow, waiter, now)
        if not result.accepted:
            raise rejected(
                QUEUE_FULL, f"The queue of this entitlement on pool {self.name!r} is full.",
                retry_after_s=self.acquire_timeout_s, retryable=True,
            )
        self._wake(result.dispatched)
        if waiter is None:
            return
        if not waiter.done():
            try:
                await asyncio.wait_for(asyncio.shield(waiter), self.acquire_timeout_s)
            except TimeoutError:
                for ticket in self.scheduler.expire(time.monotonic()):
                    if ticket.item is not None and not ticket.item.done():
                        ticket.item.set_exception(_timeout_error(self.name, self.acquire_timeout_s))
                if not waiter.done():  # not the oldest ticket after all: drop it when dispatched
                    waiter.cancel()
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self.release()  # dispatched just as the client went away
                else:
                    waiter.cancel()
                raise
        if waiter.cancelled():
            raise _timeout_error(self.name, self.acquire_timeout_s)
        waiter.result()  # re-raises the timeout set by expire

    def release(self) -> None:
        """Give back a slot of this process's budget (the local one; see `release_request`)."""
        self._wake(self.scheduler.release(time.monotonic()))

    async def release_request(self, request_id: str, *, store_releases_slot: bool = False) -> None:
        """Give back the slot `acquire(request_id=...)` took: the shared one first (so the next waiter
        can take it), then this process's. `store_releases_slot`: the reservation's release in the store
        frees the shared slot in its own script (call `slot_freed` after it); only this process's is given
        back here."""
        try:
            if request_id in self.held:
                self.held.discard(request_id)
                if not store_releases_slot:
                    await asyncio.shield(self._drop_slot(request_id))
        finally:
            self.release()

    def slot_freed(self) -> None:
        """A shared slot went back (by the store's release): the first slotless waiter asks again now."""
        if self._slot_freed is not None:
            self._slot_freed.set()

    # --- the shared budget (several gateway processes) ---------------------------------------------

    async def _try_slot(self, request_id: str) -> SlotGrant:
        assert self.store is not None
        grant = await self.store.slot_acquire(pool=self.name, request_id=request_id, capacity=self.capacity,
                                              lease_s=self.slot_lease_s)
        self._set_budget(grant.budget)
        return grant

    def _slotless_waiting(self) -> bool:
        """Someone of this process was dispatched locally and still waits for its shared slot."""
        return any(not future.done() for _, future in self._gate)

    async def _acquire_shared(self, request_id: str, deadline: float) -> None:
        if not self._slotless_waiting():
            # Nobody of this process is waiting for a slot: one round trip, the common path. Counted as
            # held while asking, so a client leaving mid-call gives back a slot the script may have taken.
            self.held.add(request_id)
            try:
                grant = await self._try_slot(request_id)
            except StateStoreUnavailable as exc:
                self.held.discard(request_id)
                if self.fail_open and exc.may_fail_open:
                    return
                raise store_error(exc) from None
            except BaseException:
                self.held.discard(request_id)
                self._spawn(self._drop_slot(request_id))
                raise
            if grant.granted:
                return
            self.held.discard(request_id)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._gate.append((request_id, future))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump(), name=f"slots-{self.name}")
        try:
            await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            if future.done() and not future.cancelled() and future.exception() is None:
                return  # granted just as the time ran out
            future.cancel()  # the pump hands back a slot it gets for it
            raise _timeout_error(self.name, self.acquire_timeout_s) from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._spawn(self._drop_slot(request_id))
                self.held.discard(request_id)
            else:
                future.cancel()
            raise
        future.result()  # a store error set by the pump

    async def _run_pump(self) -> None:
        """Hand shared slots to this process's slotless waiters in order (the DRR's): the head asks the
        store; when the budget is full it waits for a release here, or polls for one elsewhere."""
        if self._slot_freed is None:
            self._slot_freed = asyncio.Event()
        delay = SLOT_POLL_S[0]
        while self._gate:
            request_id, future = self._gate[0]
            if future.done():
                self._gate.popleft()
                continue
            self._slot_freed.clear()
            try:
                grant = await self._try_slot(request_id)
            except StateStoreUnavailable as exc:
                self._gate.popleft()
                if not future.done():
                    if self.fail_open and exc.may_fail_open:
                        future.set_result(None)
                    else:
                        future.set_exception(store_error(exc))
                continue
            except Exception:
                logger.exception("shared slot of pool %s", self.name)
                grant = SlotGrant(False, self.budget, 0)
            if grant.granted:
                self._gate.popleft()
                if future.done():  # gave up while we asked: the slot goes back
                    await self._drop_slot(request_id)
                else:
                    self.held.add(request_id)
                    future.set_result(None)
                delay = SLOT_POLL_S[0]
                continue
            try:
                await asyncio.wait_for(self._slot_freed.wait(), delay)
            except TimeoutError:
                delay = min(SLOT_POLL_S[1], delay * 2)

    async def _drop_slot(self, request_id: str) -> None:
        assert self.store is not None
        try:
            await self.store.slot_release(pool=self.name, request_id=request_id)
        except StateStoreUnavailable:
            logger.warning("could not release the slot of %s: state store unreachable (its lease frees it)",
                           request_id)
        self.slot_freed()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def renew_slots(self) -> None:
        """Extend the leases of the shared slots this process holds (the gateway's lease tick)."""
        if self.store is not None and self.held:
            await self.store.slots_renew(pool=self.name, request_ids=list(self.held), lease_s=self.slot_lease_s)

    async def refresh_budget(self) -> int:
        """Read the pool's published budget (so gauges show it between dispatches); returns it."""
        if self.store is not None:
            published = await self.store.pool_budget(pool=self.name)
            self._set_budget(self.capacity if published is None else min(published, self.capacity))
        return self.budget

    def take_ttft(self) -> list[int] | None:
        """TTFT counts over `histogram.bounds` (+Inf last) observed since the last call; None if none."""
        if not any(self._pending):
            return None
        counts, self._pending = self._pending, [0] * len(self._pending)
        return counts

    def _wake(self, tickets: Iterable) -> None:
        abandoned = 0
        for ticket in tickets:
            waiter = ticket.item
            if waiter is None:
                continue
            if waiter.done():  # its request gave up waiting: hand the slot straight back
                abandoned += 1
            else:
                waiter.set_result(None)
        for _ in range(abandoned):
            self.release()

    def observe_ttft(self, seconds: float) -> None:
        self.histogram.observe(seconds)
        if self.store is not None:
            self._pending[bisect.bisect_left(self.histogram.bounds, seconds)] += 1

    def tick(self) -> int:
        """One AIMD step over the TTFT window; applies the new budget. With a shared budget the pool's one
        controller tunes it elsewhere: only the local window moves on (for `p99`)."""
        if self.store is not None:
            self.histogram.rotate()
            return self.budget
        self.aimd = aimd_step(self.aimd, capacity=self.capacity, counts=self.histogram.counts(),
                              bounds=self.histogram.bounds, params=self.aimd_params,
                              has_demand=self.scheduler.has_demand)
        self.histogram.rotate()
        cap = self.aimd.cap
        if cap != self.scheduler.budget:
            self._wake(self.scheduler.set_budget(cap, time.monotonic()))
        return cap

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def in_flight(self) -> int:
        return self.scheduler.in_flight

    @property
    def budget(self) -> int:
        return self.scheduler.budget

    def p99(self) -> float | None:
        value = self.histogram.quantile(0.99)
        return None if value is None or math.isnan(value) else value


def store_error(exc: Exception) -> GatewayError:
    """503: the store is away (`state_store_unavailable`), or there but too busy to answer in time
    (`state_store_busy`: no connection of the pool came free; never failed open)."""
    if isinstance(exc, StateStoreBusy):
        return unavailable("state_store_busy", f"The gateway state store is busy, try again: {exc}")
    return unavailable("state_store_unavailable", f"The gateway state store is unreachable: {exc}")


def _timeout_error(pool: str, timeout_s: float) -> GatewayError:
    return rejected(
        QUEUE_TIMEOUT, f"No slot of pool {pool!r} freed up within {timeout_s:g}s.",
        retry_after_s=timeout_s, retryable=True,
    )


def aimd_tick_all(schedulers: Iterable[PoolScheduler]) -> dict[str, int]:
    """Tick every pool's controller once; returns the new budgets by pool (for logs and tests)."""
    return {scheduler.name: scheduler.tick() for scheduler in schedulers}
