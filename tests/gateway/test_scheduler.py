"""The per-pool DRR queue over the AIMD budget, on asyncio (no HTTP)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import pytest

from apps.gateway.errors import GatewayError
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.scheduler import PoolScheduler, aimd_tick_all
from tests.support.services import free_port


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
        s.aimd = replace(s.aimd, cooldown_left=0)
    assert s.budget == 16  # 64 -> 32 -> 16, then held at the floor
    s.resize(8)
    assert (s.aimd.min_cap, s.aimd.max_cap, s.budget) == (2, 8, 8)


# --- one budget shared by several gateway processes (Redis) ---------------------------------------


async def _shared(redis_url: str, prefix: str, *, capacity: int = 8, timeout_s: float = 5.0,
                  lease_s: float = 60.0) -> PoolScheduler:
    """A gateway process's scheduler of pool "p": its own Redis client, the Redis every process shares."""
    store = RedisStateStore(url=redis_url, prefix=prefix)
    return PoolScheduler("p", capacity, acquire_timeout_s=timeout_s, ttft_target_s=1.0, window_ticks=2,
                         store=store, slot_lease_s=lease_s)


async def _close(*schedulers: PoolScheduler) -> None:
    for s in schedulers:
        assert s.store is not None
        await s.store.close()


@pytest.mark.redis
def test_two_processes_never_dispatch_more_than_the_shared_budget(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}:"

    async def scenario() -> tuple[int, int, list[int]]:
        first, second = await _shared(redis_url, prefix), await _shared(redis_url, prefix)
        assert first.store is not None
        await first.store.pool_budgets_set(budgets={"p": 3})  # what the shared AIMD tick published
        running, peak, done = 0, 0, 0

        async def request(s: PoolScheduler, n: int) -> None:
            nonlocal running, peak, done
            rid = f"r{n}"
            await s.acquire(flow=f"f{n % 2}", service_class="elastic", queue_max=50, request_id=rid)
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.02)
            running -= 1
            await s.release_request(rid)
            done += 1

        await asyncio.gather(*(request(first if n % 2 else second, n) for n in range(24)))
        budgets = [first.budget, second.budget, first.in_flight + second.in_flight]
        await _close(first, second)
        return peak, done, budgets

    peak, done, budgets = asyncio.run(scenario())
    assert done == 24
    assert peak == 3  # the budget was used, never exceeded (each process alone would have allowed 8)
    assert budgets == [3, 3, 0]  # both enforce (and report) the pool's budget, nothing left held


@pytest.mark.redis
def test_a_release_in_one_process_lets_a_waiter_in_the_other_through(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}:"

    async def scenario() -> tuple[bool, float, int]:
        first, second = await _shared(redis_url, prefix), await _shared(redis_url, prefix)
        assert first.store is not None
        await first.store.pool_budgets_set(budgets={"p": 1})
        await first.acquire(flow="a", service_class="elastic", queue_max=4, request_id="holder")
        waiting = asyncio.create_task(second.acquire(flow="b", service_class="elastic", queue_max=4,
                                                     request_id="waiter"))
        await asyncio.sleep(0.3)
        blocked = not waiting.done()
        released = time.monotonic()
        await first.release_request("holder")
        await asyncio.wait_for(waiting, 2.0)
        latency = time.monotonic() - released
        held = await first.store.redis.zrange(first.store._slot_keys("p")[0], 0, -1)  # type: ignore[attr-defined]
        await second.release_request("waiter")
        await _close(first, second)
        return blocked, latency, len(held) if held != ["waiter"] else -1

    blocked, latency, held = asyncio.run(scenario())
    assert blocked  # the other process held the pool's only slot
    assert latency < 0.2  # its poll picked the freed slot up within a few milliseconds
    assert held == -1  # the slot now belongs to the waiter


@pytest.mark.redis
def test_a_dead_holders_slot_comes_back_after_its_lease_and_a_live_one_is_renewed(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}:"

    async def scenario() -> tuple[str, float]:
        live = await _shared(redis_url, prefix, lease_s=0.4)
        other = await _shared(redis_url, prefix, timeout_s=1.0)
        assert live.store is not None
        await live.store.pool_budgets_set(budgets={"p": 1})
        await live.acquire(flow="a", service_class="elastic", queue_max=4, request_id="live")

        async def renew() -> None:  # the gateway's lease tick, faster than the lease
            while True:
                await asyncio.sleep(0.1)
                await live.renew_slots()

        renewing = asyncio.create_task(renew())
        try:
            await other.acquire(flow="b", service_class="elastic", queue_max=4, request_id="o1")
            refused = "admitted"
        except GatewayError as error:
            refused = error.code
        renewing.cancel()
        # The holder dies: no release, no renewal. Its slot is free once its lease runs out.
        await _close(live)
        other.acquire_timeout_s = other.scheduler.acquire_timeout_s = 3.0
        started = time.monotonic()
        await other.acquire(flow="b", service_class="elastic", queue_max=4, request_id="o2")
        waited = time.monotonic() - started
        await other.release_request("o2")
        await _close(other)
        return refused, waited

    refused, waited = asyncio.run(scenario())
    assert refused == "queue_timeout"  # a renewed lease keeps the slot for 1 s (2.5 leases)
    assert 0.2 < waited < 1.0  # the rest of the lease (0.4 s from its last renewal), plus the polling


@pytest.mark.redis
def test_shared_slot_timeout_frees_the_local_slot_and_fails_closed_without_redis(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}:"

    async def scenario() -> tuple[str, int, int, str, bool]:
        first = await _shared(redis_url, prefix)
        second = await _shared(redis_url, prefix, timeout_s=0.2)
        assert first.store is not None
        await first.store.pool_budgets_set(budgets={"p": 1})
        await first.acquire(flow="a", service_class="elastic", queue_max=4, request_id="h")
        with pytest.raises(GatewayError) as timeout:
            await second.acquire(flow="b", service_class="elastic", queue_max=4, request_id="w")
        local = (second.in_flight, second.queued)
        await first.release_request("h")
        await first.store.slot_release(pool="p", request_id="h")  # idempotent
        await _close(first, second)
        # Redis away: 503 when failing closed (as admission does), through without a slot when open.
        dead = f"redis://127.0.0.1:{free_port()}/0"
        closed = PoolScheduler("p", 2, acquire_timeout_s=1.0, ttft_target_s=1.0,
                               store=RedisStateStore(url=dead, socket_timeout_s=0.2))
        with pytest.raises(GatewayError) as down:
            await closed.acquire(flow="a", service_class="elastic", queue_max=4, request_id="x")
        opened = PoolScheduler("p", 2, acquire_timeout_s=1.0, ttft_target_s=1.0, fail_open=True,
                               store=RedisStateStore(url=dead, socket_timeout_s=0.2))
        await opened.acquire(flow="a", service_class="elastic", queue_max=4, request_id="y")
        through = opened.in_flight == 1 and not opened.held and closed.in_flight == 0
        await _close(closed, opened)
        return timeout.value.code, *local, down.value.code, through

    assert asyncio.run(scenario()) == ("queue_timeout", 0, 0, "state_store_unavailable", True)


@pytest.mark.redis
def test_shared_scheduler_counts_ttft_for_the_flush_and_leaves_the_budget_to_the_pool(redis_url: str) -> None:
    async def scenario() -> tuple[list[int] | None, list[int] | None, int]:
        s = await _shared(redis_url, f"t{uuid.uuid4().hex}:", capacity=16)
        for _ in range(20):
            s.observe_ttft(5.0)
        counts = s.take_ttft()
        again = s.take_ttft()
        budget = s.tick()  # no per-process controller: slow TTFTs do not cut this process's budget
        await _close(s)
        return counts, again, budget

    counts, again, budget = asyncio.run(scenario())
    assert counts is not None and sum(counts) == 20 and again is None
    assert budget == 16


@pytest.mark.redis
def test_free_slot_costs_one_call_and_a_waiter_that_leaves_holds_nothing(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}:"

    async def scenario() -> tuple[int, tuple[int, int, int], list[str]]:
        first, second = await _shared(redis_url, prefix), await _shared(redis_url, prefix)
        assert first.store is not None and second.store is not None
        await first.store.pool_budgets_set(budgets={"p": 1})
        calls = 0
        slot_acquire = first.store.slot_acquire

        async def counted(**kwargs: object) -> object:
            nonlocal calls
            calls += 1
            return await slot_acquire(**kwargs)  # type: ignore[arg-type]

        first.store.slot_acquire = counted  # type: ignore[method-assign]
        await first.acquire(flow="a", service_class="elastic", queue_max=4, request_id="h")
        waiting = asyncio.create_task(second.acquire(flow="b", service_class="elastic", queue_max=4,
                                                     request_id="w"))
        await asyncio.sleep(0.1)
        waiting.cancel()  # the client went away while waiting for the pool's slot
        await asyncio.gather(waiting, return_exceptions=True)
        left = (second.in_flight, second.queued, len(second.held))
        await first.release_request("h")
        slots = await first.store.redis.zrange(first.store._slot_keys("p")[0], 0, -1)  # type: ignore[attr-defined]
        await _close(first, second)
        return calls, left, slots

    calls, left, slots = asyncio.run(scenario())
    assert calls == 1  # a free slot: one script call, no polling
    assert left == (0, 0, 0)
    assert slots == []
