"""The gateway's tick services as the periodic runners call them: the debt/burst tick reaching the
in-process state machine through the call its gateway hands it, the AIMD tick bounded by capacity and
published for every gateway process with Redis."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.gateway import ticks
from apps.gateway.app import Gateway
from apps.gateway.control import AimdRecord, MemoryControlState
from apps.gateway.control_redis import RedisControlState
from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.policy import AdmissionRequest, EntitlementLimits, ttft_histogram_bounds
from tests.pools.factories import make_entitlement, make_pool
from workers.ticks import Outcome, run_tick


@pytest.fixture
def gateway_loop(settings: Any) -> Iterator[tuple[MemoryStateStore, Any]]:
    """The embedded server: a running event loop holding the gateway's in-process state store."""
    settings.GATEWAY_STATE_BACKEND = "memory"
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    store = MemoryStateStore()
    try:
        yield store, loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.mark.django_db
def test_ewma_tick_reaches_the_in_process_state_machine(admin: Any, acme: Any, memory_control: Any,
                                                        gateway_loop: tuple[MemoryStateStore, Any]) -> None:
    store, loop = gateway_loop
    pool = make_pool(admin, name="tiny")
    make_entitlement(admin, acme, pool, "el", "elastic", tokens_per_second=100)
    make_entitlement(admin, acme, pool, "gone", "elastic", tokens_per_second=100,
                     expires_at=timezone.now() - timedelta(seconds=1))
    gold = EntitlementLimits(entitlement_id="gold", service_class="guaranteed", concurrency=1)
    elastic = EntitlementLimits(entitlement_id="el", service_class="elastic", tokens_per_second=100.0)
    info = PoolInfo("tiny", "m", ("http://x",), 1, 1e12, 0, 4096, reserved=(("gold", 1, 0.0),),
                    entitlements=(gold, elastic))

    async def underserve() -> str:
        # The pool's one slot is held by a guaranteed request: the elastic one is refused (unmet demand).
        await store.offer(limits=gold, pool=info, request=AdmissionRequest("g1", 10, 10))
        return (await store.offer(limits=elastic, pool=info, request=AdmissionRequest("e1", 10, 90))).decision.reason

    assert asyncio.run_coroutine_threadsafe(underserve(), loop).result(30) == "pool_contended"
    # What the gateway hands the in-process ticker (`BackgroundLoops.store_call`): its store, on its loop.
    result = ticks.tick_ewma(lambda fn: asyncio.run_coroutine_threadsafe(fn(store), loop).result(30))

    assert result is not None and result.dynamics["el"].debt > 0
    usage = asyncio.run_coroutine_threadsafe(store.entitlement_usage(limits=elastic, pool="tiny"), loop).result(30)
    assert usage.debt == pytest.approx(result.dynamics["el"].debt)
    assert memory_control.pool_demand()["tiny"] > 0


@pytest.mark.django_db
def test_the_in_process_ewma_tick_takes_the_entitlements_from_the_snapshot_not_the_database(
        admin: Any, acme: Any, memory_control: Any, gateway_loop: tuple[MemoryStateStore, Any]) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    store, loop = gateway_loop
    make_entitlement(admin, acme, make_pool(admin, name="tiny"), "el", "elastic", tokens_per_second=100)
    elastic = EntitlementLimits(entitlement_id="el", service_class="elastic", tokens_per_second=100.0)
    info = PoolInfo("tiny", "m", ("http://x",), 1, 1e12, 0, 4096, entitlements=(elastic,))
    asyncio.run_coroutine_threadsafe(
        store.offer(limits=elastic, pool=info, request=AdmissionRequest("e1", 10, 90)), loop).result(30)
    with CaptureQueriesContext(connection) as queries:
        result = ticks.tick_ewma(lambda fn: asyncio.run_coroutine_threadsafe(fn(store), loop).result(30),
                                 {"tiny": [elastic]})
    assert result is not None and "el" in result.dynamics and "tiny" in memory_control.pool_demand()
    assert not [q["sql"] for q in queries.captured_queries if "tokenentitlement" in q["sql"]]


@pytest.mark.django_db
def test_ewma_tick_waits_for_the_gateway_to_start(admin: Any, acme: Any, memory_control: Any, settings: Any) -> None:
    settings.GATEWAY_STATE_BACKEND = "memory"
    make_entitlement(admin, acme, make_pool(admin), "el", "elastic")
    services = Gateway(store=MemoryStateStore()).loops.tick_services()  # a gateway not started yet
    assert ticks.tick_ewma(Gateway(store=MemoryStateStore()).loops.store_call) is None
    assert run_tick("ewma", services["ewma"]) is Outcome.RAN  # not a failure: there is nothing to tick yet


@pytest.mark.django_db
def test_ewma_tick_without_a_gateway_says_the_in_process_store_is_out_of_reach(
    admin: Any, acme: Any, memory_control: Any, settings: Any
) -> None:
    settings.GATEWAY_STATE_BACKEND = "memory"
    make_entitlement(admin, acme, make_pool(admin), "el", "elastic")
    with pytest.raises(ticks.StoreUnavailable, match="GATEWAY_STATE_BACKEND=redis"):
        ticks.with_gateway_store(lambda store: store.tick(entitlements={}))
    assert ticks.tick_ewma() is None  # Celery or run_ticks beside the in-process store: nothing to tick
    assert run_tick("ewma") is Outcome.RAN


@pytest.mark.django_db
@pytest.mark.redis
def test_ewma_tick_closes_the_window_of_the_redis_state_machine(admin: Any, acme: Any, memory_control: Any,
                                                                settings: Any, redis_url: str) -> None:
    settings.REDIS_URL = redis_url
    settings.GATEWAY_STATE_BACKEND = "redis"
    name = f"pool-{uuid.uuid4().hex[:8]}"
    pool = make_pool(admin, name=name, replicas=[{"url": "http://127.0.0.1:9"}])
    make_entitlement(admin, acme, pool, "el-redis", "elastic", tokens_per_second=100)
    elastic = EntitlementLimits(entitlement_id="el-redis", service_class="elastic", tokens_per_second=100.0)

    async def refuse() -> None:
        store = RedisStateStore(url=redis_url)
        try:
            info = PoolInfo(name, "m", ("http://x",), 0, 1e12, 0, 4096, entitlements=(elastic,))
            await store.sync_pool(pool=info)
            # A pool with no slot: the request waits, and expires at once (unmet demand).
            await store.offer(limits=elastic, pool=info, request=AdmissionRequest(uuid.uuid4().hex, 10, 90))
            await asyncio.sleep(1.1)
            assert await store.expire(pool=name)
        finally:
            await store.close()

    asyncio.run(refuse())
    first = ticks.tick_ewma()
    assert first is not None and first.dynamics["el-redis"].debt > 0
    second = ticks.tick_ewma()  # nothing wanted since: the debt decays
    assert second is not None and 0 < second.dynamics["el-redis"].debt < first.dynamics["el-redis"].debt


@pytest.mark.django_db
def test_aimd_tick_bounds_the_budget_by_pool_capacity(admin: Any, memory_control: MemoryControlState,
                                                      settings: Any) -> None:
    settings.GATEWAY_STATE_BACKEND = "memory"
    make_pool(admin, name="two", replicas=[{"url": "http://127.0.0.1:9"}, {"url": "http://127.0.0.1:10"},
                                           {"url": "http://127.0.0.1:11", "enabled": False}])
    for _ in range(20):
        memory_control.ttft_observe("two", 10.0)
    records = ticks.tick_aimd()
    # 2 enabled replicas x 16 slots = 32, halved on a p99 far above the 2 s target.
    assert records["two"] == memory_control.aimd_load("two")
    assert (records["two"].max_cap, records["two"].cap, records["two"].last_action) == (32, 16, "decrease")


def test_aimd_record_defaults() -> None:
    record = AimdRecord(cap=4)
    assert (record.cooldown_left, record.p99_s, record.ticks) == (0, None, 0)


@pytest.mark.django_db
@pytest.mark.redis
def test_aimd_tick_publishes_the_shared_budget_every_gateway_process_enforces(
    admin: Any, settings: Any, redis_url: str
) -> None:
    settings.REDIS_URL = redis_url
    settings.GATEWAY_STATE_BACKEND = "redis"
    name = f"shared-{uuid.uuid4().hex[:8]}"
    make_pool(admin, name=name, replicas=[{"url": "http://127.0.0.1:9"}])  # 16 slots
    state = RedisControlState(url=redis_url, bounds=ttft_histogram_bounds(2.0))
    state.PREFIX = f"tokenpools:test:{uuid.uuid4().hex}:"
    ticks.reset_control_state(state)
    try:
        # Two gateway processes flush their counts (over their own, identical, buckets) into one window.
        for _ in range(2):
            counts = [0] * (len(state.bounds) + 1)
            counts[state.bucket(10.0)] = 6
            state.ttft_add(name, counts, ttft_histogram_bounds(2.0))
        records = ticks.tick_aimd()

        async def published() -> int | None:
            store = RedisStateStore(url=redis_url)
            try:
                return await store.pool_budget(pool=name)
            finally:
                await store.pool_budgets_set(budgets={name: None})
                await store.close()

        assert (records[name].samples, records[name].cap, records[name].last_action) == (12, 8, "decrease")
        assert asyncio.run(published()) == 8
    finally:
        ticks.reset_control_state(None)
        for key in state.redis.scan_iter(state.PREFIX + "*"):
            state.redis.delete(key)
