"""Hypothesis fuzzing of `/v1/*` request bodies: never a 5xx, never a reservation left behind."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.django_db

# Unicode edge cases: lone surrogates (JSON escapes them as \\ud800: valid JSON, no valid text), NUL, a byte
# order mark, a right-to-left override, the last code point, combining marks, and anything else in between.
edge_text = st.text(st.characters(exclude_categories=()), max_size=20) | st.sampled_from(
    ["\ud800", "a\udfffb", "\udbff\udc00", "\ufeff", "\u0000", "\u202e", "\U0010ffff", "e\u0301", "\U0001f600" * 3])
anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20) | edge_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
message = st.fixed_dictionaries(
    {},
    optional={"role": st.sampled_from(["user", "system", "assistant"]) | anything,
              "content": st.text(max_size=40) | edge_text | anything},
)
body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "tiny-model", "other", ""]) | anything,
        "messages": st.lists(message, max_size=3) | anything,
        "prompt": st.text(max_size=40) | edge_text | st.lists(st.integers(-5, 50), max_size=5) | anything,
        "max_tokens": st.integers(-5, 2_000) | st.integers() | anything,
        "max_completion_tokens": st.integers(-5, 50) | anything,
        "stream": st.booleans() | anything,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | anything}) | anything,
        "n": st.integers(0, 3) | anything,
        "temperature": anything,
    },
)

# Mostly well-formed bodies with fuzzed values in the fields the gateway interprets, so that
# admission, proxying, streaming and release run too, not only the validation.
plausible = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["tiny", "tiny-model"]),
        "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=30) | edge_text}),
                             min_size=1, max_size=2),
    },
    optional={
        "prompt": st.text(max_size=30),
        "max_tokens": st.integers(-2, 1100) | st.none(),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "temperature": st.floats(0, 2),
        "n": st.just(1),
    },
)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def fuzz_gateway(request: Any, gateway_factory: Any) -> Any:
    store = None
    if request.param == "redis":
        import uuid

        from apps.gateway.redis_state import RedisStateStore

        store = RedisStateStore(url=request.getfixturevalue("redis_url"), prefix=f"t{uuid.uuid4().hex}:")
    return gateway_factory(entitlement={"concurrency": 2}, store=store)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=plausible | body, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_json_bodies_never_5xx_and_never_leak(fuzz_gateway: Any, payload: dict[str, Any], path: str) -> None:
    h = fuzz_gateway
    response = httpx.post(h.url + path, content=json.dumps(payload), headers={**h.auth(),
                          "content-type": "application/json"}, timeout=30)
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert h.usage().in_flight == 0
    assert h.running() == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_raw_bytes_never_5xx(fuzz_gateway: Any, raw: bytes) -> None:
    h = fuzz_gateway
    response = httpx.post(h.url + "/v1/chat/completions", content=raw, headers=h.auth(), timeout=30)
    assert 400 <= response.status_code < 500 or response.status_code == 200
    assert h.usage().in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_a_lone_surrogate_is_a_400_naming_the_field(gateway_factory: Any, path: str, field: str,
                                                      stream: bool) -> None:
    h = gateway_factory(entitlement={"concurrency": 2})
    text = "hello \ud800 there"
    payload: dict[str, Any] = {"model": "tiny", "stream": stream}
    payload[field] = [{"role": "user", "content": text}] if field == "messages" else text
    response = httpx.post(h.url + path, content=json.dumps(payload), headers={**h.auth(),
                          "content-type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_request", field)
    assert "surrogate" in error["message"]
    assert h.usage().in_flight == 0
    assert not h.upstreams[0].received  # nothing reached the backend
