"""Nothing a client sends raises its standing (issue 22, item 1): llm-d's SLO headers only relax what the
entitlement grants, and an unknown objective is a 400. On both state stores."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from tests.gateway.test_errors import assert_openai_error

pytestmark = pytest.mark.django_db

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
TIGHT = {"x-llm-d-slo-ttft-ms": "1", "x-llm-d-inference-objective": "critical"}
ROUNDS = 3


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: Any) -> Any:
    if request.param == "memory":
        return None
    from apps.gateway.redis_state import RedisStateStore

    return RedisStateStore(url=request.getfixturevalue("redis_url"), prefix=f"t{uuid.uuid4().hex}:")


def contended_pool(gateway_factory: Any, upstream_factory: Any, store: Any) -> Any:
    """A spot entitlement on a pool of one slot, the slot held by a 0.6 s stream of the same key."""
    upstream, _ = upstream_factory(token_delay_s=0.05)
    return gateway_factory(upstreams=[upstream], store=store, pool={"slots_per_replica": 1},
                           entitlement={"service_class": "spot", "concurrency": 4}, config={"tokenize": False})


async def _round(h: Any) -> tuple[int, int]:
    """Fill the pool, then send an unhinted request and, after it, one of the same key with the headers."""
    async with httpx.AsyncClient(timeout=20) as client:
        holder = client.build_request("POST", h.url + "/v1/chat/completions", headers=h.auth(),
                                      json={**BODY, "max_tokens": 12, "stream": True})
        response = await client.send(holder, stream=True)
        lines = response.aiter_lines()
        while not (await anext(lines)).startswith("data: "):
            pass
        plain = await client.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
        hinted = await client.post(h.url + "/v1/chat/completions", json=BODY, headers={**h.auth(), **TIGHT})
        async for _ in lines:
            pass
        await response.aclose()
        if plain.status_code == 429:
            assert plain.json()["error"]["code"] == "pool_contended"
        return plain.status_code, hinted.status_code


def test_a_tighter_slo_header_does_not_overtake_in_a_contended_pool(gateway_factory: Any, upstream_factory: Any,
                                                                    store: Any) -> None:
    h = contended_pool(gateway_factory, upstream_factory, store)
    outcomes = [asyncio.run(_round(h)) for _ in range(ROUNDS)]
    overtakes = sum(hinted == 200 and plain != 200 for plain, hinted in outcomes)
    print(f"\nheader attack ({'redis' if store else 'memory'} store): {overtakes} of {ROUNDS} overtakes; "
          f"(unhinted, hinted) statuses {outcomes}")
    # Refused like the request without the headers, never served where it was not.
    assert overtakes == 0 and all(plain == hinted == 429 for plain, hinted in outcomes), outcomes
    assert h.usage().in_flight == 0


def test_a_looser_hint_is_honoured_and_an_unknown_objective_is_a_400(gateway_factory: Any, store: Any) -> None:
    h = gateway_factory(store=store, entitlement={"service_class": "elastic"})
    loose = {"x-llm-d-slo-ttft-ms": "60000", "x-llm-d-inference-objective": "Batch"}
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers={**h.auth(), **loose}).status_code == 200
    response = httpx.post(h.url + "/v1/chat/completions", json=BODY,
                          headers={**h.auth(), "x-llm-d-inference-objective": "platinum"})
    assert_openai_error(response, 400, "invalid_request")
    error = response.json()["error"]
    assert error["param"] == "x-llm-d-inference-objective" and "platinum" in error["message"]
    assert h.usage().in_flight == 0
    assert len(h.upstreams[0].received) == 1
