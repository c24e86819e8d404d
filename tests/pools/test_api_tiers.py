"""REST fields of issue 24: an entitlement's spillover_class and quota_on_exceeded, a tenant's
quota_on_exceeded, a pool's inference_objectives and backend kind llm-d; bad values get field errors."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from apps.pools.models import TokenEntitlement, TokenPool
from apps.tenancy.models import Tenant
from tests.pools.factories import make_pool
from tests.pools.test_api import POOL_BODY
from tests.pools.test_api_isolation import client_as

pytestmark = [pytest.mark.api, pytest.mark.django_db]


@pytest.fixture
def root(admin: Any) -> APIClient:
    return client_as(admin)


def _entitlement(**fields: Any) -> dict[str, Any]:
    return {"name": "acme-chat", "tenant": "acme", "pool": "qwen3-8b", "service_class": "guaranteed",
            "slo_target_ms": 200, "tokens_per_second": 100, "kv_cache_gib": "2", "concurrency": 4, **fields}


def test_entitlement_spillover_and_on_exceeded_round_trip(root: APIClient, admin: Any, acme: Any) -> None:
    make_pool(admin)
    body = _entitlement(spillover_class="spot", quota_tokens=1000, quota_window="day", quota_on_exceeded="spot")
    response = root.post("/api/v1/entitlements/", body, format="json")
    assert response.status_code == 201, response.json()
    got = root.get("/api/v1/entitlements/acme-chat/").json()
    assert (got["spillover_class"], got["quota_on_exceeded"]) == ("spot", "spot")
    assert root.patch("/api/v1/entitlements/acme-chat/", {"spillover_class": ""}, format="json").status_code == 200
    assert TokenEntitlement.objects.get().spillover_class == ""


def test_entitlement_defaults(root: APIClient, admin: Any, acme: Any) -> None:
    make_pool(admin)
    got = root.post("/api/v1/entitlements/", _entitlement(), format="json").json()
    assert (got["spillover_class"], got["quota_on_exceeded"]) == ("", "reject")


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"spillover_class": "cheap"}, "spillover_class", "unknown class 'cheap'"),
        ({"spillover_class": "guaranteed"}, "spillover_class", "is not lower than 'guaranteed'"),
        ({"service_class": "spot", "spillover_class": "preemptible"}, "spillover_class",
         "a spot entitlement cannot spill over"),
        ({"quota_tokens": 10, "quota_window": "day", "quota_on_exceeded": "throttle"}, "quota_on_exceeded",
         "expected reject"),
        ({"quota_on_exceeded": "spot"}, "quota_on_exceeded", "applies to a quota"),
    ],
)
def test_bad_entitlement_tier_fields_are_field_errors(root: APIClient, admin: Any, acme: Any, fields: dict[str, Any],
                                                      field: str, words: str) -> None:
    make_pool(admin)
    response = root.post("/api/v1/entitlements/", _entitlement(**fields), format="json")
    assert response.status_code == 400
    assert any(words in m for m in response.json()[field]), response.json()
    assert TokenEntitlement.objects.count() == 0


def test_tenant_quota_on_exceeded(root: APIClient, acme: Any) -> None:
    response = root.patch("/api/v1/tenants/acme/", {"quota_tokens": 5000, "quota_window": "month",
                                                    "quota_on_exceeded": "spot"}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["quota_on_exceeded"] == "spot"
    assert Tenant.objects.get(slug="acme").quota_on_exceeded == "spot"
    bad = root.patch("/api/v1/tenants/acme/", {"quota_on_exceeded": "block"}, format="json")
    assert bad.status_code == 400 and "expected reject" in bad.json()["quota_on_exceeded"][0]
    assert Tenant.objects.get(slug="acme").quota_on_exceeded == "spot"


def test_llm_d_pool_with_objectives(root: APIClient) -> None:
    body = {**POOL_BODY, "backend_kind": "llm-d", "inference_objectives": {"guaranteed": "premium"}}
    response = root.post("/api/v1/pools/", body, format="json")
    assert response.status_code == 201, response.json()
    got = root.get("/api/v1/pools/llama/").json()
    assert (got["backend_kind"], got["inference_objectives"]) == ("llm-d", {"guaranteed": "premium"})
    cleared = root.patch("/api/v1/pools/llama/", {"inference_objectives": {}}, format="json")
    assert cleared.status_code == 200 and TokenPool.objects.get().inference_objectives == {}


@pytest.mark.parametrize(
    ("objectives", "words"),
    [
        ({"gold": "premium"}, "unknown service class 'gold'"),
        ({"spot": "Batch_Jobs"}, "not a Kubernetes object name"),
        ({"spot": 3}, "not a Kubernetes object name"),
        (["premium"], "a map of service class"),
    ],
)
def test_bad_objectives_are_field_errors(root: APIClient, objectives: Any, words: str) -> None:
    body = {**POOL_BODY, "backend_kind": "llm-d", "inference_objectives": objectives}
    response = root.post("/api/v1/pools/", body, format="json")
    assert response.status_code == 400
    assert any(words in m for m in response.json()["inference_objectives"]), response.json()
    assert TokenPool.objects.count() == 0
