"""Usage accounting: batched upserts that add up, the read-only API scoped to the caller's tenants,
and the gateway feeding both."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from apps.gateway.api import UsageRecordViewSet
from apps.gateway.models import UsageRecord
from apps.gateway.usage import _Counts, usage_records_upsert_batch
from apps.tenancy.models import Membership, Role

pytestmark = pytest.mark.django_db


def test_batches_add_up_per_tenant_entitlement_and_minute(acme: Any) -> None:
    minute = 29_000_000
    usage_records_upsert_batch({(acme.pk, "e1", minute, ""): _Counts(2, 10, 20, 1)})
    usage_records_upsert_batch({(acme.pk, "e1", minute, ""): _Counts(1, 5, 5, 0), (acme.pk, "e1", minute + 1, ""): _Counts(1)})
    first = UsageRecord.objects.get(entitlement="e1", minute=dt.datetime.fromtimestamp(minute * 60, tz=dt.UTC))
    assert (first.requests, first.prompt_tokens, first.completion_tokens, first.rejected) == (3, 15, 25, 1)
    assert UsageRecord.objects.count() == 2


def _list(user: Any) -> list[dict[str, Any]]:
    from django.urls import include, path
    from rest_framework.routers import DefaultRouter

    router = DefaultRouter()
    router.register("usage", UsageRecordViewSet, basename="usage")
    client = APIClient()
    client.force_authenticate(user)
    from django.test import override_settings

    module = type("Urls", (), {"urlpatterns": [path("api/", include(router.urls))]})
    with override_settings(ROOT_URLCONF=module):
        response = client.get("/api/usage/")
    assert response.status_code == 200
    return response.json()["results"]


def test_api_shows_only_the_callers_tenants(acme: Any, globex: Any, admin: Any) -> None:
    usage_records_upsert_batch({(acme.pk, "acme-e", 29_000_000, ""): _Counts(1, 2, 3, 0),
                                (globex.pk, "globex-e", 29_000_000, ""): _Counts(4, 5, 6, 0)})
    member = get_user_model().objects.create_user("m", password="m-pass-12345")
    Membership.objects.create(tenant=acme, user=member, role=Role.MEMBER)
    outsider = get_user_model().objects.create_user("o", password="o-pass-12345")
    assert [r["entitlement"] for r in _list(member)] == ["acme-e"]
    assert _list(member)[0]["tenant"] == "acme"
    assert _list(outsider) == []
    assert sorted(r["entitlement"] for r in _list(admin)) == ["acme-e", "globex-e"]


def test_gateway_accumulates_usage_and_exposes_metrics(gateway_factory: Any, metrics_token: str) -> None:
    h = gateway_factory(entitlement={"concurrency": 1})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4}
    assert httpx.post(h.url + "/v1/chat/completions", json=body, headers=h.auth()).status_code == 200
    assert httpx.post(h.url + "/v1/chat/completions", json={**body, "max_tokens": 2000},
                      headers=h.auth()).status_code == 400
    pending = h.gateway.usage._pending
    # One key, but for the minute: the served request and the refused one both count under the class that served
    # it (its own); the two may fall either side of a minute's turn, each minute a row of its own.
    assert {(tenant_id, entitlement, tier) for tenant_id, entitlement, _minute, tier in pending} == {
        (h.entitlement.tenant_id, "acme-chat", "guaranteed")}
    assert (sum(c.requests for c in pending.values()), sum(c.completion_tokens for c in pending.values())) == (1, 4)
    assert sum(c.prompt_tokens for c in pending.values()) == 5  # the backend's count (3 words + 2)
    assert h.gateway.budgets["tiny"].histogram.count == 1  # the TTFT the pool's AIMD reads
    usage_records_upsert_batch(dict(pending))
    records = UsageRecord.objects.all()
    assert sum(r.completion_tokens for r in records) == 4
    assert {r.service_tier for r in records} == {"guaranteed"}

    metrics = httpx.get(h.url + "/metrics", headers={"Authorization": f"Bearer {metrics_token}"})
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'gateway_requests_admitted_total{tenant="acme",pool="tiny",entitlement="acme-chat",service_class="guaranteed"} 1' in text
    assert ('gateway_requests_rejected_total{tenant="acme",pool="tiny",entitlement="acme-chat",service_class="guaranteed",'
            'reason="context_length_exceeded"} 1') in text
    assert 'gateway_ttft_seconds_count{tenant="acme",pool="tiny",entitlement="acme-chat"} 1' in text
    assert 'gateway_request_duration_seconds_bucket{pool="tiny",le="+Inf"} 1' in text
    assert 'tokenpools_queue_depth{tenant="acme",pool="tiny",entitlement="acme-chat"}' not in text  # nobody ever waited
    assert 'flow_control_pool_budget{pool="tiny"}' in text
    assert 'flow_control_queue_size{pool="tiny"} 0' in text
    assert 'flow_control_budget_utilization{pool="tiny"} 0' in text
    assert 'gateway_requests_in_flight{pool="tiny"} 0' in text


def test_admin_lists_usage_records_read_only(client: Any, admin: Any, acme: Any) -> None:
    usage_records_upsert_batch({(acme.pk, "acme-e", 29_000_000, ""): _Counts(1, 2, 3, 0)})
    client.force_login(admin)
    page = client.get("/django-admin/gateway/usagerecord/")
    assert page.status_code == 200
    assert b"acme-e" in page.content
    assert client.get("/django-admin/gateway/usagerecord/add/").status_code == 403


@pytest.mark.django_db
def test_a_batch_from_the_shared_store_is_applied_once(acme: Any) -> None:
    from apps.gateway.usage import usage_batch_apply, usage_counts_parse

    minute = int(time.time() // 60)
    batch = usage_counts_parse({f"{acme.pk}|acme-chat|{minute}|r": "3", f"{acme.pk}|acme-chat|{minute}|p": "30",
                                f"{acme.pk}|acme-chat|{minute}|c": "12"})
    assert usage_batch_apply("claim-1", batch) is True
    # The same claim again (taken over after its flusher died between writing and saying so): no double count.
    assert usage_batch_apply("claim-1", batch) is False
    record = UsageRecord.objects.get(tenant=acme, entitlement="acme-chat")
    assert (record.requests, record.prompt_tokens, record.completion_tokens) == (3, 30, 12)


def test_the_gateway_keeps_last_used_at_batched_off_the_request_path(gateway_factory: Any) -> None:
    """Issue 27: a key's last_used_at stays null no more. The account step only notes the key; the usage flush
    writes it (here its writer is called in the test's thread: the test database is not shared with the
    flush's worker thread), and never moves it back."""
    from apps.gateway.usage import _keys_mark_used
    from apps.tenancy.models import ApiKey

    h = gateway_factory(entitlement={"concurrency": 4})
    key = ApiKey.objects.get(entitlement=h.entitlement)
    assert key.last_used_at is None
    body = {"model": "tiny", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 2}
    before = time.time()
    for _ in range(5):
        assert httpx.post(h.url + "/v1/chat/completions", json=body, headers=h.auth()).status_code == 200
    key.refresh_from_db()
    assert key.last_used_at is None  # nothing written on the request path
    noted = dict(h.gateway.usage._keys_used)
    assert list(noted) == [key.pk] and noted[key.pk] >= before
    assert _keys_mark_used(noted) == 1
    key.refresh_from_db()
    assert key.last_used_at is not None and abs(key.last_used_at.timestamp() - noted[key.pk]) < 1e-3
    # Another process's later write is never overwritten by an older one.
    later = key.last_used_at + dt.timedelta(minutes=5)
    ApiKey.objects.filter(pk=key.pk).update(last_used_at=later)
    assert _keys_mark_used(noted) == 0
    key.refresh_from_db()
    assert key.last_used_at == later


def test_one_process_writes_a_key_at_most_once_a_minute() -> None:
    from apps.gateway.usage import KEY_USED_EVERY_S, UsageAccumulator

    usage = UsageAccumulator()
    usage.key_used(7, 1000.0)
    assert usage._keys_used == {7: 1000.0}
    usage._keys_used.clear()
    usage._keys_written[7] = 1000.0  # what a flush leaves behind
    usage.key_used(7, 1000.0 + KEY_USED_EVERY_S / 2)
    assert usage._keys_used == {}
    usage.key_used(7, 1000.0 + KEY_USED_EVERY_S)
    assert usage._keys_used == {7: 1000.0 + KEY_USED_EVERY_S}
