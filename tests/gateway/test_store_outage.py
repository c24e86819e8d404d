"""Nothing stays held after a Redis outage: requests that finish while the store is away keep their
releases and retry them, and once Redis is back all of the entitlement's concurrency is admitted within
5 s. Two outages: Redis stopped and restarted with its data kept (append-only file), and Redis frozen
(SIGSTOP) for longer than the store's timeouts, then thawed (SIGCONT). `/metrics` shows the pending
releases and the store's own in-flight count meanwhile."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from apps.gateway.redis_state import RedisStateStore
from tests.support.metrics import scrape
from tests.support.services import PrivateRedis

pytestmark = [pytest.mark.django_db, pytest.mark.redis, pytest.mark.slow, pytest.mark.usefixtures("metrics_token")]

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CONCURRENCY = 4
HOLD_S = 1.5
BACK_WITHIN_S = 5.0


@pytest.fixture
def persistent_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis(persistent=True)
    server.start()
    yield server
    server.remove()


def _gauge(url: str, name: str, labels: str = "") -> float | None:
    text = scrape(url)
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return None if match is None else float(match.group(1))


def _all_admitted(h: Any) -> bool:
    """`CONCURRENCY` requests at once on the entitlement: True when every one is served."""
    async def fire() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            responses = await asyncio.gather(*(client.post(h.url + "/v1/chat/completions", json=BODY,
                                                           headers=h.auth()) for _ in range(CONCURRENCY)))
        return [r.status_code for r in responses]

    return asyncio.run(fire()) == [200] * CONCURRENCY


def _outage_with_requests_in_flight(h: Any, upstream: Any, go_away: Callable[[], None],
                                    come_back: Callable[[], None]) -> float:
    """Start requests that hold all but one slot, take the store away, let them finish, bring it back;
    returns the seconds from its return until the whole concurrency is admitted again."""
    upstream.first_token_delay_s = HOLD_S
    before = len(upstream.received)

    async def in_flight() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            requests = [asyncio.create_task(client.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()))
                        for _ in range(CONCURRENCY - 1)]
            while len(upstream.received) < before + CONCURRENCY - 1:
                await asyncio.sleep(0.01)
            go_away()  # the requests are admitted and at the backend: they finish while the store is away
            return [r.status_code for r in await asyncio.gather(*requests)]

    assert asyncio.run(in_flight()) == [200] * (CONCURRENCY - 1)
    assert _gauge(h.url, "gateway_pending_releases") == CONCURRENCY - 1
    upstream.first_token_delay_s = 0.0
    come_back()
    back = time.monotonic()
    while not _all_admitted(h):
        assert time.monotonic() - back < 30, "the entitlement's concurrency never came back"
        time.sleep(0.2)
    elapsed = time.monotonic() - back
    # A frozen Redis may run the releases it had buffered once thawed (then the retries find them done):
    # either way none is left pending after the next retry.
    deadline = time.monotonic() + 3
    while _gauge(h.url, "gateway_pending_releases") != 0:
        assert time.monotonic() < deadline, "releases still pending"
        time.sleep(0.1)
    return elapsed


def _gateway(gateway_factory: Any, redis: PrivateRedis) -> Any:
    return gateway_factory(store=RedisStateStore(url=redis.url, socket_timeout_s=0.5),
                           entitlement={"concurrency": CONCURRENCY},
                           config={"tokenize": False})


def test_a_store_stopped_and_restarted_with_its_data_leaves_nothing_held(
    gateway_factory: Any, persistent_redis: PrivateRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    h = _gateway(gateway_factory, persistent_redis)
    assert _all_admitted(h)
    elapsed = _outage_with_requests_in_flight(h, h.upstreams[0], persistent_redis.stop, persistent_redis.start)
    with capsys.disabled():
        print(f"\nRedis stopped and restarted: all {CONCURRENCY} slots admitted {elapsed:.2f} s after its return")
    assert elapsed < BACK_WITHIN_S, elapsed
    deadline = time.monotonic() + 5
    while _gauge(h.url, "gateway_store_in_flight", '{tenant="acme",pool="tiny",entitlement="acme-chat"}') != 0:
        assert time.monotonic() < deadline, "the store's own view still counts requests in flight"
        time.sleep(0.2)


def test_a_frozen_store_leaves_nothing_held_once_it_thaws(
    gateway_factory: Any, persistent_redis: PrivateRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    h = _gateway(gateway_factory, persistent_redis)
    assert _all_admitted(h)
    elapsed = _outage_with_requests_in_flight(h, h.upstreams[0], persistent_redis.pause, persistent_redis.resume)
    with capsys.disabled():
        print(f"\nRedis frozen (SIGSTOP) then thawed: all {CONCURRENCY} slots admitted {elapsed:.2f} s after SIGCONT")
    assert elapsed < BACK_WITHIN_S, elapsed


def test_metrics_export_the_stores_debt_burst_and_priority(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory()
    h = gateway_factory(upstreams=[upstream], entitlement={"concurrency": CONCURRENCY})
    labels = '{tenant="acme",pool="tiny",entitlement="acme-chat"}'
    deadline = time.monotonic() + 10
    while _gauge(h.url, "tokenpools_entitlement_priority", labels) is None:
        assert time.monotonic() < deadline, "no priority gauge within 10 s"
        time.sleep(0.2)
    # A guaranteed entitlement with no debt or burst: its class weight (1000) times its SLO term.
    assert _gauge(h.url, "tokenpools_entitlement_debt", labels) == 0.0
    assert _gauge(h.url, "tokenpools_entitlement_burst", labels) == 0.0
    assert (_gauge(h.url, "tokenpools_entitlement_priority", labels) or 0) > 100
