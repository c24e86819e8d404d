"""Hostile JSON on /v1/*: deep nesting, non-finite numbers and prompt batches are 400s before anything is
reserved, and a client's `priority` never reaches the backend (issue 22, items 1, 4 and 8)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.gateway.test_errors import assert_openai_error

pytestmark = pytest.mark.django_db

CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3'


def post(h: Any, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(h.url + path, content=body, headers={**h.auth(), "content-type": "application/json"},
                      timeout=30)


def nested(depth: int, where: str) -> bytes:
    """A chat body whose total nesting is `depth` (the body object is level 1)."""
    if where == "content":  # the messages' content: walked by token counting, before admission
        inner = depth - 3  # body > messages > message, then the content arrays
        return (b'{"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": '
                + b"[" * inner + b"]" * inner + b"}]}")
    inner = depth - 1  # a pass-through field: only re-encoded for the backend, after admission
    return CHAT + b', "extra": ' + b"[" * inner + b"]" * inner + b"}"


def assert_nothing_held(h: Any) -> None:
    assert h.usage().in_flight == 0
    assert h.upstreams[0].received == []


@pytest.mark.parametrize("where", ["content", "extra"])
@pytest.mark.parametrize("depth", [33, 970, 995, 5000])
def test_deep_nesting_is_a_400_naming_the_limit(gateway_factory: Any, depth: int, where: str) -> None:
    h = gateway_factory()
    response = post(h, nested(depth, where))
    assert_openai_error(response, 400, "invalid_request")
    message = response.json()["error"]["message"]
    assert "at most 32 levels" in message and "GATEWAY_MAX_JSON_DEPTH" in message
    assert_nothing_held(h)


def test_nesting_up_to_the_limit_is_served(gateway_factory: Any) -> None:
    h = gateway_factory()
    assert post(h, nested(32, "extra")).status_code == 200
    assert post(h, nested(32, "content")).status_code == 200
    # Many sibling containers are not depth: a 300-message conversation is served.
    conversation = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}] * 300}
    assert post(h, json.dumps(conversation).encode()).status_code == 200


def test_the_depth_limit_is_a_setting(gateway_factory: Any) -> None:
    strict = gateway_factory(config={"max_json_depth": 4})
    response = post(strict, nested(5, "extra"))
    assert_openai_error(response, 400, "invalid_request")
    assert "at most 4 levels" in response.json()["error"]["message"]


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"])
def test_non_finite_numbers_are_a_400_and_never_forwarded(gateway_factory: Any, number: bytes) -> None:
    h = gateway_factory()
    response = post(h, CHAT + b', "temperature": ' + number + b"}")
    assert_openai_error(response, 400, "invalid_request")
    assert "non-finite" in response.json()["error"]["message"]
    assert_nothing_held(h)


def test_finite_numbers_pass_through_unchanged(gateway_factory: Any) -> None:
    h = gateway_factory()
    assert post(h, CHAT + b', "temperature": 0.7, "top_p": 1e-3, "seed": 12345678901234567890}').status_code == 200
    sent = h.upstreams[0].received[-1]
    assert (sent["temperature"], sent["top_p"], sent["seed"]) == (0.7, 1e-3, 12345678901234567890)


@pytest.mark.parametrize("prompt", [["a"] * 50, ["a b", "c"], [[1, 2], [3]]])
def test_a_batch_of_prompts_is_refused_like_n(gateway_factory: Any, prompt: list[Any]) -> None:
    h = gateway_factory()
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 3}).encode()
    response = post(h, body, "/v1/completions")
    assert_openai_error(response, 400, "unsupported_parameter")
    assert response.json()["error"]["param"] == "prompt"
    assert f"holds {len(prompt)} prompts" in response.json()["error"]["message"]
    assert_nothing_held(h)


@pytest.mark.parametrize("prompt", ["one two three", ["one two three"], [5, 6, 7], [[5, 6, 7]]])
def test_one_prompt_in_any_of_its_shapes_is_served(gateway_factory: Any, prompt: Any) -> None:
    h = gateway_factory(config={"tokenize": False})
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 3}).encode()
    response = post(h, body, "/v1/completions")
    assert response.status_code == 200, response.text
    assert h.upstreams[0].received[-1]["prompt"] == prompt


def test_a_client_priority_is_not_forwarded_to_the_backend(gateway_factory: Any) -> None:
    """vLLM under --scheduling-policy priority orders by the body's `priority`: the client must not set it."""
    h = gateway_factory()
    response = post(h, CHAT + b', "priority": -1000, "temperature": 0.5}')
    assert response.status_code == 200, response.text
    sent = h.upstreams[0].received[-1]
    assert "priority" not in sent
    assert sent["temperature"] == 0.5
