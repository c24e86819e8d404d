"""The per-pool DRR queue over the AIMD budget, on asyncio (no HTTP)."""

from __future__ import annotations

import asyncio

import pytest

from apps.gateway.errors import GatewayError
from apps.gateway.scheduler import PoolScheduler, aimd_tick_all


def scheduler(capacity: int = 1, timeout_s: float = 5.0) -> PoolScheduler:
    return PoolScheduler("p", capacity, acquire_timeout_s=timeout_s, ttft_target_s=1.0, min_budget=1, window_ticks=2)


def test_waiter_gets_the_slot_a_release_frees() -> None:
    async def scenario() -> None:
        s = scheduler()
        await s.acquire(flow="a", service_class="elastic", queue_max=4)
        waiting = asyncio.create_task(s.acquire(flow="b", service_class="elastic", queue_max=4))
        await asyncio.sleep(0)
        assert not waiting.done() and s.queued == 1
        s.release()
        await waiting
        assert s.in_flight == 1 and s.queued == 0

    asyncio.run(scenario())


def test_full_queue_rejects_at_once() -> None:
    async def scenario() -> str:
        s = scheduler()
        await s.acquire(flow="a", service_class="spot", queue_max=1)
        first = asyncio.create_task(s.acquire(flow="a", service_class="spot", queue_max=1))
        await asyncio.sleep(0)
        try:
            await s.acquire(flow="a", service_class="spot", queue_max=1)
        except GatewayError as error:
            first.cancel()
            return error.code
        return "admitted"

    assert asyncio.run(scenario()) == "queue_full"


def test_acquire_timeout_drops_the_waiter_and_keeps_counts_right() -> None:
    async def scenario() -> tuple[str, int, int]:
        s = scheduler(timeout_s=0.05)
        await s.acquire(flow="a", service_class="elastic", queue_max=4)
        with pytest.raises(GatewayError) as info:
            await s.acquire(flow="b", service_class="elastic", queue_max=4)
        s.release()
        return info.value.code, s.in_flight, s.queued

    assert asyncio.run(scenario()) == ("queue_timeout", 0, 0)


def test_cancelled_waiter_hands_its_slot_back() -> None:
    async def scenario() -> tuple[int, int]:
        s = scheduler()
        await s.acquire(flow="a", service_class="elastic", queue_max=4)
        waiting = asyncio.create_task(s.acquire(flow="b", service_class="elastic", queue_max=4))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        s.release()
        return s.in_flight, s.queued

    assert asyncio.run(scenario()) == (0, 0)


def test_drr_gives_the_heavier_class_more_of_a_contended_budget() -> None:
    async def scenario() -> list[str]:
        s = scheduler()
        await s.acquire(flow="hold", service_class="spot", queue_max=1)
        order: list[str] = []

        async def wait(flow: str, cls: str) -> None:
            await s.acquire(flow=flow, service_class=cls, queue_max=50)
            order.append(flow)

        tasks = [asyncio.create_task(wait("gold", "guaranteed")) for _ in range(20)]
        tasks += [asyncio.create_task(wait("free", "spot")) for _ in range(20)]
        await asyncio.sleep(0)
        for _ in range(18):
            s.release()
            await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return order

    order = asyncio.run(scenario())
    assert len(order) == 18
    # Weights 8 (guaranteed) to 1 (spot): 16 and 2 of 18 dispatches.
    assert order.count("gold") == 16
    assert order.count("free") == 2


def test_aimd_cuts_the_budget_on_slow_ttft_and_grows_it_on_fast() -> None:
    async def scenario() -> tuple[int, int, int]:
        s = PoolScheduler("p", 16, acquire_timeout_s=1.0, ttft_target_s=1.0, min_budget=2, window_ticks=1)
        start = s.budget
        for _ in range(20):
            s.observe_ttft(5.0)
        cut = aimd_tick_all([s])["p"]
        for _ in range(3):  # the cooldown after a decrease
            s.tick()
        await s.acquire(flow="a", service_class="elastic", queue_max=1)  # demand keeps the increase alive
        for _ in range(20):
            s.observe_ttft(0.01)
        grown = s.tick()
        return start, cut, grown

    start, cut, grown = asyncio.run(scenario())
    assert start == 16
    assert cut == 8
    assert grown == 9


def test_budget_floor_scales_with_the_pool_and_resizes() -> None:
    s = PoolScheduler("p", 64, acquire_timeout_s=1.0, ttft_target_s=1.0, min_budget_fraction=0.25, window_ticks=1)
    for _ in range(3):
        for _ in range(20):
            s.observe_ttft(30.0)
        s.tick()
        s.aimd.cooldown_left = 0
    assert s.budget == 16  # 64 -> 32 -> 16, then held at the floor
    s.resize(8)
    assert (s.aimd.min_cap, s.aimd.max_cap, s.budget) == (2, 8, 8)
