"""A pool's dispatch budget controller (AIMD, seed 002): it tunes a number; the state machine enforces it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from apps.gateway.budget import PoolBudget, aimd_tick_all
from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.snapshot import PoolInfo
from apps.policy import AdmissionRequest, EntitlementLimits


def test_aimd_cuts_the_budget_on_slow_ttft_and_grows_it_on_fast() -> None:
    budget = PoolBudget("p", 16, ttft_target_s=1.0, min_budget=2, window_ticks=1)
    start = budget.budget
    for _ in range(20):
        budget.observe_ttft(5.0)
    cut = aimd_tick_all([budget], {"p": True})["p"]
    for _ in range(3):  # the cooldown after a decrease
        budget.tick(True)
    for _ in range(20):
        budget.observe_ttft(0.01)
    idle = replace(budget.aimd)
    grown = budget.tick(True)
    assert (start, cut, grown) == (16, 8, 9)
    # Without demand a fast window does not grow it.
    budget.aimd = idle
    for _ in range(20):
        budget.observe_ttft(0.01)
    assert budget.tick(False) == 8


def test_budget_floor_scales_with_the_pool_and_resizes() -> None:
    budget = PoolBudget("p", 64, ttft_target_s=1.0, min_budget_fraction=0.25, window_ticks=1)
    for _ in range(3):
        for _ in range(20):
            budget.observe_ttft(30.0)
        budget.tick(True)
        budget.aimd = replace(budget.aimd, cooldown_left=0)
    assert budget.budget == 16  # 64 -> 32 -> 16, then held at the floor
    budget.resize(8)
    assert (budget.aimd.min_cap, budget.aimd.max_cap, budget.budget) == (2, 8, 8)


def test_a_shared_budget_counts_ttft_for_the_flush_and_leaves_the_number_to_the_pool() -> None:
    budget = PoolBudget("p", 16, ttft_target_s=1.0, window_ticks=2, shared=True)
    for _ in range(20):
        budget.observe_ttft(5.0)
    counts, again = budget.take_ttft(), budget.take_ttft()
    assert counts is not None and sum(counts) == 20 and again is None
    assert budget.tick(True) == 16  # no per-process controller: slow TTFTs do not cut it here
    budget.published(4)
    assert budget.budget == 4
    budget.published(None)
    assert budget.budget == 16


def test_the_budget_it_hands_the_store_is_a_check_of_the_state_machine() -> None:
    """The controller's cut reaches the machine: running work is not cancelled, new work waits for room."""
    store = MemoryStateStore()
    limits = EntitlementLimits("e", service_class="elastic", concurrency=8, queue_max=0)
    pool = PoolInfo("p", "m", ("http://x",), 4, float("inf"), 0, 4096, entitlements=(limits,))
    budget = PoolBudget("p", 4, ttft_target_s=1.0, window_ticks=1)

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        first = await store.offer(limits=limits, pool=pool, request=AdmissionRequest("a", 5, 5))
        second = await store.offer(limits=limits, pool=pool, request=AdmissionRequest("b", 5, 5))
        for _ in range(20):
            budget.observe_ttft(30.0)
        await store.pool_budgets_set(budgets=aimd_tick_all([budget], {"p": True}))  # 4 -> 2
        third = await store.offer(limits=limits, pool=pool, request=AdmissionRequest("c", 5, 5))
        fourth = await store.offer(limits=limits, pool=pool, request=AdmissionRequest("d", 5, 5))
        assert first.reservation is not None and second.reservation is not None
        released = await store.release(reservation=first.reservation, prompt_tokens=5, completion_tokens=5)
        started = await store.pool_budgets_set(budgets={"p": 4})
        return [first.state, second.state], [third.state, fourth.state], [*released.started, *started]

    states, waited, started = asyncio.run(scenario())
    assert budget.budget == 2 and states == ["running", "running"]
    assert waited == ["waiting", "waiting"]  # two run: the budget binds, the others wait in the machine's room
    assert started == ["c", "d"]  # one by the release, one by the larger budget
