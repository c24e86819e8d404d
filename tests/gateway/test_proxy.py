"""The gateway end to end over real HTTP: snapshot auth, admission, proxying, accounting, headers."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from apps.gateway.memory_state import MemoryStateStore
from apps.policy import ManualClock

pytestmark = pytest.mark.django_db


def chat(max_tokens: int | None = 5, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hello there world"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def frozen_store() -> MemoryStateStore:
    # A clock that never moves: the token bucket refills nothing, so its level is exact.
    return MemoryStateStore(clock=ManualClock(100.0))


def test_non_streaming_chat_is_proxied_with_headers_and_accounted(gateway_factory: Any) -> None:
    h = gateway_factory(store=frozen_store())
    response = httpx.post(h.url + "/v1/chat/completions", json=chat(), headers=h.auth())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
    for header in ("x-request-id", "x-tokenpools-overhead-ms", "x-ratelimit-limit-requests",
                   "x-ratelimit-remaining-requests", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                   "x-ratelimit-reset-tokens", "x-ratelimit-reset-requests"):
        assert header in response.headers, header
    assert response.headers["x-ratelimit-limit-requests"] == "4"
    # The backend is asked for the pool's model name and exactly the reserved max_tokens.
    sent = h.upstreams[0].received[-1]
    assert sent["model"] == "tiny-model"
    assert sent["max_tokens"] == 5
    usage = h.usage()
    assert usage.in_flight == 0
    # Bucket: 60 s x 1000 tok/s; charged prompt+max_tokens, refunded what was not used (nothing here).
    prompt = response.json()["usage"]["prompt_tokens"]
    assert usage.tokens_available == 60_000 - prompt - 5


def test_unused_reservation_is_refunded(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory(max_output=2)
    h = gateway_factory(upstreams=[upstream], store=frozen_store())
    response = httpx.post(h.url + "/v1/chat/completions", json=chat(max_tokens=500), headers=h.auth())
    assert response.status_code == 200
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 2
    # Charged prompt+500 at admission, 498 unused tokens came back at completion.
    assert h.usage().tokens_available == 60_000 - usage["prompt_tokens"] - 2


def test_missing_max_tokens_gets_the_entitlement_default(gateway_factory: Any) -> None:
    h = gateway_factory(entitlement={"default_max_tokens": 7})
    response = httpx.post(h.url + "/v1/chat/completions", json=chat(max_tokens=None), headers=h.auth())
    assert response.status_code == 200
    assert h.upstreams[0].received[-1]["max_tokens"] == 7


def test_input_tokens_come_from_the_backend_tokenizer(gateway_factory: Any) -> None:
    h = gateway_factory(entitlement={"tokens_per_second": 1, "default_max_tokens": 1})
    # Bucket of 60 tokens: a 70-word prompt is larger than the whole entitlement by the tokenizer's
    # count (70 words = 70 tokens upstream) but not by the character estimate (~4 chars per token).
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a " * 70}], "max_tokens": 1}
    response = httpx.post(h.url + "/v1/chat/completions", json=body, headers=h.auth())
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert response.headers["x-should-retry"] == "false"


def test_streaming_passes_chunks_and_strips_usage_the_client_did_not_ask_for(gateway_factory: Any) -> None:
    h = gateway_factory()
    with httpx.stream("POST", h.url + "/v1/chat/completions", json=chat(max_tokens=3, stream=True),
                      headers=h.auth()) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert "x-request-id" in response.headers
        text = response.read().decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 3
    assert all(c["choices"] for c in chunks)
    # The gateway asked the backend for usage anyway, and accounted for it.
    assert h.upstreams[0].received[-1]["stream_options"] == {"include_usage": True}
    assert h.usage().in_flight == 0


def test_streaming_keeps_usage_chunk_when_asked(gateway_factory: Any) -> None:
    h = gateway_factory()
    body = chat(max_tokens=2, stream=True, stream_options={"include_usage": True})
    response = httpx.post(h.url + "/v1/chat/completions", json=body, headers=h.auth())
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_completions_endpoint_streams_and_non_streams(gateway_factory: Any) -> None:
    h = gateway_factory()
    body = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 4}
    whole = httpx.post(h.url + "/v1/completions", json=body, headers=h.auth())
    assert whole.status_code == 200
    assert whole.json()["choices"][0]["text"].startswith("t0")
    streamed = httpx.post(h.url + "/v1/completions", json={**body, "stream": True}, headers=h.auth())
    assert len(sse_events(streamed.text)) == 5


def test_models_lists_the_pool_of_the_key(gateway_factory: Any) -> None:
    h = gateway_factory()
    response = httpx.get(h.url + "/v1/models", headers=h.auth())
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["tiny", "tiny-model"]
    assert httpx.get(h.url + "/v1/models").status_code == 401


def test_model_name_of_the_backend_also_selects_the_pool(gateway_factory: Any) -> None:
    h = gateway_factory()
    response = httpx.post(h.url + "/v1/chat/completions", json=chat(model="tiny-model"), headers=h.auth())
    assert response.status_code == 200


def test_concurrency_limit_rejects_with_retry_headers(gateway_factory: Any, upstream_factory: Any) -> None:
    import asyncio

    upstream, _ = upstream_factory(first_token_delay_s=0.5)
    h = gateway_factory(upstreams=[upstream], entitlement={"concurrency": 2, "queue_max": 0})

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=10) as client:
            return await asyncio.gather(*(client.post(h.url + "/v1/chat/completions", json=chat(), headers=h.auth())
                                          for _ in range(4)))

    responses = asyncio.run(fire())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 429, 429]
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    assert rejected.headers["x-tokenpools-reject-reason"] == "concurrency_limit_exceeded"
    assert int(rejected.headers["retry-after"]) >= 1
    assert int(rejected.headers["retry-after-ms"]) >= 1
    assert "x-should-retry" not in rejected.headers
    assert rejected.headers["x-ratelimit-remaining-requests"] == "0"
    assert h.usage().in_flight == 0


def test_slot_is_free_when_the_client_sees_done(gateway_factory: Any, upstream_factory: Any) -> None:
    """A client that stops reading at [DONE] (as the OpenAI SDK does) and sends its next request at once
    must find its slot free, even while the backend has not closed the finished stream yet."""
    upstream, _ = upstream_factory(linger_after_done_s=0.5)
    h = gateway_factory(upstreams=[upstream], entitlement={"concurrency": 1})
    statuses = []
    with httpx.Client(timeout=30) as first, httpx.Client(timeout=30) as second:
        for _ in range(3):
            with first.stream("POST", h.url + "/v1/chat/completions", json=chat(stream=True),
                              headers=h.auth()) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        break
                # The first stream is still open (the backend lingers); the next request goes now.
                statuses.append(second.post(h.url + "/v1/chat/completions", json=chat(), headers=h.auth()).status_code)
    assert statuses == [200, 200, 200]
