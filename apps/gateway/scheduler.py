"""Per-pool flow control (seed 002): DRR over a global budget, per-entitlement queue_max, acquire
timeout, and the budget tuned by AIMD on the gateway's own p99 TTFT (one controller per pool).

`PoolScheduler` wraps `apps.policy.BudgetScheduler` for asyncio: a request whose ticket is dispatched
at once goes straight on (no future, no timer: the common path stays cheap); otherwise it waits for
its ticket up to the acquire timeout. `aimd_tick_all` is the per-process tick (the embedded ticker
calls it every `aimd_tick_s`; a Celery beat task may call it instead).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable

from apps.gateway.errors import GatewayError, rejected
from apps.policy import AimdController, BudgetScheduler, FlowConfig, LatencyHistogram

# DRR weights per service class: integer shares of the budget when every flow is backlogged.
CLASS_DRR_WEIGHTS = {"dedicated": 8, "guaranteed": 8, "elastic": 4, "spot": 1, "preemptible": 1}
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"


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
    ) -> None:
        self.name = name
        self.capacity = max(1, capacity)
        self.acquire_timeout_s = acquire_timeout_s
        self.scheduler = BudgetScheduler(self.capacity, default_flow=FlowConfig(), acquire_timeout_s=acquire_timeout_s)
        self.min_budget, self.min_budget_fraction = min_budget, min_budget_fraction
        self.aimd = AimdController(ttft_target_s, self._floor(self.capacity), self.capacity, initial_cap=self.capacity)
        # Bounds at the deadband's edges: the controller's p99 is then a measurement, not interpolation.
        self.histogram = LatencyHistogram(self.aimd.histogram_bounds(), window_ticks=window_ticks)

    def _floor(self, capacity: int) -> int:
        # Seed 002, fix #1: below some budget, cutting concurrency only lengthens the queue and the
        # TTFT the controller reacts to (the death spiral), so the floor scales with the pool.
        floor = max(1, self.min_budget, math.ceil(capacity * self.min_budget_fraction))
        return min(floor, capacity)

    def resize(self, capacity: int) -> None:
        """Pool capacity changed (replicas enabled/disabled): new AIMD bounds, the cap clipped into them."""
        capacity = max(1, capacity)
        if capacity == self.capacity:
            return
        self.capacity = capacity
        old = self.aimd
        floor = self._floor(capacity)
        cap = min(max(old.cap, floor), capacity)
        self.aimd = AimdController(old.target_p99_s, floor, capacity, initial_cap=cap)
        self._wake(self.scheduler.set_budget(self.aimd.cap, time.monotonic()))

    def _flow(self, flow: str, weight: int, queue_max: int) -> None:
        config = self.scheduler.flows.get(flow)
        if config is None or config.weight != weight or config.queue_max != queue_max:
            self.scheduler.flows[flow] = FlowConfig(weight=weight, queue_max=queue_max)
            # BudgetScheduler takes flows at construction; entitlements appear later, so their DRR
            # weight is set on its DRR directly (ask apps/policy for a public `set_flow`).
            self.scheduler._drr.set_weight(flow, weight)

    async def acquire(self, *, flow: str, service_class: str, queue_max: int) -> None:
        """Wait for a slot of the pool budget; raises a 429 `queue_full` / `queue_timeout` GatewayError."""
        self._flow(flow, CLASS_DRR_WEIGHTS.get(service_class, 1), queue_max)
        now = time.monotonic()
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
        self._wake(self.scheduler.release(time.monotonic()))

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

    def tick(self) -> int:
        """One AIMD step over the TTFT window; applies the new budget."""
        cap = self.aimd.tick_histogram(self.histogram, self.scheduler.has_demand)
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


def _timeout_error(pool: str, timeout_s: float) -> GatewayError:
    return rejected(
        QUEUE_TIMEOUT, f"No slot of pool {pool!r} freed up within {timeout_s:g}s.",
        retry_after_s=timeout_s, retryable=True,
    )


def aimd_tick_all(schedulers: Iterable[PoolScheduler]) -> dict[str, int]:
    """Tick every pool's controller once; returns the new budgets by pool (for logs and tests)."""
    return {scheduler.name: scheduler.tick() for scheduler in schedulers}
