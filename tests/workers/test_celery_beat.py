"""The beat-driven path end to end: a real Celery worker with embedded beat, real Redis as broker and
shared state, a file SQLite database. The test plays the gateway: it offers requests to the pool's
admission state machine in Redis (refused ones, then served ones) and writes TTFT observations into the
shared state, and watches the ticks move debt and budget.

Waits poll the shared state until a condition holds (with a generous deadline for a loaded machine);
nothing asserts on durations.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from apps.gateway.control_redis import RedisControlState
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.policy import AdmissionRequest, EntitlementLimits

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 120.0
T = TypeVar("T")

SETUP = """
from django.contrib.auth import get_user_model
from apps.pools.services import entitlement_create, pool_create
from apps.tenancy.models import Tenant
admin = get_user_model().objects.create_superuser("root", "root@example.com", "root-pass-123")
acme = Tenant.objects.create(name="Acme", slug="acme")
pool = pool_create(actor=admin, name="tiny", model_name="tiny", slots_per_replica=16,
                   tokens_per_second_per_replica=1000, kv_cache_gib_per_replica=1, kv_layers=4, kv_heads=4,
                   head_dim=64, replicas=[{"url": "http://127.0.0.1:9"}])
ent = entitlement_create(actor=admin, name="elastic-a", tenant=acme, pool=pool, service_class="elastic",
                         slo_target_ms=1000, tokens_per_second=100, kv_cache_gib="0.25", concurrency=4)
assert ent.state == "Bound", ent.state
"""

# What the ticks build from the database for this entitlement (apps.pools -> EntitlementLimits).
LIMITS = EntitlementLimits(entitlement_id="elastic-a", service_class="elastic", tokens_per_second=100.0,
                           kv_bytes=float(1024**3 // 4), concurrency=4, slo_target_ms=1000.0,
                           queue_max=0)  # over its own concurrency: refused at once (no queue to wait in)
POOL = PoolInfo("tiny", "tiny", ("http://127.0.0.1:9",), 16, float(1024**3), 16, 4096, entitlements=(LIMITS,))
# The same pool with every replica gone: requests wait, then expire at the acquire timeout (unmet demand).
EMPTY = PoolInfo("tiny", "tiny", (), 0, float(1024**3), 16, 4096, entitlements=(LIMITS,))


@pytest.fixture
def worker(tmp_path: Path, redis_url: str) -> Iterator[dict[str, Any]]:
    # A database number of its own: the session's other Redis users never see these keys.
    url = redis_url.rsplit("/", 1)[0] + "/7"
    redis.Redis.from_url(url).flushdb()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tokenpools_site.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "REDIS_URL": url,
        "CELERY_BROKER_URL": url,
        "GATEWAY_STATE_BACKEND": "redis",
        "GATEWAY_TTFT_TARGET_S": "2.0",
        # One-second AIMD ticks over a one-tick window keep the test short; the EWMA tick keeps its 1 s.
        "TOKENPOOLS_TICK_AIMD_S": "1",
        "GATEWAY_AIMD_WINDOW_S": "1",
        "TOKENPOOLS_TICK_SCRAPE_S": "30",
        "TOKENPOOLS_TICK_AUTOSCALE_S": "30",
        "PYTHONUNBUFFERED": "1",
    }
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput"], env=env, cwd=ROOT, check=True, capture_output=True)
    subprocess.run([*manage, "shell", "-c", SETUP], env=env, cwd=ROOT, check=True, capture_output=True)
    log_path = tmp_path / "worker.log"
    celery = Path(sys.executable).with_name("celery")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(celery), "-A", "workers.celery", "worker", "-B", "--pool", "solo", "--loglevel", "INFO",
             "-s", str(tmp_path / "beat-schedule"), "--without-heartbeat", "--without-gossip", "--without-mingle"],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        yield {"url": url, "log": log_path, "proc": proc}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_until(read: Callable[[], T], done: Callable[[T], bool], worker: dict[str, Any], what: str,
                act: Callable[[], None] | None = None) -> list[T]:
    """Poll `read()` (doing `act()` between polls) until `done`; returns every distinct value seen."""
    seen: list[T] = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if worker["proc"].poll() is not None:
            break
        if act is not None:
            act()
        value = read()
        if not seen or value != seen[-1]:
            seen.append(value)
        if done(value):
            return seen
        time.sleep(0.1)
    pytest.fail(f"{what}: never happened; saw {seen[-10:]}\n--- worker log ---\n{worker['log'].read_text()[-6000:]}")


def test_beat_moves_debt_and_aimd_budget_through_redis(worker: dict[str, Any]) -> None:
    loop = asyncio.new_event_loop()
    store = RedisStateStore(url=worker["url"])
    control = RedisControlState(url=worker["url"])
    ids = itertools.count()

    def dynamics(name: str) -> str | None:
        return loop.run_until_complete(store.record_fields(pool="tiny", field=name, records=["ent:elastic-a"]))[0]

    def debt() -> float:
        return float(dynamics("debt") or 0.0)

    def refuse() -> None:  # the gateway turning 50 tokens away for lack of capacity (a waiter that expires)
        async def once() -> None:
            offer = await store.offer(limits=LIMITS, pool=EMPTY,
                                      request=AdmissionRequest(f"req-{next(ids)}", input_tokens=5, max_tokens=45))
            # It waits, or (once its concurrency is all waiting) it is refused: unmet demand either way.
            assert offer.state == "waiting" or offer.decision.reason == "concurrency_limit_exceeded", offer.decision
            await store.expire(pool="tiny")

        loop.run_until_complete(once())

    def serve() -> None:  # the gateway serving a 10-token request in full
        async def once() -> None:
            offer = await store.offer(limits=LIMITS, pool=POOL,
                                      request=AdmissionRequest(f"req-{next(ids)}", input_tokens=5, max_tokens=5))
            assert offer.reservation is not None and offer.state == "running", offer.decision
            await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=5)

        loop.run_until_complete(once())

    try:
        # 1. Underserved elastic entitlement: demand (~500 tok/s refused) far above what it is served.
        rising = _wait_until(debt, lambda d: d > 0.5, worker, "debt rising above 0.5", act=refuse)
        peak = rising[-1]
        assert rising[0] < peak
        assert dynamics("burst") is not None

        # 2. Recovered: everything it asks for is served, so each tick shrinks the debt (gap <= 0).
        decaying = _wait_until(debt, lambda d: d < 0.1, worker, "debt decaying below 0.1", act=serve)
        # The first tick's interval may still hold refusals made just before the switch.
        top = decaying.index(max(decaying))
        assert top <= 1
        after = decaying[top:]
        assert len(after) >= 3
        assert all(later < earlier for earlier, later in zip(after, after[1:], strict=False))

        # 3. AIMD above the band: p99 TTFT 5 s against a 2 s target -> the budget halves from 16.
        def aimd() -> tuple[int, str]:
            record = control.aimd_load("tiny")
            return (-1, "") if record is None else (record.cap, record.last_action)

        def slow_ttft() -> None:
            for _ in range(4):
                control.ttft_observe("tiny", 5.0)

        down = _wait_until(aimd, lambda r: r[1] == "decrease", worker, "AIMD decrease", act=slow_ttft)
        cut = down[-1][0]
        assert cut <= 8
        # ... and published in the gateway's state store, where every gateway process's dispatch reads it.
        _wait_until(lambda: loop.run_until_complete(store.pool_budget(pool="tiny")), lambda b: b == cut, worker,
                    "AIMD budget published")

        # 4. Below the band with demand: after the cooldown the budget climbs by one per tick.
        def fast_ttft() -> None:
            for _ in range(4):
                control.ttft_observe("tiny", 0.1)

        up = _wait_until(aimd, lambda r: r[1] == "increase", worker, "AIMD increase", act=fast_ttft)
        assert up[-1][0] > cut

        # 5. Inside the band (p99 1.92 s in the controller's band-edge buckets): the budget holds.
        before = up[-1][0]

        def steady_ttft() -> None:
            for _ in range(19):
                control.ttft_observe("tiny", 0.75)
            control.ttft_observe("tiny", 2.0)

        held = _wait_until(aimd, lambda r: r[1] == "hold_band", worker, "AIMD hold in band", act=steady_ttft)
        assert held[-1][0] >= before
    finally:
        loop.run_until_complete(store.close())
        loop.close()
        control.close()

    log = worker["log"].read_text()
    assert "Sending due task tick-ewma" in log and "Sending due task tick-aimd" in log
