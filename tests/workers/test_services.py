"""The worker-side tick services, the Celery wiring and the runners around them."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.core.management import call_command
from django.utils import timezone

import workers.ticks as ticks_module
from apps.gateway import ticks
from apps.gateway.control import MemoryControlState
from apps.policy import InstanceSnapshot
from apps.pools.models import EntitlementState, TokenEntitlement, TokenPool
from tests.pools.factories import make_entitlement, make_pool
from workers.tasks import run_tick_task
from workers.ticks import Outcome, TickSpec, run_tick, start_in_process_ticker, stop_in_process_ticker

_marks: list[str] = []


def mark_tick() -> None:
    _marks.append("ran")



def test_beat_schedule_is_built_from_the_registry(settings: Any) -> None:
    from workers.celery import app, beat_schedule

    settings.TOKENPOOLS_TICK_PERIODS = {**settings.TOKENPOOLS_TICK_PERIODS, "aimd": 2.0}
    schedule = beat_schedule()
    assert set(schedule) == {f"tick-{n}" for n in ("ewma", "aimd", "scrape", "autoscale", "expiry", "usage_rollup",
                                                      "request_log", "request_log_drain")}
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
def test_autoscale_tick_uses_the_observed_token_demand(admin: Any, memory_control: MemoryControlState) -> None:
    pool = make_pool(admin, name="tiny")  # 240 tok/s per replica, max 10 replicas
    memory_control.pool_demand_set({"tiny": 1000.0})
    assert run_tick("autoscale") is Outcome.RAN
    assert TokenPool.objects.get(pk=pool.pk).desired_replicas == 5
    assert ticks.desired_replicas_gauge() == {("tiny",): 5.0}


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
