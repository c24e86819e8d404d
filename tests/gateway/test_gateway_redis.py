"""The gateway on a Redis store: 503 while Redis is away (fail closed), by itself back when it returns,
and admission without accounting when configured to fail open."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from apps.gateway.redis_state import RedisStateStore
from tests.support.services import free_port, wait_for_port

pytestmark = [pytest.mark.django_db, pytest.mark.redis]

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class PrivateRedis:
    """A redis-server this test may stop and start again on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = tempfile.mkdtemp(prefix="tokenpools-gw-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server not installed")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, proc=self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


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
                        entitlement={"concurrency": 2})

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
        assert all('"code": "preempted"' in tail for tail in tails)
        assert first.usage("acme-batch").in_flight == 0
    finally:
        server.call(second.stop())
        server.stop()
