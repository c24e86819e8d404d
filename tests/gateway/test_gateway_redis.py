"""The gateway on a Redis store: 503 while Redis is away (fail closed), by itself back when it returns,
and admission without accounting when configured to fail open."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from apps.gateway.redis_state import RedisStateStore
from tests.support.services import PrivateRedis, free_port

pytestmark = [pytest.mark.django_db, pytest.mark.redis]

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()
    with contextlib.suppress(OSError):
        shutil.rmtree(server.workdir)


def test_fail_closed_then_recovers(gateway_factory: Any, private_redis: PrivateRedis) -> None:
    h = gateway_factory(store=RedisStateStore(url=private_redis.url, socket_timeout_s=0.3))
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    private_redis.stop()
    down = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
    assert down.status_code == 503
    assert down.json()["error"]["code"] == "state_store_unavailable"
    assert down.headers["x-tokenpools-reject-reason"] == "state_store_unavailable"
    assert len(h.upstreams[0].received) == 1  # the refused request never reached the backend
    private_redis.start()
    back = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
    assert back.status_code == 200, back.text[:300]
    assert h.usage().in_flight == 0


def test_fail_open_admits_without_accounting(gateway_factory: Any) -> None:
    store = RedisStateStore(url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2)
    h = gateway_factory(store=store, config={"fail_open": True})
    response = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
    assert response.status_code == 200
    assert len(h.upstreams[0].received) == 1


def test_redis_gateway_enforces_concurrency_and_releases(gateway_factory: Any, redis_url: str,
                                                         upstream_factory: Any) -> None:
    import asyncio

    upstream, _ = upstream_factory(first_token_delay_s=0.4)
    h = gateway_factory(upstreams=[upstream], store=RedisStateStore(url=redis_url, prefix=f"t{uuid.uuid4().hex}:"),
                        entitlement={"concurrency": 2, "queue_max": 0})

    async def fire() -> list[int]:
        async with httpx.AsyncClient(timeout=10) as client:
            responses = await asyncio.gather(*(client.post(h.url + "/v1/chat/completions", json=BODY,
                                                           headers=h.auth()) for _ in range(5)))
        return sorted(r.status_code for r in responses)

    assert asyncio.run(fire()) == [200, 200, 429, 429, 429]
    assert h.usage().in_flight == 0


def test_preemption_reaches_streams_held_by_another_gateway_process(
    gateway_factory: Any, upstream_factory: Any, redis_url: str
) -> None:
    import asyncio

    from apps.gateway.app import Gateway
    from tests.gateway.servers import ServerThread

    prefix = f"t{uuid.uuid4().hex}:"
    upstream, _ = upstream_factory(token_delay_s=0.05)
    first = gateway_factory(
        upstreams=[upstream], store=RedisStateStore(url=redis_url, prefix=prefix),
        pool={"slots_per_replica": 2}, entitlement={"concurrency": 1},
        extra_entitlements={"acme-batch": {"service_class": "preemptible", "concurrency": 2, "slo_target_ms": 5000}},
        config={"tokenize": False},
    )
    # A second process: same snapshot, same Redis, its own memory.
    second = Gateway(config=first.gateway.config, snapshots=first.gateway.snapshots,
                     store=RedisStateStore(url=redis_url, prefix=prefix))
    server = ServerThread(second).start()
    try:
        async def scenario() -> tuple[list[str], int]:
            async with httpx.AsyncClient(timeout=20) as client:
                batch = {**BODY, "max_tokens": 100, "stream": True}
                streams = []
                for _ in range(2):
                    request = client.build_request("POST", first.url + "/v1/chat/completions", json=batch,
                                                   headers=first.auth(first.secrets["acme-batch"]))
                    streams.append(await client.send(request, stream=True))
                readers = [response.aiter_lines() for response in streams]
                for lines in readers:
                    while not (await anext(lines)).startswith("data: "):
                        pass
                urgent = await client.post(server.url + "/v1/chat/completions", json=BODY, headers=first.auth())
                tails = []
                for response, lines in zip(streams, readers, strict=True):
                    tails.append("".join([line async for line in lines]))
                    await response.aclose()
                return tails, urgent.status_code

        tails, status = asyncio.run(scenario())
        assert status == 200
        # The state machine in Redis evicts the one victim that makes room; its process hears of it.
        assert sum('"code": "preempted"' in tail for tail in tails) == 1, tails
        assert first.usage("acme-batch").in_flight == 0
    finally:
        server.call(second.stop())
        server.stop()


def _budget_gauge(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('flow_control_pool_budget{pool="tiny"}'):
            return float(line.split()[-1])
    raise AssertionError("no flow_control_pool_budget for the pool")


@pytest.fixture
def shared_control(redis_url: str) -> Iterator[Any]:
    """The control loops' state in the same Redis, isolated from other tests, in the gateways' buckets."""
    from apps.gateway.control_redis import RedisControlState
    from apps.policy import ttft_histogram_bounds

    state = RedisControlState(url=redis_url, bounds=ttft_histogram_bounds(0.5))
    state.PREFIX = f"tokenpools:test:{uuid.uuid4().hex}:"
    yield state
    for key in state.redis.scan_iter(state.PREFIX + "*"):
        state.redis.delete(key)
    state.close()


def test_two_gateway_processes_share_one_aimd_controller_and_its_budget(
    gateway_factory: Any, upstream_factory: Any, redis_url: str, shared_control: Any
) -> None:
    import asyncio

    from apps.gateway.app import Gateway
    from apps.gateway.control import AimdRecord
    from tests.gateway.servers import ServerThread

    prefix = f"t{uuid.uuid4().hex}:"
    upstream, _ = upstream_factory(first_token_delay_s=0.8)
    first = gateway_factory(
        upstreams=[upstream], store=RedisStateStore(url=redis_url, prefix=prefix),
        pool={"slots_per_replica": 8}, entitlement={"concurrency": 8},
        # A window of one tick (5 s / 5 s): each tick reads what was flushed since the last one.
        config={"tokenize": False, "ttft_target_s": 0.5, "acquire_timeout_s": 10.0, "aimd_window_s": 5.0},
    )
    first.gateway.loops.control = shared_control
    # A second process: same snapshot, same Redis, its own memory and scheduler.
    second = Gateway(config=first.gateway.config, snapshots=first.gateway.snapshots,
                     store=RedisStateStore(url=redis_url, prefix=prefix), control=shared_control)
    server = ServerThread(second).start()
    gateways = [(first.gateway, first.server), (second, server)]

    def fire(per_gateway: int) -> list[int]:
        async def run() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as client:
                responses = await asyncio.gather(*(
                    client.post(url + "/v1/chat/completions", json=BODY, headers=first.auth())
                    for url in (first.url, server.url) for _ in range(per_gateway)))
            return [r.status_code for r in responses]

        upstream.peak = 0
        return run()  # type: ignore[return-value]

    def flush() -> list[int]:
        return [thread.call(gateway.loops.ttft_flush()) for gateway, thread in gateways]

    def tick() -> dict[str, int]:
        return first.server.call(first.gateway.loops.shared_aimd_tick())

    try:
        # Slow first tokens (0.8 s against a 0.5 s target), 6 through each process: neither alone has the
        # controller's 10 samples, the shared window has 12.
        for _ in range(2):
            assert asyncio.run(fire(3)) == [200] * 6
        assert flush() == [6, 6]
        assert tick() == {"tiny": 4}  # 8 slots, halved
        record = shared_control.aimd_load("tiny")
        assert (record.samples, record.last_action) == (12, "decrease")
        flush()  # each process reads the published budget for its gauge (the machine already enforces it)
        assert [_budget_gauge(first.url), _budget_gauge(server.url)] == [4.0, 4.0]
        assert asyncio.run(fire(4)) == [200] * 8
        assert upstream.peak == 4  # 8 requests at once through two processes, 4 at a time

        # Fast first tokens, below the band: the next tick grows the shared budget by one.
        assert sum(flush()) == 8
        assert tick() == {"tiny": 4}  # the cooldown after a decrease; the slow samples leave the window
        shared_control.aimd_save("tiny", AimdRecord(cap=2, min_cap=2, max_cap=8))
        upstream.first_token_delay_s = 0.0
        for _ in range(2):
            assert asyncio.run(fire(3)) == [200] * 6
        assert flush() == [6, 6]
        assert tick() == {"tiny": 3}
        assert shared_control.aimd_load("tiny").last_action == "increase"
        upstream.first_token_delay_s = 0.3
        assert asyncio.run(fire(4)) == [200] * 8
        assert upstream.peak == 3
        flush()  # each process reads the budget the machine enforces, for its gauge
        assert [_budget_gauge(first.url), _budget_gauge(server.url)] == [3.0, 3.0]
        assert first.usage().in_flight == 0
    finally:
        server.call(second.stop())
        server.stop()


def test_one_gateway_process_per_period_runs_the_shared_tick(
    gateway_factory: Any, redis_url: str, shared_control: Any, settings: Any
) -> None:
    from apps.gateway.app import Gateway
    from tests.gateway.servers import ServerThread

    settings.TOKENPOOLS_TICKS = "in-process"  # no Celery: the gateways tick the shared controller
    prefix = f"t{uuid.uuid4().hex}:"
    first = gateway_factory(store=RedisStateStore(url=redis_url, prefix=prefix), pool={"slots_per_replica": 8},
                            config={"tokenize": False, "ttft_target_s": 0.5, "aimd_tick_s": 2.0})
    first.gateway.loops.control = shared_control
    second = Gateway(config=first.gateway.config, snapshots=first.gateway.snapshots,
                     store=RedisStateStore(url=redis_url, prefix=prefix), control=shared_control)
    server = ServerThread(second).start()
    try:
        assert httpx.post(server.url + "/v1/chat/completions", json=BODY, headers=first.auth()).status_code == 200
        counts = [0] * (len(shared_control.bounds) + 1)
        counts[-1] = 20  # far above the band
        shared_control.ttft_add("tiny", counts)
        first.server.call(first.gateway.loops.aimd_tick())
        server.call(second.loops.aimd_tick())  # same period: the other process already ticked
        record = shared_control.aimd_load("tiny")
        assert (record.ticks, record.cap) == (1, 4)
        assert server.call(second.loops.aimd_tick()) == {"tiny": 4}  # still that period: it only reads the budget
        assert second.budgets["tiny"].budget == 4
    finally:
        server.call(second.stop())
        server.stop()


def test_a_request_costs_two_store_scripts_when_the_pool_budget_has_room(
    gateway_factory: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COMMIT + RELEASE once the process holds the entitlement's snapshot from a reply (READ + COMMIT + RELEASE
    before, or when the pool changed meanwhile: apps.gateway.redis_snapshot): the pool's dispatch budget is a
    check inside those scripts, with no round trip of its own, even while a budget is set."""
    store = RedisStateStore(url=redis_url, prefix=f"t{uuid.uuid4().hex}:")
    calls: list[str] = []
    original = RedisStateStore._call

    async def counting(self: RedisStateStore, script: str, keys: list[str], args: list[Any]) -> Any:
        calls.append(script)
        return await original(self, script, keys, args)

    monkeypatch.setattr(RedisStateStore, "_call", counting)
    h = gateway_factory(store=store, entitlement={"concurrency": 2})
    # The first request of a process also syncs the pool into the store (capacity, reservations), once.
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth(), timeout=10).status_code == 200
    assert calls == ["sync", "read", "commit", "release"], calls
    h.server.call(store.pool_budgets_set(budgets={"tiny": 3}))
    # The kept snapshot predates the budget: the start still stands, the budget leaving room (`still_admitted`
    # counts it as `admit` does); COMMIT does not bring READ's snapshot back.
    for want in [["commit", "release"]] * 3:
        calls.clear()
        response = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth(), timeout=10)
        assert response.status_code == 200
        assert calls == want, calls
