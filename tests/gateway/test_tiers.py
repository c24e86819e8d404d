"""Issue 24, the gateway's side: every answer says which class served it (OpenAI's `service_tier` in the body and
in every stream chunk, `x-tokenpools-service-tier`), `/metrics`, the usage records and the usage summary count
requests and tokens per served tier, and the OpenAI SDK reads the field unchanged.

Which class serves a request is the state machine's decision (its reservation's `service_tier`): here its quota
demotion (a used-up quota that says spot) and its spillover (over the entitlement's own concurrency), on both
stores.
"""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest

from apps.gateway.models import UsageRecord
from apps.gateway.usage import usage_records_upsert_batch
from tests.support.metrics import scrape

pytestmark = pytest.mark.django_db

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 3}
COMPLETION = {"model": "tiny", "prompt": "one two three", "max_tokens": 3}


# An entitlement whose quota is used up at once (1 token) and says `onExceeded: spot`: every request is served
# as spot (the state machine's quota demotion), with room to spare in the pool.
DEMOTED = {"quota_tokens": 1, "quota_window": "day", "quota_on_exceeded": "spot"}


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_every_answer_says_the_class_that_served_it(gateway_factory: Any, path: str, body: dict[str, Any]) -> None:
    h = gateway_factory(extra_entitlements={"acme-batch": {"service_class": "elastic", "concurrency": 4}})
    whole = httpx.post(h.url + path, json=body, headers=h.auth())
    assert whole.status_code == 200
    assert whole.headers["x-tokenpools-service-tier"] == "guaranteed"
    assert whole.json()["service_tier"] == "guaranteed"
    assert whole.json()["usage"]["completion_tokens"] == 3  # the rest of the body untouched

    stream = httpx.post(h.url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                        headers=h.auth(h.secrets["acme-batch"]))
    assert stream.status_code == 200
    assert stream.headers["x-tokenpools-service-tier"] == "elastic"
    events = _events(stream.text)
    assert len(events) == 4  # three tokens and the usage chunk: every one of them says its tier
    assert [e["service_tier"] for e in events] == ["elastic"] * 4
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert stream.text.rstrip().endswith("data: [DONE]")


def test_a_refusal_says_no_tier(gateway_factory: Any) -> None:
    h = gateway_factory()
    refused = httpx.post(h.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 5000}, headers=h.auth())
    assert refused.status_code == 400
    assert "x-tokenpools-service-tier" not in refused.headers
    assert "service_tier" not in refused.json()


def test_the_openai_sdk_reads_the_service_tier(gateway_factory: Any) -> None:
    h = gateway_factory(entitlement=DEMOTED)
    client = openai.OpenAI(base_url=h.url + "/v1", api_key=h.secret, max_retries=0)
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one two"}],
                                            max_tokens=2)
    assert answer.service_tier == "spot"
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one"}],
                                                 max_tokens=2, stream=True, stream_options={"include_usage": True}))
    assert [c.service_tier for c in chunks] == ["spot"] * 3
    raw = client.completions.with_raw_response.create(model="tiny", prompt="one two", max_tokens=2)
    assert raw.headers["x-tokenpools-service-tier"] == "spot"
    assert raw.parse().choices[0].text  # the SDK's completions model still parses it
    assert json.loads(raw.text)["service_tier"] == "spot"


def test_metrics_usage_and_summary_count_per_served_tier(gateway_factory: Any, metrics_token: str,
                                                         admin: Any) -> None:
    """A request served below its entitlement's class is counted under that class: its own series on /metrics,
    its own usage records and summary rows; the entitlement's existing series keep counting it too."""
    h = gateway_factory(entitlement=DEMOTED, pool={"price_input_per_million": "1.00",
                                                             "price_output_per_million": "2.00",
                                                             "price_currency": "USD"})
    for _ in range(2):
        assert httpx.post(h.url + "/v1/chat/completions", json=CHAT, headers=h.auth()).status_code == 200
    text = scrape(h.url, token=metrics_token)
    assert 'gateway_tier_requests_total{tenant="acme",pool="tiny",entitlement="acme-chat",tier="spot"} 2' in text
    assert 'gateway_tier_tokens_total{tenant="acme",pool="tiny",entitlement="acme-chat",tier="spot",kind="completion"} 6' in text
    assert 'gateway_tier_tokens_total{tenant="acme",pool="tiny",entitlement="acme-chat",tier="spot",kind="prompt"} 10' in text
    assert 'gateway_tokens_total{tenant="acme",pool="tiny",entitlement="acme-chat",kind="completion"} 6' in text
    assert 'tier="guaranteed"' not in text

    usage_records_upsert_batch(dict(h.gateway.usage._pending))
    # Records are per calendar minute: the two requests may fall either side of a minute's turn (CI, 2026-11-28).
    records = UsageRecord.objects.all()
    assert {r.service_tier for r in records} == {"spot"}
    assert (sum(r.requests for r in records), sum(r.completion_tokens for r in records)) == (2, 6)
    client = _api(admin)
    rows = client.get("/api/v1/usage/summary/", {"period": "month"}).json()  # a row a month (a month may turn too)
    assert {(r["entitlement"], r["service_tier"], r["spend"]["currency"]) for r in rows} == {("acme-chat", "spot", "USD")}
    assert sum(r["completion_tokens"] for r in rows) == 6
    assert sum(Decimal(r["spend"]["amount"]) for r in rows) == Decimal("0.000022")  # 10 x 1.00 + 6 x 2.00 per million
    listed = client.get("/api/v1/usage/", {"service_tier": "spot"}).json()
    assert [r["service_tier"] for r in listed["results"]] == ["spot"] * len(records)
    assert client.get("/api/v1/usage/", {"service_tier": "guaranteed"}).json()["results"] == []


def _api(user: Any) -> Any:
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.mark.parametrize("kind", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_over_its_concurrency_a_request_spills_over_and_says_so(
    kind: str, request: pytest.FixtureRequest, gateway_factory: Any, upstream_factory: Any
) -> None:
    """Spillover through the gateway: a guaranteed entitlement of one slot that names spot serves a second
    concurrent request at once as spot (the state machine's spillover), and says so."""
    store = None
    if kind == "redis":
        from apps.gateway.redis_state import RedisStateStore

        store = RedisStateStore(url=request.getfixturevalue("redis_url"), prefix=f"t{id(request)}:")
    upstream, _ = upstream_factory(first_token_delay_s=0.5, max_output=3)
    h = gateway_factory(upstreams=[upstream], store=store,
                        entitlement={"concurrency": 1, "spillover_class": "spot", "queue_max": 0})

    async def two_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=10) as client:
            first = asyncio.create_task(client.post(h.url + "/v1/chat/completions", json=CHAT, headers=h.auth()))
            await asyncio.sleep(0.2)  # the first holds the entitlement's one slot
            second = await client.post(h.url + "/v1/chat/completions", json=CHAT, headers=h.auth())
            return [await first, second]

    first, second = asyncio.run(two_at_once())
    assert [r.status_code for r in (first, second)] == [200, 200]
    assert [r.headers["x-tokenpools-service-tier"] for r in (first, second)] == ["guaranteed", "spot"]
    assert [r.json()["service_tier"] for r in (first, second)] == ["guaranteed", "spot"]
