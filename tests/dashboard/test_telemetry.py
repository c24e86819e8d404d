"""Telemetry: samples built from a real (in-process) gateway's state store, budget and metrics, and their
publication to the pool's channel group."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from channels.layers import InMemoryChannelLayer, get_channel_layer

from apps.dashboard import history as dashboard_history
from apps.dashboard import telemetry
from apps.dashboard.history import MemoryHistory
from apps.dashboard.samples import EntitlementPoint, PoolSample
from apps.dashboard.telemetry import CollectorState, pool_group
from apps.gateway.app import Gateway
from apps.gateway.budget import PoolBudget
from apps.gateway.config import GatewayConfig
from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.snapshot import KeyEntry, PoolInfo, Snapshot, SnapshotCache
from apps.policy import AdmissionRequest, Dynamics, EntitlementLimits, priority_weight

T0 = 1_800_000_000.0
GIB = 1 << 30


def limits(name: str, service_class: str, slo_ms: float, tenant: str) -> EntitlementLimits:
    return EntitlementLimits(entitlement_id=name, service_class=service_class, tokens_per_second=100.0,
                             kv_bytes=2.0 * GIB, concurrency=6, slo_target_ms=slo_ms, kv_bytes_per_token=1024.0,
                             tenant_id=tenant)


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    config = GatewayConfig(background=False, tokenize=False)
    pool = PoolInfo(name="qwen", model_name="m", replica_urls=("http://r1",), concurrency_capacity=16,
                    kv_capacity=8.0 * GIB, kv_bytes_per_token=1024, context_window=4096, mean_slo_ms=1000.0)
    keys = {
        "h1": KeyEntry(1, 1, "acme", limits("acme-chat", "guaranteed", 500.0, "1"), "qwen"),
        "h2": KeyEntry(2, 1, "acme", limits("acme-chat", "guaranteed", 500.0, "1"), "qwen"),  # a 2nd key
        "h3": KeyEntry(3, 2, "globex", limits("globex-batch", "spot", 1500.0, "2"), "qwen"),
    }
    snapshots = SnapshotCache(config=config, initial=Snapshot(keys=keys, pools={"qwen": pool}, version=1))
    gw = Gateway(config=config, snapshots=snapshots, store=MemoryStateStore())
    gw.budgets["qwen"] = PoolBudget("qwen", 16, ttft_target_s=2.0)
    yield gw
    snapshots.close()


@pytest.fixture(autouse=True)
def no_database_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # The replicas' scraped KV usage comes from the ORM; these tests give it directly.
    async def kv_usage(pool: str) -> dict[str, float]:
        return {"http://r1": 0.5}

    monkeypatch.setattr(telemetry, "_kv_usage", kv_usage)


def entry_limits(gw: Gateway, name: str) -> EntitlementLimits:
    snapshot = gw.snapshots.current
    assert snapshot is not None
    return next(e.limits for e in snapshot.keys.values() if e.entitlement == name)


async def admit(gw: Gateway, name: str, request_id: str) -> None:
    assert gw.store is not None
    snapshot = gw.snapshots.current
    assert snapshot is not None
    offer = await gw.store.offer(limits=entry_limits(gw, name), pool=snapshot.pools["qwen"],
                                 request=AdmissionRequest(request_id, 100, 100))
    assert offer.decision.admitted, offer.decision


@pytest.mark.asyncio
async def test_sample_reads_store_budget_and_metrics(gateway: Gateway) -> None:
    layer = InMemoryChannelLayer()
    history = MemoryHistory()
    state = CollectorState()
    await layer.group_add(pool_group("qwen"), "watcher")

    first = await telemetry.telemetry_sample_pool(pool="qwen", now=T0, gateway=gateway, channel_layer=layer,
                                                  history=history, state=state)
    assert first is not None
    assert [e.name for e in first.entitlements] == ["acme-chat", "globex-batch"]  # one point per entitlement
    assert first.aimd_action == 0 and first.budget == 16 and first.slots == 16

    # One second of traffic: 3 acme requests in flight, debt set by the EWMA tick, admissions, a denial,
    # 400 tokens served, and the AIMD controller halving the budget.
    for i in range(3):
        await admit(gateway, "acme-chat", f"r{i}")
    assert gateway.store is not None
    ledger = gateway.store.ledger("qwen")  # type: ignore[attr-defined]
    ledger.set_dynamics("acme-chat", Dynamics(debt=0.5, burst=0.0))  # as the EWMA tick leaves it
    gateway.metrics.admitted.inc(("acme-chat", "guaranteed"), 3)
    gateway.metrics.rejected.inc(("globex-batch", "spot", "pool_contended"), 2)
    gateway.metrics.tokens.inc(("acme-chat", "prompt"), 100)
    gateway.metrics.tokens.inc(("acme-chat", "completion"), 300)
    # Of those, 150 served as the entitlement's own class and 250 below it (spilled over to spot: issue 24).
    gateway.metrics.tier_tokens.inc(("acme-chat", "guaranteed", "completion"), 150)
    gateway.metrics.tier_tokens.inc(("acme-chat", "spot", "prompt"), 100)
    gateway.metrics.tier_tokens.inc(("acme-chat", "spot", "completion"), 150)
    gateway.budgets["qwen"].published(8)  # as if the AIMD controller had halved it

    second = await telemetry.telemetry_sample_pool(pool="qwen", now=T0 + 2, gateway=gateway, channel_layer=layer,
                                                   history=history, state=state)
    assert second is not None
    acme, globex = second.entitlements
    assert (acme.in_flight, acme.tenant, acme.service_class) == (3, "acme", "guaranteed")
    assert acme.kv_bytes == pytest.approx(3 * 200 * 1024)
    assert acme.debt == 0.5
    assert acme.priority == pytest.approx(priority_weight("guaranteed", 500.0, 1000.0, 0.0, 0.5))
    assert acme.admitted == 3 and acme.denied == {}
    assert acme.tokens_per_s == pytest.approx(400 / 2)
    assert acme.tier_tokens_per_s == {"spot": pytest.approx(250 / 2)}  # its own class is the line above
    assert globex.tier_tokens_per_s == {}
    assert acme.baseline_tokens_per_s == 100.0 and acme.slo_ms == 500.0
    assert globex.denied == {"pool_contended": 2} and globex.in_flight == 0
    assert second.budget == 8 and second.aimd_action == -1
    assert second.kv_usage == {"http://r1": 0.5}
    assert second.kv_admitted == pytest.approx(3 * 200 * 1024 / (8 * GIB))

    # Counts are per sample, not cumulative: nothing new happened before the third.
    third = await telemetry.telemetry_sample_pool(pool="qwen", now=T0 + 3, gateway=gateway, channel_layer=layer,
                                                  history=history, state=state)
    assert third is not None
    assert third.entitlements[0].admitted == 0 and third.entitlements[1].denied == {}
    assert third.aimd_action == 0

    assert [s.time for s in await history.recent("qwen", now=T0 + 3)] == [T0, T0 + 2, T0 + 3]
    messages = [await layer.receive("watcher") for _ in range(3)]
    assert [m["type"] for m in messages] == ["pool.sample"] * 3
    assert PoolSample.from_dict(messages[1]["sample"]) == second


@pytest.mark.asyncio
async def test_pool_p99_ttft_comes_from_the_gateway_histogram_over_a_window(gateway: Gateway) -> None:
    state = CollectorState()
    kwargs: dict[str, Any] = {"gateway": gateway, "channel_layer": InMemoryChannelLayer(), "history": MemoryHistory(),
                              "state": state}
    first = await telemetry.telemetry_sample_pool(pool="qwen", now=T0, **kwargs)
    assert first is not None and first.p99_ttft_s is None  # no request yet: no p99, not a zero
    for _ in range(50):
        gateway.metrics.ttft.observe(("qwen", "acme-chat"), 0.3)
    second = await telemetry.telemetry_sample_pool(pool="qwen", now=T0 + 1, **kwargs)
    assert second is not None and second.p99_ttft_s is not None and 0.25 <= second.p99_ttft_s <= 0.5
    # The window forgets: TTFT_WINDOW_SAMPLES quiet samples later there is no p99 again.
    for i in range(telemetry.TTFT_WINDOW_SAMPLES):
        last = await telemetry.telemetry_sample_pool(pool="qwen", now=T0 + 2 + i, **kwargs)
    assert last is not None and last.p99_ttft_s is None


@pytest.mark.asyncio
async def test_p99_per_entitlement_from_the_gateway_ttft_labelled_by_entitlement(gateway: Gateway) -> None:
    """The gateway's histogram is labelled (pool, entitlement): each entitlement gets its own p99 and the
    pool the p99 over all of them."""
    assert gateway.metrics.ttft.label_names == ("pool", "entitlement")
    state = CollectorState()
    kwargs: dict[str, Any] = {"gateway": gateway, "channel_layer": InMemoryChannelLayer(), "history": MemoryHistory(),
                              "state": state}
    await telemetry.telemetry_sample_pool(pool="qwen", now=T0, **kwargs)
    for _ in range(100):
        gateway.metrics.ttft.observe(("qwen", "acme-chat"), 0.1)
        gateway.metrics.ttft.observe(("qwen", "globex-batch"), 8.0)
    sample = await telemetry.telemetry_sample_pool(pool="qwen", now=T0 + 1, **kwargs)
    assert sample is not None
    acme, globex = sample.entitlements
    assert acme.p99_ttft_s is not None and acme.p99_ttft_s <= 0.1
    assert globex.p99_ttft_s is not None and globex.p99_ttft_s > 5.0
    assert sample.p99_ttft_s is not None and sample.p99_ttft_s > 5.0  # the pool's tail is globex's


@pytest.mark.asyncio
async def test_queue_depth_and_wait_per_entitlement_from_the_admitter_and_the_wait_histogram(gateway: Gateway) -> None:
    """Each entitlement's point has the requests waiting now (the admitter's count, by entitlement) and the
    p99 and mean of the waits that ended in the window (`tokenpools_queue_wait_seconds`); none: no point."""
    await gateway.start()
    try:
        state = CollectorState()
        kwargs: dict[str, Any] = {"gateway": gateway, "channel_layer": InMemoryChannelLayer(),
                                  "history": MemoryHistory(), "state": state}
        first = await telemetry.telemetry_sample_pool(pool="qwen", now=T0, **kwargs)
        assert first is not None
        assert [(e.queued, e.queue_wait_p99_s, e.queue_wait_mean_s) for e in first.entitlements] == [(0, None, None)] * 2
        # Two acme requests waiting now; four waits ended since: three short, one long.
        gateway.admitter.waiting["acme-chat"] = 2
        for seconds in (0.1, 0.1, 0.1, 0.9):
            gateway.metrics.queue_wait.observe(("acme-chat",), seconds)
        second = await telemetry.telemetry_sample_pool(pool="qwen", now=T0 + 1, **kwargs)
        assert second is not None
        acme, globex = second.entitlements
        assert acme.queued == 2 and second.queued == 2
        assert acme.queue_wait_mean_s == pytest.approx(0.3)
        assert acme.queue_wait_p99_s is not None and 0.5 < acme.queue_wait_p99_s <= 1.0
        assert (globex.queued, globex.queue_wait_p99_s, globex.queue_wait_mean_s) == (0, None, None)
        assert EntitlementPoint.from_dict(acme.to_dict()) == acme
        # The window forgets: TTFT_WINDOW_SAMPLES samples without a wait ending, and no wait figure again.
        gateway.admitter.waiting["acme-chat"] = 0
        for i in range(telemetry.TTFT_WINDOW_SAMPLES):
            last = await telemetry.telemetry_sample_pool(pool="qwen", now=T0 + 2 + i, **kwargs)
        assert last is not None and last.entitlements[0].queue_wait_p99_s is None and last.queued == 0
    finally:
        await gateway.stop()


@pytest.mark.asyncio
async def test_unknown_pool_gives_no_sample(gateway: Gateway) -> None:
    assert await telemetry.telemetry_sample_pool(pool="nope", gateway=gateway, channel_layer=InMemoryChannelLayer(),
                                                 history=MemoryHistory(), state=CollectorState()) is None


@pytest.mark.redis
@pytest.mark.asyncio
async def test_without_a_running_gateway_the_sample_reads_the_shared_redis_store(
    redis_url: str, gateway: Gateway, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Celery worker has no gateway of its own running: the entitlements' figures come from Redis."""
    import uuid

    from apps.gateway.redis_state import RedisStateStore

    prefix = f"tp-test-{uuid.uuid4().hex[:8]}:"
    writer = RedisStateStore(url=redis_url, prefix=prefix)
    gateway.store = writer
    await admit(gateway, "acme-chat", "shared-1")
    await admit(gateway, "acme-chat", "shared-2")
    gateway.store = None  # this process's gateway never started
    settings.REDIS_URL = redis_url
    settings.GATEWAY_STATE_BACKEND = "redis"
    original = RedisStateStore.__init__

    def same_prefix(self: Any, **kwargs: Any) -> None:  # keys of this test only, in the session's Redis
        original(self, **{**kwargs, "prefix": prefix})

    monkeypatch.setattr(RedisStateStore, "__init__", same_prefix)
    try:
        sample = await telemetry.telemetry_sample_pool(pool="qwen", now=T0, gateway=gateway,
                                                       channel_layer=InMemoryChannelLayer(), history=MemoryHistory(),
                                                       state=CollectorState())
    finally:
        await writer.close()
    assert sample is not None
    assert {e.name: e.in_flight for e in sample.entitlements} == {"acme-chat": 2, "globex-batch": 0}


def test_group_names_are_valid_and_distinct() -> None:
    assert pool_group("qwen-pool") == "dashboard.pool.qwen-pool"
    odd = pool_group("qwen pool/1")
    assert odd.startswith("dashboard.pool.qwen_pool_1.") and odd != pool_group("qwen_pool_1")


def test_publish_tick_from_a_thread_runs_on_the_server_loop(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ticker calls publish_tick in a thread; the sample must be taken and sent on the server's loop,
    where the in-process state store and the in-memory channel layer live."""
    import apps.gateway.asgi

    monkeypatch.setattr(apps.gateway.asgi, "_gateway", gateway)
    telemetry.reset_collector()
    dashboard_history.reset_history_store(MemoryHistory())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(telemetry, "_server_loop", loop)
    seen_on: list[threading.Thread] = []
    original = telemetry.collect_pool_sample

    async def spy(**kwargs: Any) -> PoolSample:
        seen_on.append(threading.current_thread())
        return await original(**kwargs)

    monkeypatch.setattr(telemetry, "collect_pool_sample", spy)
    try:
        layer = asyncio.run_coroutine_threadsafe(_layer_with_watcher(), loop).result(5)
        assert telemetry.publish_tick() == 1
        assert seen_on == [thread]
        message = asyncio.run_coroutine_threadsafe(layer.receive("watcher"), loop).result(5)
        assert PoolSample.from_dict(message["sample"]).pool == "qwen"
        # A second call within half a second is dropped: the ticker and the page sampler may both run.
        assert telemetry.publish_tick() == 0
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        dashboard_history.reset_history_store()
        telemetry.reset_collector()


async def _layer_with_watcher() -> Any:
    layer = get_channel_layer()
    await layer.group_add(pool_group("qwen"), "watcher")
    return layer


@pytest.mark.asyncio
async def test_local_sampler_starts_once_per_loop_and_can_be_turned_off(settings: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []

    async def fake_publish(**kwargs: Any) -> list[PoolSample]:
        calls.append(asyncio.get_running_loop().time())
        return []

    monkeypatch.setattr(telemetry, "publish_pool_samples", fake_publish)
    settings.DASHBOARD_LOCAL_SAMPLER = False
    assert telemetry.ensure_local_sampler() is False
    settings.DASHBOARD_LOCAL_SAMPLER = True
    try:
        assert telemetry.ensure_local_sampler(period_s=0.05) is True
        assert telemetry.ensure_local_sampler(period_s=0.05) is False  # already sampling on this loop
        await asyncio.sleep(0.3)
        assert len(calls) >= 3
    finally:
        await telemetry.stop_local_sampler()
    settled = len(calls)
    await asyncio.sleep(0.15)
    assert len(calls) == settled  # stopped


@pytest.mark.django_db
def test_replica_kv_usage_reads_the_last_scrape_of_enabled_replicas(superuser: Any) -> None:
    from apps.pools.models import Replica
    from tests.dashboard.conftest import create_pool

    pool = create_pool(superuser, replicas=3)
    first, second, third = Replica.objects.filter(pool=pool).order_by("position", "id")
    Replica.objects.filter(pk=first.pk).update(kv_cache_usage=0.25)
    Replica.objects.filter(pk=second.pk).update(kv_cache_usage=0.75, enabled=False)  # disabled: not drawn
    assert third.kv_cache_usage is None  # never scraped: no point rather than a zero
    assert telemetry.replica_kv_usage(pool=pool.name) == {first.url.rstrip("/"): 0.25}


def test_publish_tick_runs_from_the_tick_registry_without_a_server_loop(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registration the ticks helper adds: `TickSpec("dashboard", 1.0, "apps.dashboard.telemetry:publish_tick")`.
    With no server loop (Celery, `run_ticks`) the tick samples on a loop of its own."""
    import apps.gateway.asgi
    from workers.ticks import Outcome, TickSpec, run_tick

    spec = TickSpec("dashboard", 1.0, "apps.dashboard.telemetry:publish_tick")
    assert spec.resolve() is telemetry.publish_tick
    monkeypatch.setattr(apps.gateway.asgi, "_gateway", gateway)
    monkeypatch.setattr(telemetry, "_bound_loop", lambda: None)
    history = MemoryHistory()
    telemetry.reset_collector()
    dashboard_history.reset_history_store(history)
    store_reads: list[str] = []
    original = gateway.store.entitlement_usage  # type: ignore[union-attr]

    async def reading(**kwargs: Any) -> Any:
        store_reads.append(kwargs["limits"].entitlement_id)
        return await original(**kwargs)

    monkeypatch.setattr(gateway.store, "entitlement_usage", reading)
    try:
        assert run_tick("dashboard-test", spec.resolve()) is Outcome.RAN
        assert [s.pool for s in asyncio.run(history.recent("qwen"))] == ["qwen"]
        # The gateway's store belongs to its server's loop (a Redis pool binds its lock to the first loop that
        # waits on it): a sample on the tick's own loop leaves it alone.
        assert store_reads == []
    finally:
        dashboard_history.reset_history_store()
        telemetry.reset_collector()
