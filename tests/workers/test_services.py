"""The tick services, the Celery wiring and the runners around them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.core.management import call_command
from django.utils import timezone

import workers.ticks as ticks_module
from apps.gateway.state import MemoryStateStore
from apps.policy import EntitlementLimits, InstanceSnapshot
from apps.pools.models import EntitlementState, TokenEntitlement, TokenPool
from apps.tenancy.models import Tenant
from tests.pools.factories import make_entitlement, make_pool
from workers import services
from workers.dynamics import AimdRecord, MemoryControlState
from workers.tasks import run_tick_task
from workers.ticks import Outcome, TickSpec, run_tick, start_in_process_ticker, stop_in_process_ticker

_marks: list[str] = []


@pytest.fixture
def admin(db: Any) -> Any:
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_superuser("root", "root@example.com", "root-pass-123")


@pytest.fixture
def acme(db: Any) -> Tenant:
    return Tenant.objects.create(name="Acme", slug="acme")


def mark_tick() -> None:
    _marks.append("ran")


@pytest.fixture
def memory_control(settings: Any) -> Iterator[MemoryControlState]:
    settings.REDIS_URL = ""
    state = MemoryControlState()
    services.reset_control_state(state)
    yield state
    services.reset_control_state(None)


@pytest.fixture
def gateway_loop(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryStateStore]:
    """The embedded server: a running event loop holding the gateway's in-process state store."""
    import apps.gateway.asgi as gateway_asgi

    settings.GATEWAY_STATE_BACKEND = "memory"
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    store = MemoryStateStore()

    class FakeGateway:  # only the store is read by the ticks
        pass

    gateway = FakeGateway()
    gateway.store = store  # type: ignore[attr-defined]
    monkeypatch.setattr(gateway_asgi, "_gateway", gateway)
    services.bind_gateway_loop(loop)
    try:
        yield store
    finally:
        monkeypatch.setattr(services, "_gateway_loop", None)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def test_beat_schedule_is_built_from_the_registry(settings: Any) -> None:
    from workers.celery import app, beat_schedule

    settings.TOKENPOOLS_TICK_PERIODS = {**settings.TOKENPOOLS_TICK_PERIODS, "aimd": 2.0}
    schedule = beat_schedule()
    assert set(schedule) == {f"tick-{n}" for n in ("ewma", "aimd", "scrape", "autoscale", "expiry", "usage_rollup")}
    assert schedule["tick-ewma"] == {"task": "workers.tasks.run_tick", "schedule": 1.0, "args": ("ewma",),
                                     "options": {"expires": 1.0}}
    assert schedule["tick-aimd"]["schedule"] == 2.0
    assert app.conf.beat_schedule["tick-aimd"]["schedule"] in (2.0, 5.0)  # built at import, settings may differ
    assert "workers.tasks.run_tick" in app.tasks


@pytest.mark.django_db
def test_expiry_tick_expires_due_entitlements(admin: Any, acme: Any) -> None:
    pool = make_pool(admin)
    ent = make_entitlement(admin, acme, pool, "due", expires_at=timezone.now() + timedelta(hours=1))
    assert ent.state == EntitlementState.BOUND
    TokenEntitlement.objects.filter(pk=ent.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert run_tick("expiry") is Outcome.RAN
    ent.refresh_from_db()
    assert ent.state == EntitlementState.EXPIRED


@pytest.mark.django_db
@pytest.mark.redis
def test_the_task_skips_while_another_worker_holds_the_tick(admin: Any, acme: Any, settings: Any,
                                                            redis_url: str) -> None:
    settings.REDIS_URL = redis_url
    client = redis.Redis.from_url(redis_url)
    lock = client.lock("tokenpools:tick-lock:expiry", timeout=60)
    assert lock.acquire(blocking=False)
    try:
        assert run_tick_task("expiry") == "skipped"
    finally:
        lock.release()
    assert run_tick_task("expiry") == "ran"
    assert client.get("tokenpools:tick-lock:expiry") is None
    client.close()


@pytest.mark.django_db
def test_ewma_tick_reaches_the_in_process_gateway_store(admin: Any, acme: Any, memory_control: Any,
                                                        gateway_loop: MemoryStateStore) -> None:
    pool = make_pool(admin, name="tiny")
    make_entitlement(admin, acme, pool, "el", "elastic", tokens_per_second=100)
    make_entitlement(admin, acme, pool, "gone", "elastic", tokens_per_second=100,
                     expires_at=timezone.now() - timedelta(seconds=1))
    loop = services._gateway_loop
    assert loop is not None
    asyncio.run_coroutine_threadsafe(
        gateway_loop.record_rejection(entitlement="el", token_cost=100), loop).result(30)

    result = services.tick_ewma()

    assert result is not None and set(result.dynamics) == {"el"}  # the expired one is not ticked
    assert result.dynamics["el"].debt > 0
    limits = EntitlementLimits(entitlement_id="el", service_class="elastic", tokens_per_second=100.0)
    usage = asyncio.run_coroutine_threadsafe(gateway_loop.entitlement_usage(limits=limits), loop).result(30)
    assert usage.debt == pytest.approx(result.dynamics["el"].debt)
    assert memory_control.pool_demand()["tiny"] > 0


@pytest.mark.django_db
def test_ewma_tick_waits_for_the_gateway_to_start(admin: Any, acme: Any, memory_control: Any, settings: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import apps.gateway.asgi as gateway_asgi

    settings.GATEWAY_STATE_BACKEND = "memory"
    monkeypatch.setattr(services, "_gateway_loop", None)
    monkeypatch.setattr(gateway_asgi, "_gateway", None)
    make_entitlement(admin, acme, make_pool(admin), "el", "elastic")
    assert services.tick_ewma() is None
    assert run_tick("ewma") is Outcome.RAN  # not a failure: there is nothing to tick yet


@pytest.mark.django_db
def test_aimd_tick_bounds_the_budget_by_pool_capacity(admin: Any, memory_control: MemoryControlState,
                                                      settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.GATEWAY_STATE_BACKEND = "memory"
    monkeypatch.setattr(services, "_gateway_loop", None)
    make_pool(admin, name="two", replicas=[{"url": "http://127.0.0.1:9"}, {"url": "http://127.0.0.1:10"},
                                           {"url": "http://127.0.0.1:11", "enabled": False}])
    for _ in range(20):
        memory_control.ttft_observe("two", 10.0)
    records = services.tick_aimd()
    # 2 enabled replicas x 16 slots = 32, halved on a p99 far above the 2 s target.
    assert records["two"] == memory_control.aimd_load("two")
    assert (records["two"].max_cap, records["two"].cap, records["two"].last_action) == (32, 16, "decrease")


@pytest.mark.django_db
def test_autoscale_tick_uses_the_observed_token_demand(admin: Any, memory_control: MemoryControlState) -> None:
    pool = make_pool(admin, name="tiny")  # 240 tok/s per replica, max 10 replicas
    memory_control.pool_demand_set({"tiny": 1000.0})
    assert run_tick("autoscale") is Outcome.RAN
    assert TokenPool.objects.get(pk=pool.pk).desired_replicas == 5
    assert services.desired_replicas_gauge() == {("tiny",): 5.0}


@pytest.mark.django_db
def test_run_ticks_once_and_list(admin: Any, capsys: pytest.CaptureFixture[str],
                                 memory_control: MemoryControlState) -> None:
    make_pool(admin, replicas=[{"url": "http://127.0.0.1:9"}])
    call_command("run_ticks", "--list")
    listed = capsys.readouterr().out
    assert "ewma" in listed and "every 1s" in listed
    call_command("run_ticks", "expiry", "scrape", "--once")
    out = capsys.readouterr().out
    assert "expiry: ran" in out and "scrape: ran" in out
    assert TokenPool.objects.get().replicas.get().healthy is False
    # The scrape tick published the pool's (now empty: its one replica is down) instance snapshots.
    memory_control.instances_set("qwen3-8b", [InstanceSnapshot(1.0, 0.5)])
    assert run_tick("scrape") is Outcome.RAN
    assert memory_control.instances("qwen3-8b") == []


def test_run_ticks_rejects_unknown_ticks() -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError):
        call_command("run_ticks", "nope", "--once")


def test_in_process_ticker_only_without_a_broker(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.TOKENPOOLS_TICKS = "auto"
    spec = TickSpec("mark", 3600.0, "tests.workers.test_services:mark_tick")
    requested: list[list[str]] = []

    def specs_for(names: Any) -> dict[str, TickSpec]:
        requested.append(list(names))
        return {"mark": spec}

    monkeypatch.setattr(ticks_module, "tick_specs", specs_for)
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    # With a broker Celery runs the ticks; only those reading the server's own state stay in-process.
    assert start_in_process_ticker(("ewma", "scrape")) is None
    try:
        assert start_in_process_ticker() is not None
        assert requested == [list(ticks_module.SERVER_ONLY_TICKS)]
    finally:
        stop_in_process_ticker()

    settings.CELERY_BROKER_URL = "memory://"
    _marks.clear()
    try:
        ticker = start_in_process_ticker(("mark",))
        assert ticker is not None
        assert start_in_process_ticker(("mark",)) is ticker  # once per process
        future = None
        for _ in range(300):  # the thread fires it at start
            future = ticker.running.get("mark")
            if future is not None:
                break
            threading.Event().wait(0.05)
        assert future is not None and future.result(30) is Outcome.RAN
        assert _marks == ["ran"]
    finally:
        stop_in_process_ticker()


def test_aimd_record_defaults() -> None:
    record = AimdRecord(cap=4)
    assert (record.cooldown_left, record.p99_s, record.ticks) == (0, None, 0)


@pytest.mark.django_db
@pytest.mark.redis
def test_aimd_tick_publishes_the_shared_budget_every_gateway_process_enforces(
    admin: Any, settings: Any, redis_url: str
) -> None:
    import uuid

    from apps.gateway.redis_state import RedisStateStore
    from apps.policy import ttft_histogram_bounds
    from workers.dynamics import RedisControlState

    settings.REDIS_URL = redis_url
    settings.GATEWAY_STATE_BACKEND = "redis"
    name = f"shared-{uuid.uuid4().hex[:8]}"
    make_pool(admin, name=name, replicas=[{"url": "http://127.0.0.1:9"}])  # 16 slots
    state = RedisControlState(url=redis_url, bounds=ttft_histogram_bounds(2.0))
    state.PREFIX = f"tokenpools:test:{uuid.uuid4().hex}:"
    services.reset_control_state(state)
    try:
        # Two gateway processes flush their counts (over their own, identical, buckets) into one window.
        for _ in range(2):
            counts = [0] * (len(state.bounds) + 1)
            counts[state.bucket(10.0)] = 6
            state.ttft_add(name, counts, ttft_histogram_bounds(2.0))
        records = services.tick_aimd()

        async def published() -> int | None:
            store = RedisStateStore(url=redis_url)
            try:
                return await store.pool_budget(pool=name)
            finally:
                await store.redis.delete(f"tp:gw:pool:{name}:budget")
                await store.close()

        assert (records[name].samples, records[name].cap, records[name].last_action) == (12, 8, "decrease")
        assert asyncio.run(published()) == 8
    finally:
        services.reset_control_state(None)
        for key in state.redis.scan_iter(state.PREFIX + "*"):
            state.redis.delete(key)
