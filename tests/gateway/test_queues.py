"""Waiting in line instead of a 429: a request over its entitlement's own limits waits in the entitlement's
queue (the state machine's, in either store), says how long in `x-tokenpools-queue-ms`, and is turned away
with queue_full or queue_timeout only when its queue says so. A client that leaves while waiting leaves
nothing behind."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any

import httpx
import pytest

from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.policy import AdmissionRequest, EntitlementLimits
from tests.support.metrics import scrape

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(params=["memory", "redis"])
def store_for(request: pytest.FixtureRequest) -> Any:
    def make() -> Any:
        if request.param == "redis":
            return RedisStateStore(url=request.getfixturevalue("redis_url"), prefix=f"tq{uuid.uuid4().hex}:")
        return None  # the harness's in-process store

    return make


def fire(h: Any, count: int, timeout: float = 20.0) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await asyncio.gather(*(client.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
                                          for _ in range(count)))

    return asyncio.run(run())


def queued_in_store(h: Any) -> int:
    store = h.gateway.store
    if isinstance(store, MemoryStateStore):
        ledger = store.ledger(h.pool.name)
        return 0 if ledger is None else ledger.queued
    values = h.server.call(store.record_fields(pool=h.pool.name, field="queued", records=["pool"]))
    return int(float(values[0] or 0))


def test_over_its_concurrency_every_request_waits_and_is_served(gateway_factory: Any, upstream_factory: Any,
                                                                store_for: Any, metrics_token: str) -> None:
    upstream, _ = upstream_factory(first_token_delay_s=0.3)
    h = gateway_factory(upstreams=[upstream], store=store_for(), entitlement={"concurrency": 2})
    responses = fire(h, 6)
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses if r.status_code != 200]
    waits = sorted(float(r.headers["x-tokenpools-queue-ms"]) for r in responses)
    assert waits[:2] == [0.0, 0.0]  # two started at once
    assert all(wait >= 200.0 for wait in waits[2:]), waits  # the rest waited for a release (0.3 s each)
    assert upstream.peak <= 2
    assert h.usage().in_flight == 0 and queued_in_store(h) == 0
    text = scrape(h.url)
    assert 'tokenpools_queue_wait_seconds_count{tenant="acme",pool="tiny",entitlement="acme-chat"} 4' in text
    assert 'tokenpools_queue_depth{tenant="acme",pool="tiny",entitlement="acme-chat"} 0' in text
    assert 'flow_control_queue_size{pool="tiny"} 0' in text


def test_a_full_queue_refuses_at_once_and_a_long_wait_times_out(gateway_factory: Any, upstream_factory: Any,
                                                                store_for: Any) -> None:
    upstream, _ = upstream_factory(first_token_delay_s=0.6)
    h = gateway_factory(upstreams=[upstream], store=store_for(),
                        entitlement={"concurrency": 1, "queue_max": 1, "queue_max_wait_ms": 200})
    responses = fire(h, 3)
    by_code = sorted((r.status_code, r.json().get("error", {}).get("code", "")) for r in responses)
    assert by_code == [(200, ""), (429, "queue_full"), (429, "queue_timeout")], by_code
    for response in responses:
        if response.status_code == 429:
            assert response.headers["x-tokenpools-reject-reason"] == response.json()["error"]["code"]
            assert float(response.headers["retry-after-ms"]) > 0
            assert "x-should-retry" not in response.headers
    timed_out = next(r for r in responses if r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout")
    assert float(timed_out.headers["x-tokenpools-queue-ms"]) >= 150.0
    assert h.usage().in_flight == 0 and queued_in_store(h) == 0


def test_a_client_that_leaves_while_waiting_leaves_nothing_behind(gateway_factory: Any, upstream_factory: Any,
                                                                  store_for: Any) -> None:
    upstream, _ = upstream_factory(first_token_delay_s=0.8)
    h = gateway_factory(upstreams=[upstream], store=store_for(),
                        entitlement={"concurrency": 1, "queue_max_wait_ms": 5000})

    async def run() -> int:
        async with httpx.AsyncClient(timeout=20) as client:
            first = asyncio.create_task(client.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()))
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(timeout=0.2) as impatient:
                with pytest.raises(httpx.TimeoutException):
                    await impatient.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
            return (await first).status_code

    assert asyncio.run(run()) == 200
    deadline = time.monotonic() + 5
    while (h.usage().in_flight or queued_in_store(h)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h.usage().in_flight == 0 and queued_in_store(h) == 0
    assert len(upstream.received) == 1  # the one that left never reached the backend


def test_a_waiter_on_its_bucket_is_woken_at_the_refill_time_without_any_release(store_for: Any) -> None:
    store = store_for() or MemoryStateStore()
    # 100 tokens/s, a bucket of 50: the first request takes 40, the second needs 30 more (0.3 s of refill).
    limits = EntitlementLimits("rated", service_class="guaranteed", tokens_per_second=100.0, token_bucket_seconds=0.5,
                               queue_max_wait_ms=3000.0)
    pool = PoolInfo("refill", "m", ("http://backend",), 8, math.inf, 0, 4096, entitlements=(limits,))

    async def body() -> tuple[str, str, float, bool, float]:
        try:
            first = await store.offer(limits=limits, pool=pool, request=AdmissionRequest("r1", 20, 20))
            second = await store.offer(limits=limits, pool=pool, request=AdmissionRequest("r2", 20, 20))
            assert second.reservation is not None
            began = time.monotonic()
            started = await store.wait(reservation=second.reservation, timeout_s=3.0,
                                       wake_s=second.decision.retry_after_s)
            waited = time.monotonic() - began
            for offer in (first, second):
                assert offer.reservation is not None
                await store.release(reservation=offer.reservation, prompt_tokens=20, completion_tokens=20)
            return first.state, second.decision.reason, second.decision.retry_after_s, started, waited
        finally:
            await store.close()

    first_state, reason, retry_s, started, waited = asyncio.run(body())
    assert (first_state, reason, started) == ("running", "queued", True)
    assert retry_s == pytest.approx(0.3, abs=0.05)
    assert 0.2 <= waited < 2.0, waited


def test_a_wait_in_its_own_queue_is_not_the_pools_latency(gateway_factory: Any, upstream_factory: Any) -> None:
    """The pool's dispatch budget (AIMD) reads the pool's time to first token: an entitlement over its own
    concurrency waits for its own limit, and counted in, that wait would shrink every tenant's budget."""
    upstream, _ = upstream_factory(first_token_delay_s=0.3)
    h = gateway_factory(upstreams=[upstream], entitlement={"concurrency": 1})
    responses = fire(h, 4)
    assert [r.status_code for r in responses] == [200] * 4
    assert max(float(r.headers["x-tokenpools-queue-ms"]) for r in responses) >= 600.0  # the last waited for 3
    histogram = h.gateway.budgets[h.pool.name].histogram
    counts = histogram.counts()
    assert histogram.count == 4
    # What the budget saw is the upstream's 0.3 s, the queue's waits taken out (with them: 0.6 to 1.2 s).
    slower = sum(n for bound, n in zip((*histogram.bounds, math.inf), counts, strict=True) if bound > 0.5)
    assert slower == 0, counts
