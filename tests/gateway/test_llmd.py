"""Issue 24, the llm-d handoff: a pool whose backend is an llm-d inference gateway gets, on every proxied request,
the tenant as its fairness id, the served class's InferenceObjective and the entitlement's TTFT target; what a
client sends under those names never reaches any backend; an answer that sheds the request reaches the client as
`429 upstream_shed` with its reason, and the request holds nothing afterwards (on both stores)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from apps.gateway.usage import usage_counts_parse
from tests.gateway.test_holds import _held
from tests.gateway.test_tiers import DEMOTED
from tests.support.metrics import scrape

pytestmark = pytest.mark.django_db

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 3}
HANDOFF = ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id", "x-gateway-inference-objective",
           "x-llm-d-inference-objective", "x-llm-d-slo-ttft-ms")
# What a client may try: another tenant's fairness id, a better objective, a tighter TTFT target.
FORGED = {"x-gateway-inference-fairness-id": "globex", "x-llm-d-inference-fairness-id": "globex",
          "x-gateway-inference-objective": "tokenpools-dedicated", "x-llm-d-inference-objective": "critical",
          "x-llm-d-slo-ttft-ms": "5"}
LLMD = {"backend_kind": "llm-d", "inference_objectives": {"guaranteed": "acme-gold", "spot": "best-effort"}}


def _store(kind: str, request: pytest.FixtureRequest) -> Any:
    if kind == "memory":
        return None
    from apps.gateway.redis_state import RedisStateStore

    return RedisStateStore(url=request.getfixturevalue("redis_url"), prefix=f"t{uuid.uuid4().hex}:")


@pytest.mark.parametrize("stream", [False, True])
def test_an_llmd_pool_is_handed_the_tenant_and_the_objective_never_the_clients(
    gateway_factory: Any, upstream_factory: Any, stream: bool,
) -> None:
    upstream, _ = upstream_factory()
    h = gateway_factory(upstreams=[upstream], pool_model=LLMD, entitlement={"slo_target_ms": 750},
                        extra_entitlements={"acme-batch": {"service_class": "elastic", "slo_target_ms": 2500}})
    for secret in (h.secret, h.secrets["acme-batch"]):
        answer = httpx.post(h.url + "/v1/chat/completions", json={**BODY, "stream": stream},
                            headers={**h.auth(secret), **FORGED})
        assert answer.status_code == 200
    gold, batch = upstream.received_headers
    assert {name: gold[name] for name in HANDOFF} == {
        "x-gateway-inference-fairness-id": "acme", "x-llm-d-inference-fairness-id": "acme",
        "x-gateway-inference-objective": "acme-gold", "x-llm-d-inference-objective": "acme-gold",
        "x-llm-d-slo-ttft-ms": "750"}
    # No objective named for elastic in the pool's map: the default name.
    assert [batch[name] for name in HANDOFF] == ["acme", "acme", "tokenpools-elastic", "tokenpools-elastic", "2500"]


def test_the_objective_is_the_served_class_s(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory()
    h = gateway_factory(upstreams=[upstream], pool_model=LLMD, entitlement=DEMOTED)  # served as spot
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    assert upstream.received_headers[0]["x-llm-d-inference-objective"] == "best-effort"
    assert upstream.received_headers[0]["x-gateway-inference-objective"] == "best-effort"


def test_a_vllm_pool_gets_none_of_them(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory()
    h = gateway_factory(upstreams=[upstream])
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers={**h.auth(), **FORGED}).status_code == 200
    (received,) = upstream.received_headers
    assert not set(HANDOFF) & set(received)
    assert "authorization" not in received  # nor the client's key


@pytest.mark.parametrize("status,reason", [(503, "fairness queue full"), (429, None)])
@pytest.mark.parametrize("kind", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_shed_request_is_a_429_and_holds_nothing(
    gateway_factory: Any, upstream_factory: Any, request: pytest.FixtureRequest, kind: str, status: int,
    reason: str | None, metrics_token: str,
) -> None:
    upstream, _ = upstream_factory(shed_status=status, shed_reason=reason)
    h = gateway_factory(upstreams=[upstream], pool_model=LLMD, store=_store(kind, request),
                        entitlement={"quota_tokens": 10_000, "quota_window": "day"})
    for stream in (False, True):
        answer = httpx.post(h.url + "/v1/chat/completions", json={**BODY, "stream": stream}, headers=h.auth())
        assert answer.status_code == 429
        error = answer.json()["error"]
        assert error["code"] == "upstream_shed"
        assert error["type"] == "rate_limit_error"
        assert (reason or f"HTTP {status}") in error["message"]
        assert answer.headers["retry-after"] == "1"
        assert answer.headers["x-tokenpools-reject-reason"] == "upstream_shed"
    assert len(upstream.received) == 2
    # counted as refusals: on /metrics by reason, and in the usage records' rejected count
    assert ('gateway_requests_rejected_total{tenant="acme",pool="tiny",entitlement="acme-chat",service_class="guaranteed",'
            'reason="upstream_shed"} 2') in scrape(h.url, token=metrics_token)
    assert sum(c.rejected for c in h.gateway.usage._pending.values()) == 2
    held = h.server.call(_held(h.gateway))
    assert held["in_flight"] == 0 and held["quota_reserved"] == 0 and held["kv_bytes"] == 0, held
    assert held["quota_used"] == 0, held  # nothing was served: nothing charged
    assert h.gateway.usage.pending == 0 or all(c.requests == 0 for c in h.gateway.usage._pending.values())


@pytest.mark.redis
def test_the_shared_store_counts_usage_per_served_tier(gateway_factory: Any, request: pytest.FixtureRequest) -> None:
    h = gateway_factory(store=_store("redis", request))
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    claims = h.server.call(h.gateway.store.usage_claim(pool="tiny", token="c1", lease_s=30))
    (fields,) = claims.values()
    assert all(field.split("|")[3] == "guaranteed" for field in fields), json.dumps(fields)
    ((_tenant, entitlement, _minute, tier), counts), = usage_counts_parse(fields).items()
    assert (entitlement, tier, counts.requests, counts.completion_tokens) == ("acme-chat", "guaranteed", 1, 3)
