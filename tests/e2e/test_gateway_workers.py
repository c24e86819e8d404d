"""Several gateway processes for real: `manage.py serve --workers 2` with the Redis state store.

The pool's budget (the AIMD cap) is one number in Redis that every process enforces: each dispatch to
the backend takes one of that many leased slots in one Lua script, whichever process it comes through.
The budget is published by hand here (as the shared AIMD tick does) so the test controls it exactly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from apps.gateway.redis_state import RedisStateStore
from tests.gateway.upstream import Upstream
from tests.support.crash import upstream as backend
from tests.support.crash import worker_pids
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.site import prepare_site, serving

pytestmark = [pytest.mark.slow]

POOL = "shared-budget"
REQUESTS = 8
HOLD_S = 0.6


@pytest.fixture()
def upstream() -> Iterator[Upstream]:
    with backend(first_token_delay_s=HOLD_S) as server:
        yield server


def _publish_budget(redis_url: str, budget: int) -> None:
    async def publish() -> None:
        store = RedisStateStore(url=redis_url)
        try:
            await store.pool_budgets_set(budgets={POOL: budget})
        finally:
            await store.close()

    asyncio.run(publish())


def _burst(url: str, key: str) -> list[int]:
    """REQUESTS concurrent chat completions, each on its own connection (so both processes get some)."""
    def one(_: int) -> int:
        body = {"model": POOL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        with httpx.Client(timeout=30) as client:
            return client.post(f"{url}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}).status_code

    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        return list(pool.map(one, range(REQUESTS)))


def test_two_gateway_processes_enforce_one_pool_budget(tmp_path: Path, redis_url: str, upstream: Upstream) -> None:
    env = {"REDIS_URL": redis_url, "GATEWAY_STATE_BACKEND": "redis", "GATEWAY_ACQUIRE_TIMEOUT_S": "20",
           # No Celery worker runs here: nothing but this test publishes the pool's budget.
           "TOKENPOOLS_TICKS": "celery", "GATEWAY_AIMD_TICK_S": "3600"}
    manifest = documents(
        tiny_pool(POOL, upstream.url, slots=16),
        entitlement("wide", tenant="acme", pool=POOL, service_class="dedicated", concurrency=16),
    )
    site = prepare_site(tmp_path, tenants=["acme"], manifest=manifest, key_for=["wide"], env=env)
    key = site.keys["wide"]
    with serving(site, workers=2) as (url, process):
        deadline = time.monotonic() + 30
        while len(worker_pids(process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(worker_pids(process.pid)) >= 2, "serve --workers 2 did not start two processes"

        # A roomy budget: the backend sees several requests at once (the check below can fail).
        _publish_budget(redis_url, 16)
        upstream.peak = 0
        assert _burst(url, key) == [200] * REQUESTS
        assert upstream.peak > 2, upstream.peak

        # Budget 2 for the pool: whichever process a request comes through, at most 2 reach the backend.
        _publish_budget(redis_url, 2)
        upstream.peak = 0
        started = time.monotonic()
        assert _burst(url, key) == [200] * REQUESTS
        assert upstream.peak == 2, upstream.peak
        # 8 requests of 0.6 s, two at a time: at least 4 rounds.
        assert time.monotonic() - started >= (REQUESTS / 2) * HOLD_S * 0.9
