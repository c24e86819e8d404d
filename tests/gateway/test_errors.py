"""Bad input gets an OpenAI-style 4xx, never a 500, and leaves no reservation behind."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.django_db

GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert "x-request-id" in response.headers
    assert "x-tokenpools-overhead-ms" in response.headers


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_request"),
        (b"[1, 2]", 400, "invalid_request"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "invalid_request"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
        (b'{"model": "tiny", "messages": []}', 400, "invalid_request"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400,
         "max_tokens_invalid"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10000000000}', 400,
         "max_tokens_invalid"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', 400,
         "max_tokens_invalid"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1023}', 400,
         "context_length_exceeded"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "unsupported_parameter"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400,
         "invalid_request"),
    ],
)
def test_bad_bodies_are_4xx_and_leave_nothing_in_flight(gateway_factory: Any, body: bytes, status: int,
                                                        code: str) -> None:
    h = gateway_factory()
    response = httpx.post(h.url + "/v1/chat/completions", content=body,
                          headers={**h.auth(), "content-type": "application/json"})
    assert_openai_error(response, status, code)
    assert response.headers["x-ratelimit-remaining-requests"] == "4"
    assert h.usage().in_flight == 0
    assert h.upstreams[0].received == []


def test_oversized_body_is_413(gateway_factory: Any) -> None:
    h = gateway_factory(config={"max_body_bytes": 1000})
    body = {**GOOD, "messages": [{"role": "user", "content": "x" * 2000}]}
    assert_openai_error(httpx.post(h.url + "/v1/chat/completions", json=body, headers=h.auth()), 413,
                        "request_too_large")


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic abc", "Bearer"])
def test_bad_keys_are_401(gateway_factory: Any, header: str | None) -> None:
    h = gateway_factory()
    headers = {} if header is None else {"Authorization": header}
    response = httpx.post(h.url + "/v1/chat/completions", json=GOOD, headers=headers)
    assert_openai_error(response, 401, "invalid_api_key")
    assert response.json()["error"]["type"] == "authentication_error"
    assert response.headers["www-authenticate"] == 'Bearer realm="tokenpools"'


def test_unknown_route_and_wrong_method(gateway_factory: Any) -> None:
    h = gateway_factory()
    assert_openai_error(httpx.get(h.url + "/v1/nothing", headers=h.auth()), 404, "not_found")
    assert_openai_error(httpx.get(h.url + "/v1/chat/completions", headers=h.auth()), 405, "method_not_allowed")


def test_unbound_entitlement_is_429_without_retry(gateway_factory: Any) -> None:
    # Far more concurrency than the pool holds: the entitlement cannot bind (Degraded or Pending).
    h = gateway_factory(entitlement={"concurrency": 500})
    response = httpx.post(h.url + "/v1/chat/completions", json=GOOD, headers=h.auth())
    assert_openai_error(response, 429, "entitlement_not_bound")
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["x-tokenpools-reject-reason"] == "entitlement_not_bound"
    assert "retry-after" in response.headers


def test_model_of_another_pool_is_not_found_for_this_key(gateway_factory: Any, admin: Any) -> None:
    from tests.pools.factories import make_pool

    make_pool(admin, name="other", replicas=[{"url": "http://127.0.0.1:9"}])
    h = gateway_factory()
    response = httpx.post(h.url + "/v1/chat/completions", json={**GOOD, "model": "other"}, headers=h.auth())
    assert_openai_error(response, 404, "model_not_found")


def test_gateway_that_cannot_load_its_snapshot_answers_503() -> None:
    import asyncio

    from apps.gateway.app import Gateway
    from apps.gateway.config import GatewayConfig
    from apps.gateway.memory_state import MemoryStateStore
    from apps.gateway.snapshot import SnapshotCache

    def broken() -> Any:
        raise RuntimeError("database is away")

    config = GatewayConfig(background=False)
    gateway = Gateway(config=config, store=MemoryStateStore(),
                      snapshots=SnapshotCache(config=config, loader=broken, marker=lambda: 0))

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=gateway)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post("/v1/chat/completions", json=GOOD, headers={"Authorization": "Bearer x"})

    response = asyncio.run(call())
    assert_openai_error(response, 503, "gateway_unavailable")
    client = gateway.client
    assert_openai_error(asyncio.run(call()), 503, "gateway_unavailable")
    assert gateway.client is client  # a failed start is retried without leaking a connection pool
    gateway.snapshots.close()
