"""The control loops' state (in memory and in Redis) and the AIMD tick of the pools' dispatch budgets.
(The debt/burst tick is the admission state machine's own: tests/conformance.)"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from apps.gateway.control import (
    AimdParams,
    AimdRecord,
    ControlState,
    MemoryControlState,
    aimd_tick,
    aimd_tick_shared,
)
from apps.gateway.control_redis import RedisControlState
from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.redis_state import RedisStateStore
from apps.policy import InstanceSnapshot, ttft_histogram_bounds


@pytest.fixture(params=["memory", "redis"])
def control(request: pytest.FixtureRequest) -> Iterator[ControlState]:
    if request.param == "memory":
        yield MemoryControlState()
        return
    state = RedisControlState(url=request.getfixturevalue("redis_url"))
    state.PREFIX = f"tokenpools:test:{uuid.uuid4().hex}:"  # isolated from other tests on the server
    try:
        yield state
    finally:
        for key in state.redis.scan_iter(state.PREFIX + "*"):
            state.redis.delete(key)
        state.close()


PARAMS = AimdParams(target_p99_s=2.0, window_ticks=1, cooldown_ticks=3, min_samples=10)


def _observe(control: ControlState, pool: str, seconds: float, n: int = 20) -> None:
    for _ in range(n):
        control.ttft_observe(pool, seconds)


def test_aimd_budget_moves_on_each_side_of_the_deadband(control: ControlState) -> None:
    # Above target x 1.2: multiplicative decrease from the ceiling (16 slots), then a 3-tick cooldown.
    _observe(control, "hot", 5.0)
    records = aimd_tick(state=control, pools={"hot": 16}, params=PARAMS)
    assert (records["hot"].cap, records["hot"].last_action) == (8, "decrease")
    assert records["hot"].p99_s is not None and records["hot"].p99_s > 2.4
    for _ in range(3):
        _observe(control, "hot", 5.0)
        assert aimd_tick(state=control, pools={"hot": 16}, params=PARAMS)["hot"].last_action == "hold_cooldown"
    _observe(control, "hot", 5.0)
    assert aimd_tick(state=control, pools={"hot": 16}, params=PARAMS)["hot"].cap == 4

    # Below target x 0.8 with demand: +1 per tick.
    control.aimd_save("cool", AimdRecord(cap=8, min_cap=1, max_cap=16))
    for expected in (9, 10):
        _observe(control, "cool", 0.1)
        record = aimd_tick(state=control, pools={"cool": 16}, params=PARAMS)["cool"]
        assert (record.cap, record.last_action) == (expected, "increase")

    # Inside the band: hold. The control state counts in the controller's band-edge buckets (1.6, 2.0 and
    # 2.4 s among them): p99 interpolates inside (1.6, 2.0]: 1.6 + 0.4 * (19.8 - 19) = 1.92 s.
    control.aimd_save("steady", AimdRecord(cap=8, min_cap=1, max_cap=16))
    _observe(control, "steady", 0.75, n=19)
    _observe(control, "steady", 2.0, n=1)
    record = aimd_tick(state=control, pools={"steady": 16}, params=PARAMS)["steady"]
    assert (record.cap, record.last_action) == (8, "hold_band")
    assert record.p99_s == pytest.approx(1.92)
    assert control.aimd_load("steady") == record


def test_aimd_holds_without_samples_and_respects_capacity(control: ControlState) -> None:
    record = aimd_tick(state=control, pools={"idle": 16}, params=PARAMS)["idle"]
    assert (record.cap, record.last_action, record.samples) == (16, "hold_few_samples", 0)
    # A pool that lost replicas clips its stored cap to the new ceiling.
    control.aimd_save("shrunk", AimdRecord(cap=32, min_cap=1, max_cap=32))
    assert aimd_tick(state=control, pools={"shrunk": 16}, params=PARAMS)["shrunk"].cap == 16


def test_ttft_window_spans_several_ticks(control: ControlState) -> None:
    params = AimdParams(target_p99_s=2.0, window_ticks=2, min_samples=10)
    _observe(control, "w", 0.1, n=6)
    assert aimd_tick(state=control, pools={"w": 16}, params=params)["w"].samples == 6
    _observe(control, "w", 0.1, n=5)
    assert aimd_tick(state=control, pools={"w": 16}, params=params)["w"].samples == 11
    assert aimd_tick(state=control, pools={"w": 16}, params=params)["w"].samples == 5  # the first slice fell out


def test_ttft_counts_added_in_batches(control: ControlState) -> None:
    counts = [0] * (len(control.bounds) + 1)
    counts[control.bucket(5.0)] = 15
    counts[-1] = 5  # beyond the last bound
    control.ttft_add("batch", counts)
    control.ttft_observe("batch", 5.0)
    record = aimd_tick(state=control, pools={"batch": 16}, params=PARAMS)["batch"]
    assert record.samples == 21 and record.last_action == "decrease"
    assert record.p99_s == 60.0  # the rank falls in +Inf: the highest finite bound


def test_swap_last_run_and_pool_demand(control: ControlState) -> None:
    assert control.swap_last_run("ewma", 10.0) is None
    assert control.swap_last_run("ewma", 11.5) == 10.0
    control.pool_demand_set({"tiny": 12.5})
    assert control.pool_demand() == {"tiny": 12.5}
    control.pool_demand_set({})
    assert control.pool_demand() == {}
    control.desired_replicas_set({"tiny": 3, "big": 10})
    assert control.desired_replicas() == {"tiny": 3, "big": 10}


def test_instance_snapshots_round_trip(control: ControlState) -> None:
    assert control.instances("tiny") == []
    snapshots = [InstanceSnapshot(queue_depth=2.0, kv_utilization=0.25, updated_at=1700000000.5, batch_size=3.0),
                 InstanceSnapshot(queue_depth=0.0, kv_utilization=0.0, updated_at=None)]
    control.instances_set("tiny", snapshots)
    assert control.instances("tiny") == snapshots
    control.instances_set("tiny", [])
    assert control.instances("tiny") == []


def test_control_state_counts_in_the_controllers_bounds_and_takes_other_bounds(control: ControlState) -> None:
    # One set of buckets: the AIMD controller's band edges for the configured target (2 s by default).
    assert control.bounds == ttft_histogram_bounds(2.0)
    # A gateway configured with a 0.5 s target flushes counts over its own buckets: they are added by
    # bound, so 0.6 s and 0.4 s land in the buckets holding them here, not at the same positions.
    theirs = ttft_histogram_bounds(0.5)
    counts = [0] * (len(theirs) + 1)
    counts[theirs.index(0.6)] = 7
    counts[theirs.index(0.4)] = 3
    control.ttft_add("mixed", counts, theirs)
    window = control.ttft_rotate("mixed", 1)
    assert window[control.bucket(0.6)] == 7 and window[control.bucket(0.4)] == 3 and sum(window) == 10


def test_claim_lets_one_caller_through_per_period(control: ControlState) -> None:
    assert control.claim("tick:aimd", 0.3)
    assert not control.claim("tick:aimd", 0.3)
    assert control.claim("tick:other", 0.3)
    import time

    time.sleep(0.35)
    assert control.claim("tick:aimd", 0.3)


@pytest.mark.redis
def test_shared_aimd_tick_publishes_the_budget_in_the_gateway_store(control: ControlState, redis_url: str) -> None:
    async def run() -> tuple[dict[str, AimdRecord], int | None, int | None]:
        store = RedisStateStore(url=redis_url, prefix=f"t{uuid.uuid4().hex}:")
        try:
            _observe(control, "hot", 5.0)
            records = await aimd_tick_shared(store=store, state=control, pools={"hot": 16}, params=PARAMS)
            return records, await store.pool_budget(pool="hot"), await MemoryStateStore().pool_budget(pool="hot")
        finally:
            await store.close()

    records, published, in_memory = asyncio.run(run())
    assert records["hot"].cap == 8 and published == 8
    assert in_memory is None  # the in-process store has no shared budget (its process's controller rules)


def test_aimd_floor_follows_the_budget_fraction(control: ControlState) -> None:
    params = AimdParams(target_p99_s=2.0, window_ticks=1, cooldown_ticks=0, min_samples=10, min_budget_fraction=0.25)
    for expected in (32, 16, 16):  # 64 -> 32 -> 16, the floor at a quarter of the slots
        _observe(control, "floor", 30.0)
        assert aimd_tick(state=control, pools={"floor": 64}, params=params)["floor"].cap == expected
