"""The REST API's behaviour: pools with derived capacity, entitlements binding, filters, bad input, schema."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from apps.pools.models import EntitlementStateChange, Replica, TokenEntitlement, TokenPool
from tests.pools.factories import make_entitlement, make_pool
from tests.pools.test_api_isolation import client_as

pytestmark = [pytest.mark.api, pytest.mark.django_db]

POOL_BODY = {
    "name": "llama",
    "model_name": "meta/llama",
    "backend_kind": "vllm",
    "replicas": [{"url": "http://10.0.0.1:8000"}, {"url": "http://10.0.0.2:8000", "enabled": False}],
    "min_replicas": 1,
    "max_replicas": 4,
    "slots_per_replica": 16,
    "tokens_per_second_per_replica": 240,
    "kv_cache_gib_per_replica": "20",
    "kv_layers": 36,
    "kv_heads": 8,
    "head_dim": 128,
    "bytes_per_element": 2,
}


@pytest.fixture
def root_client(admin: Any) -> APIClient:
    return client_as(admin)


def test_superuser_creates_pool_with_replicas_and_derived_capacity(root_client: APIClient) -> None:
    response = root_client.post("/api/v1/pools/", POOL_BODY, format="json")
    assert response.status_code == 201, response.json()
    body = root_client.get("/api/v1/pools/llama/").json()
    assert body["bytes_per_token"] == 2 * 36 * 8 * 128 * 2
    assert [r["enabled"] for r in body["replicas"]] == [True, False]
    assert body["usage"]["enabled_replicas"] == 1
    assert body["usage"]["capacity"] == {"slots": 16, "tokens_per_second": 240, "kv_bytes": 20 * 1024**3,
                                         "kv_gib": 20.0}


def test_enabling_a_replica_through_the_api_rebinds(root_client: APIClient, acme: Any, admin: Any) -> None:
    root_client.post("/api/v1/pools/", POOL_BODY, format="json")
    pool = TokenPool.objects.get(name="llama")
    make_entitlement(admin, acme, pool, "a", concurrency=16)
    degraded = make_entitlement(admin, acme, pool, "b", concurrency=16)
    assert degraded.state == "Degraded"
    replicas = [{"url": "http://10.0.0.1:8000"}, {"url": "http://10.0.0.2:8000", "enabled": True}]
    response = root_client.patch("/api/v1/pools/llama/", {"replicas": replicas}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["usage"]["capacity"]["slots"] == 32
    assert root_client.get("/api/v1/entitlements/b/").json()["state"] == "Bound"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"slots_per_replica": 0}, "slots_per_replica"),
        ({"tokens_per_second_per_replica": -10}, "tokens_per_second_per_replica"),
        ({"kv_cache_gib_per_replica": "0"}, "kv_cache_gib_per_replica"),
        ({"backend_kind": "tpu"}, "backend_kind"),
        ({"replicas": [{"url": "nope"}]}, "replicas"),
        ({"min_replicas": 9}, "min_replicas"),
        ({"name": "Bad Name"}, "name"),
    ],
)
def test_bad_pool_input_is_a_400_with_field_errors(root_client: APIClient, changes: dict, field: str) -> None:
    response = root_client.post("/api/v1/pools/", {**POOL_BODY, **changes}, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert TokenPool.objects.count() == 0 and Replica.objects.count() == 0


def test_duplicate_pool_name_is_a_400(root_client: APIClient) -> None:
    assert root_client.post("/api/v1/pools/", POOL_BODY, format="json").status_code == 201
    response = root_client.post("/api/v1/pools/", POOL_BODY, format="json")
    assert response.status_code == 400 and "name" in response.json()


def test_pool_with_entitlements_cannot_be_deleted(root_client: APIClient, admin: Any, acme: Any, pool: Any) -> None:
    make_entitlement(admin, acme, pool, "a")
    response = root_client.delete("/api/v1/pools/qwen3-8b/")
    assert response.status_code == 400
    assert TokenPool.objects.filter(name="qwen3-8b").exists()


ENT_BODY = {"name": "acme-one", "tenant": "acme", "pool": "qwen3-8b", "service_class": "guaranteed",
            "slo_target_ms": 200, "tokens_per_second": 100, "kv_cache_gib": "2", "concurrency": 4}


def test_owner_creates_entitlement_and_sees_its_binding(owner: Any, pool: Any) -> None:
    client = client_as(owner)
    response = client.post("/api/v1/entitlements/", ENT_BODY, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["state"] == "Bound" and body["weight"] == 1000.0 and body["state_reason"]
    too_big = {**ENT_BODY, "name": "acme-two", "concurrency": 13}
    body = client.post("/api/v1/entitlements/", too_big, format="json").json()
    assert body["state"] == "Degraded" and "slots" in body["state_reason"]
    history = client.get("/api/v1/entitlements/acme-two/history/").json()["results"]
    assert [(h["from_state"], h["to_state"]) for h in history] == [("", "Pending"), ("Pending", "Degraded")]
    # Shrinking the first one's concurrency frees room: the update re-binds the pool.
    assert client.patch("/api/v1/entitlements/acme-one/", {"concurrency": 3}, format="json").status_code == 200
    assert client.get("/api/v1/entitlements/acme-two/").json()["state"] == "Bound"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"service_class": "gold"}, "service_class"),
        ({"pool": "missing-pool"}, "pool"),
        ({"tokens_per_second": 0}, "tokens_per_second"),
        ({"concurrency": -1}, "concurrency"),
        ({"kv_cache_gib": "-1"}, "kv_cache_gib"),
        ({"slo_target_ms": "soon"}, "slo_target_ms"),
        ({"tenant": "nobody"}, "tenant"),
    ],
)
def test_bad_entitlement_input_is_a_400(owner: Any, pool: Any, changes: dict, field: str) -> None:
    response = client_as(owner).post("/api/v1/entitlements/", {**ENT_BODY, **changes}, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert TokenEntitlement.objects.count() == 0 and EntitlementStateChange.objects.count() == 0


def test_duplicate_entitlement_name_is_a_400(owner: Any, pool: Any) -> None:
    client = client_as(owner)
    assert client.post("/api/v1/entitlements/", ENT_BODY, format="json").status_code == 201
    response = client.post("/api/v1/entitlements/", ENT_BODY, format="json")
    assert response.status_code == 400 and "name" in response.json()
    assert TokenEntitlement.objects.count() == 1


def test_entitlement_cannot_be_renamed_or_moved_between_tenants(owner: Any, pool: Any, globex: Any,
                                                                 admin: Any) -> None:
    client = client_as(owner)
    client.post("/api/v1/entitlements/", ENT_BODY, format="json")
    assert client.patch("/api/v1/entitlements/acme-one/", {"name": "other"}, format="json").status_code == 400
    su = client_as(admin)
    assert su.patch("/api/v1/entitlements/acme-one/", {"tenant": "globex"}, format="json").status_code == 400
    assert TokenEntitlement.objects.get().tenant.slug == "acme"


def test_filters_and_pagination(admin: Any, acme: Any, owner: Any, pool: Any) -> None:
    other = make_pool(admin, name="other")
    for i, cls in enumerate(["guaranteed", "elastic", "spot", "preemptible", "dedicated"]):
        make_entitlement(admin, acme, pool if i % 2 == 0 else other, f"e{i}", cls, concurrency=9)
    client = client_as(owner)

    def names(query: str) -> list[str]:
        return [r["name"] for r in client.get(f"/api/v1/entitlements/?{query}").json()["results"]]

    assert names("service_class=spot") == ["e2"]
    assert names("pool=other") == ["e1", "e3"]
    assert names("state=Degraded") == ["e4"]  # e0 and e4 each reserve 9 of the 16 slots
    assert names("state=Bound&pool=qwen3-8b") == ["e0", "e2"]
    page = client.get("/api/v1/entitlements/?limit=2&offset=2").json()
    assert page["count"] == 5 and [r["name"] for r in page["results"]] == ["e2", "e3"] and page["next"]
    assert client.get("/api/v1/entitlements/?state=Sleeping").status_code == 400
    assert client.get("/api/v1/entitlements/?service_class=gold").status_code == 400


def test_schema_and_its_ui_are_served(owner: Any) -> None:
    client = client_as(owner)
    schema = client.get("/api/schema/")
    assert schema.status_code == 200
    text = schema.content.decode()
    for path in ("/api/v1/entitlements/", "/api/v1/pools/", "/api/v1/keys/", "/api/v1/apply", "/api/v1/tenants/"):
        assert path in text
    assert "slo_target_ms" in text and "service_class" in text
    assert client.get("/api/schema/ui/").status_code == 200


def test_queue_fields_read_back_stored_and_effective(owner: Any, pool: Any) -> None:
    client = client_as(owner)
    body = client.post("/api/v1/entitlements/", ENT_BODY, format="json").json()
    # Blank: null as stored, the guaranteed class's default in effect
    assert (body["queue_max"], body["queue_max_wait_ms"]) == (None, None)
    assert body["queue_effective"] == {"max": 8, "max_wait_ms": 1000}
    changed = client.patch("/api/v1/entitlements/acme-one/", {"queue_max": 0, "queue_max_wait_ms": 600_000},
                           format="json")
    assert changed.status_code == 200, changed.json()
    body = client.get("/api/v1/entitlements/acme-one/").json()
    assert (body["queue_max"], body["queue_max_wait_ms"]) == (0, 600_000)
    assert body["queue_effective"] == {"max": 0, "max_wait_ms": 600_000}
    client.patch("/api/v1/entitlements/acme-one/", {"queue_max": None}, format="json")
    assert client.get("/api/v1/entitlements/acme-one/").json()["queue_effective"]["max"] == 8
    spot = client.post("/api/v1/entitlements/", {**ENT_BODY, "name": "acme-spot", "service_class": "spot"},
                       format="json").json()
    assert spot["queue_effective"] == {"max": 0, "max_wait_ms": 0}


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"queue_max": -1}, "queue_max", "0 or more"),
        ({"queue_max": 2.5}, "queue_max", "valid integer"),
        ({"queue_max": "many"}, "queue_max", "valid integer"),
        ({"queue_max": True}, "queue_max", "valid integer"),
        ({"queue_max_wait_ms": -1}, "queue_max_wait_ms", "from 0 to 600000 ms"),
        ({"queue_max_wait_ms": 600_001}, "queue_max_wait_ms", "from 0 to 600000 ms (10 minutes)"),
        ({"queue_max_wait_ms": 0.5}, "queue_max_wait_ms", "valid integer"),
    ],
)
def test_bad_queue_input_is_a_400_with_a_field_error(owner: Any, pool: Any, changes: dict, field: str,
                                                     words: str) -> None:
    client = client_as(owner)
    response = client.post("/api/v1/entitlements/", {**ENT_BODY, **changes}, format="json")
    assert response.status_code == 400
    assert words in " ".join(response.json()[field]), response.json()
    assert TokenEntitlement.objects.count() == 0
    assert client.post("/api/v1/entitlements/", ENT_BODY, format="json").status_code == 201
    patched = client.patch("/api/v1/entitlements/acme-one/", changes, format="json")
    assert patched.status_code == 400 and field in patched.json()
    assert TokenEntitlement.objects.get().queue_max is None
