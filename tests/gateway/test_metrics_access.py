"""Who may read /metrics (issue 22, item 5): the METRICS_TOKEN bearer, production closed without one, and an
anonymous reader of the embedded mode shown no tenant's names."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from apps.gateway.metrics import GatewayMetrics
from apps.gateway.metrics_access import TENANT_LABELS

pytestmark = pytest.mark.django_db

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4}


def _served(settings: Any, gateway_factory: Any) -> Any:
    h = gateway_factory(extra_entitlements={"globex-secret-project": {"service_class": "elastic"}})
    for name in ("acme-chat", "globex-secret-project"):
        response = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth(h.secrets[name]))
        assert response.status_code == 200, response.text
    return h


def test_an_anonymous_reader_of_the_embedded_mode_sees_totals_but_no_tenant_names(
        settings: Any, gateway_factory: Any) -> None:
    settings.METRICS_TOKEN, settings.PRODUCTION, settings.METRICS_ANONYMOUS_LABELS = "", False, False
    h = _served(settings, gateway_factory)
    response = httpx.get(h.url + "/metrics")
    assert response.status_code == 200
    text = response.text
    assert "acme-chat" not in text and "globex-secret-project" not in text
    assert "entitlement=" not in text and "quota=" not in text
    # `tenant` is a label of every per-entitlement family now (issue 28): summed away like the entitlement.
    assert "tenant=" not in text and "acme" not in text
    # Counters are summed over the hidden labels: the totals by pool and class are still there.
    assert 'gateway_requests_admitted_total{pool="tiny",service_class="guaranteed"} 1' in text
    assert 'gateway_requests_admitted_total{pool="tiny",service_class="elastic"} 1' in text
    assert 'gateway_tokens_total{pool="tiny",kind="completion"} 8' in text
    assert 'gateway_ttft_seconds_count{pool="tiny"} 2' in text
    # A tenant's quota and the per-entitlement gauges say nothing without their names: left out.
    for family in ("tokenpools_tenant_quota_used_tokens", "tokenpools_entitlement_debt",
                   "tokenpools_entitlement_info", "gateway_store_in_flight"):
        assert f"{family}{{" not in text, family
        assert f"# TYPE {family} gauge" in text


def test_the_operator_may_show_labels_to_anonymous_readers_on_a_private_box(
        settings: Any, gateway_factory: Any) -> None:
    settings.METRICS_TOKEN, settings.PRODUCTION, settings.METRICS_ANONYMOUS_LABELS = "", False, True
    h = _served(settings, gateway_factory)
    text = httpx.get(h.url + "/metrics").text
    assert ('gateway_requests_admitted_total{tenant="acme",pool="tiny",entitlement="globex-secret-project",'
            'service_class="elastic"} 1') in text


def test_with_a_token_only_its_bearer_reads_and_sees_every_label(settings: Any, gateway_factory: Any) -> None:
    settings.METRICS_TOKEN, settings.PRODUCTION, settings.METRICS_ANONYMOUS_LABELS = "s3cret-token", False, True
    h = _served(settings, gateway_factory)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"},
                    {"Authorization": "Bearer s3cret-token-and-more"}, h.auth()):
        response = httpx.get(h.url + "/metrics", headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert response.json()["error"]["code"] == "metrics_token_required"
        assert "acme-chat" not in response.text
    response = httpx.get(h.url + "/metrics", headers={"Authorization": "Bearer s3cret-token"})
    assert response.status_code == 200
    assert 'entitlement="globex-secret-project"' in response.text


def test_production_without_a_token_refuses_and_says_what_to_set(settings: Any, gateway_factory: Any) -> None:
    settings.METRICS_TOKEN, settings.PRODUCTION, settings.METRICS_ANONYMOUS_LABELS = "", True, True
    h = _served(settings, gateway_factory)
    response = httpx.get(h.url + "/metrics")
    assert response.status_code == 401
    assert "METRICS_TOKEN" in response.json()["error"]["message"]
    assert "acme-chat" not in response.text


def test_hidden_labels_are_summed_away_from_counters_and_histograms_and_drop_per_entitlement_gauges() -> None:
    metrics = GatewayMetrics()
    metrics.admitted.inc(("a", "guaranteed"), 2)
    metrics.admitted.inc(("b", "guaranteed"), 3)
    metrics.ttft.observe(("tiny", "a"), 0.1)
    metrics.ttft.observe(("tiny", "b"), 0.3)
    metrics.add_gauge("tokenpools_entitlement_debt", "debt", ("pool", "entitlement"), lambda: {("tiny", "a"): 1.5})
    metrics.add_gauge("tokenpools_tenant_quota_used_tokens", "used", ("tenant",), lambda: {("acme",): 7.0})
    metrics.owners_source = lambda: {"a": ("acme", "tiny"), "b": ("globex", "tiny")}
    full = metrics.render().decode()
    assert 'gateway_requests_admitted_total{tenant="acme",pool="tiny",entitlement="a",service_class="guaranteed"} 2' \
        in full
    assert 'tokenpools_entitlement_debt{tenant="acme",pool="tiny",entitlement="a"} 1.5' in full
    assert 'gateway_ttft_seconds_count{tenant="globex",pool="tiny",entitlement="b"} 1' in full
    assert 'tokenpools_tenant_quota_used_tokens{tenant="acme"} 7' in full
    text = metrics.render(TENANT_LABELS).decode()
    assert 'gateway_requests_admitted_total{pool="tiny",service_class="guaranteed"} 5' in text
    assert "tokenpools_tenant_quota_used_tokens{" not in text
    assert 'gateway_ttft_seconds_count{pool="tiny"} 2' in text
    assert 'gateway_ttft_seconds_sum{pool="tiny"} 0.4' in text
    assert "tokenpools_entitlement_debt{" not in text
    assert 'entitlement="' not in text and 'tenant="' not in text


def test_an_entitlement_gone_from_the_snapshot_keeps_its_tenant_and_pool() -> None:
    """Its counters stay one series: the owners map remembers what an earlier snapshot said."""
    metrics = GatewayMetrics()
    metrics.admitted.inc(("old", "spot"))
    metrics.owners_source = lambda: {"old": ("acme", "tiny")}
    assert 'tenant="acme",pool="tiny",entitlement="old"' in metrics.render().decode()
    metrics.owners_source = lambda: {"new": ("globex", "big")}
    text = metrics.render().decode()
    assert 'gateway_requests_admitted_total{tenant="acme",pool="tiny",entitlement="old",service_class="spot"} 1' \
        in text
