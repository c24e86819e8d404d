"""Input token counts: the backend's /tokenize when it has one (cached), else the estimate."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from apps.gateway.routing import ReplicaSet
from apps.gateway.tokens import TokenCounter, estimate_tokens

CHAT = {"messages": [{"role": "user", "content": "one two three four five"}]}


def count(counter: TokenCounter, url: str, payload: dict[str, Any], kind: str = "chat") -> int:
    async def run() -> int:
        async with httpx.AsyncClient() as client:
            return await counter.count(client=client, pool="p", model="m", replicas=ReplicaSet((url,)), kind=kind,
                                       payload=payload)

    return asyncio.run(run())


def test_backend_count_is_used_and_cached(upstream_factory: Any) -> None:
    upstream, server = upstream_factory()
    counter = TokenCounter()
    assert count(counter, upstream.url, CHAT) == 7  # 5 words + 2, the test backend's tokenizer
    assert counter.max_model_len["p"] == 1024
    upstream.tokenize = False  # a second identical prompt must not ask again
    assert count(counter, upstream.url, CHAT) == 7
    assert count(counter, upstream.url, {"prompt": "a b c"}, kind="completion") == estimate_tokens(
        "completion", {"prompt": "a b c"})


def test_backend_without_tokenize_falls_back_to_the_estimate(upstream_factory: Any) -> None:
    upstream, _ = upstream_factory(tokenize=False)
    counter = TokenCounter()
    assert count(counter, upstream.url, CHAT) == estimate_tokens("chat", CHAT)
    upstream.tokenize = True  # not asked again for a while: the pool is remembered as unsupported
    assert count(counter, upstream.url, {"messages": [{"role": "user", "content": "x y"}]}) == estimate_tokens(
        "chat", {"messages": [{"role": "user", "content": "x y"}]})


def test_one_refused_input_does_not_switch_the_pool_to_estimates(upstream_factory: Any) -> None:
    """A client whose input the tokenizer refuses gets an estimate; every other request is still counted by the
    backend (before: the whole pool was estimated for a minute, for every tenant)."""
    upstream, _ = upstream_factory(tokenize_refuses="poison")
    counter = TokenCounter()
    assert count(counter, upstream.url, CHAT) == 7
    poison = {"messages": [{"role": "user", "content": "poison " * 40}]}
    assert count(counter, upstream.url, poison) == estimate_tokens("chat", poison)
    assert count(counter, upstream.url, {"messages": [{"role": "user", "content": "a b c"}]}) == 5


def test_a_pool_that_never_tokenized_a_kind_stops_asking_after_a_refusal(upstream_factory: Any) -> None:
    upstream, _ = upstream_factory(tokenize_refuses="user")  # every chat input: no chat template
    counter = TokenCounter()
    assert count(counter, upstream.url, CHAT) == estimate_tokens("chat", CHAT)
    upstream.tokenize_refuses = None
    assert count(counter, upstream.url, {"messages": [{"role": "user", "content": "a b c"}]}) == estimate_tokens(
        "chat", {"messages": [{"role": "user", "content": "a b c"}]})


def test_unreachable_backend_and_disabled_counter_estimate() -> None:
    assert count(TokenCounter(), "http://127.0.0.1:9", CHAT) == estimate_tokens("chat", CHAT)
    assert count(TokenCounter(enabled=False), "http://127.0.0.1:9", {"prompt": [1, 2, 3]},
                 kind="completion") == 3


def test_estimate_shapes() -> None:
    assert estimate_tokens("completion", {"prompt": "x" * 40}) == 10
    assert estimate_tokens("completion", {"prompt": [[1, 2], [3]]}) == 3
    assert estimate_tokens("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 8}]}]}) == 8
