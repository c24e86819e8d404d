"""`manage.py serve` stopped with SIGTERM while requests are in flight loses nothing: the server stops
accepting, lets them finish (GATEWAY_DRAIN_TIMEOUT_S), and the gateway's stop releases what is held and
flushes usage, so every request that was answered is in the usage records. With the in-process store and
one process, and with Redis and two worker processes."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.upstream import Upstream
from tests.support.crash import recorded_requests
from tests.support.crash import upstream as backend
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.site import prepare_site, server_log, serving

pytestmark = [pytest.mark.slow]

POOL = "drain"
REQUESTS = 40
HOLD_S = 1.5


@pytest.fixture()
def upstream() -> Iterator[Upstream]:
    with backend(first_token_delay_s=HOLD_S) as server:
        yield server


def _send_then_terminate(url: str, key: str, upstream: Upstream, process: object) -> list[int]:
    """REQUESTS concurrent requests (half streamed); SIGTERM to the server as soon as the backend has
    received all of them, i.e. while every one of them is in flight."""

    def one(index: int) -> int:
        body = {"model": POOL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                "stream": index % 2 == 0}
        with httpx.Client(timeout=60) as client:
            if not body["stream"]:
                return client.post(f"{url}/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"}).status_code
            with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as response:
                text = "".join(response.iter_text())
                return response.status_code if text.rstrip().endswith("[DONE]") else -1

    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        futures = [pool.submit(one, i) for i in range(REQUESTS)]
        deadline = time.monotonic() + 60
        while len(upstream.received) < REQUESTS and time.monotonic() < deadline:
            if all(future.done() for future in futures):
                break
            time.sleep(0.01)
        ended = [future.result() for future in futures if future.done()]
        assert len(upstream.received) == REQUESTS, (
            f"only {len(upstream.received)} reached the backend; answered early: {ended}")
        os.killpg(process.pid, signal.SIGTERM)  # type: ignore[attr-defined]
        return [future.result() for future in futures]


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_sigterm_drains_in_flight_requests_and_records_every_one(
    tmp_path: Path, upstream: Upstream, store: str, request: pytest.FixtureRequest
) -> None:
    env = {"GATEWAY_DRAIN_TIMEOUT_S": "30", "TOKENPOOLS_TICKS": "off"}
    workers = 1
    if store == "redis":
        redis_url = request.getfixturevalue("redis_url")
        env.update({"REDIS_URL": redis_url, "GATEWAY_STATE_BACKEND": "redis", "CELERY_BROKER_URL": "memory://"})
        workers = 2
    manifest = documents(
        tiny_pool(POOL, upstream.url, slots=64),
        entitlement("wide", tenant="acme", pool=POOL, service_class="dedicated", concurrency=64),
    )
    site = prepare_site(tmp_path, tenants=["acme"], manifest=manifest, key_for=["wide"], env=env)
    with serving(site, workers=workers) as (url, process):
        statuses = _send_then_terminate(url, site.keys["wide"], upstream, process)
        process.wait(timeout=60)
    assert statuses == [200] * REQUESTS, (statuses, server_log(site)[-3000:])
    assert recorded_requests(site) == REQUESTS, server_log(site)[-3000:]
