"""The dashboard's gauges (apps/gateway/metrics_info.py, issue 28): each entitlement's tenant and class, its
entitled rate and TTFT target, and each replica's health and KV use, read from a real gateway's /metrics."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.metrics import scrape

pytestmark = pytest.mark.django_db


def test_info_entitled_rate_slo_and_replica_gauges(gateway_factory: Any, upstream_factory: Any,
                                                   metrics_token: str) -> None:
    upstream, _ = upstream_factory(waiting=0, kv_usage=0.375)
    down, _ = upstream_factory(healthy=False)
    h = gateway_factory(upstreams=[upstream, down],
                        entitlement={"tokens_per_second": 1234, "slo_target_ms": 1500},
                        extra_entitlements={"acme-batch": {"service_class": "elastic", "tokens_per_second": 50}})
    h.server.call(h.gateway.loops.health_check())
    text = scrape(h.url)
    assert ('tokenpools_entitlement_info{tenant="acme",pool="tiny",entitlement="acme-chat",'
            'service_class="guaranteed"} 1') in text
    assert ('tokenpools_entitlement_info{tenant="acme",pool="tiny",entitlement="acme-batch",'
            'service_class="elastic"} 1') in text
    assert 'tokenpools_entitlement_tokens_per_second{tenant="acme",pool="tiny",entitlement="acme-chat"} 1234' in text
    assert 'tokenpools_entitlement_tokens_per_second{tenant="acme",pool="tiny",entitlement="acme-batch"} 50' in text
    assert 'tokenpools_entitlement_slo_ttft_seconds{tenant="acme",pool="tiny",entitlement="acme-chat"} 1.5' in text
    assert f'tokenpools_replica_healthy{{pool="tiny",replica="{upstream.url}"}} 1' in text
    assert f'tokenpools_replica_healthy{{pool="tiny",replica="{down.url}"}} 0' in text
    assert f'tokenpools_replica_kv_usage{{pool="tiny",replica="{upstream.url}"}} 0.375' in text
    assert f'tokenpools_replica_kv_usage{{pool="tiny",replica="{down.url}"}}' not in text  # no metrics: no series


def test_an_anonymous_reader_sees_the_replicas_but_no_tenant(settings: Any, gateway_factory: Any,
                                                           upstream_factory: Any) -> None:
    settings.METRICS_TOKEN, settings.PRODUCTION, settings.METRICS_ANONYMOUS_LABELS = "", False, False
    upstream, _ = upstream_factory(waiting=0, kv_usage=0.5)
    h = gateway_factory(upstreams=[upstream])
    h.server.call(h.gateway.loops.health_check())
    text = httpx.get(h.url + "/metrics").text
    assert "tokenpools_entitlement_info{" not in text and 'tenant="' not in text and "acme" not in text
    assert f'tokenpools_replica_kv_usage{{pool="tiny",replica="{upstream.url}"}} 0.5' in text
