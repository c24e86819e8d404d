"""The Django admin stays available to superusers and keeps binding consistent."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.pools.models import EntitlementState, TokenEntitlement
from apps.tenancy.services import apikey_create
from tests.pools.factories import make_entitlement
from tests.pools.test_api_isolation import client_as


@pytest.fixture
def admin_client_logged_in(admin: Any) -> Client:
    client = Client()
    client.force_login(admin)
    return client


@pytest.mark.django_db
def test_admin_pages_render_for_superusers(admin_client_logged_in: Client, admin: Any, acme: Any, pool: Any,
                                           owner: Any) -> None:
    ent = make_entitlement(admin, acme, pool, "acme-g")
    key, _ = apikey_create(actor=admin, entitlement=ent)
    for url in ("tenancy/tenant/", f"tenancy/tenant/{acme.pk}/change/", "tenancy/membership/", "tenancy/apikey/",
                f"tenancy/apikey/{key.pk}/change/", "pools/tokenpool/", f"pools/tokenpool/{pool.pk}/change/",
                "pools/tokenentitlement/", f"pools/tokenentitlement/{ent.pk}/change/"):
        response = admin_client_logged_in.get(f"/django-admin/{url}")
        assert response.status_code == 200, url
    assert key.secret_hash not in admin_client_logged_in.get(f"/django-admin/tenancy/apikey/{key.pk}/change/").content.decode()
    outsider = Client()
    outsider.force_login(owner)
    assert outsider.get("/django-admin/pools/tokenpool/").status_code == 302  # to the admin login


@pytest.mark.django_db
def test_admin_save_rebinds_the_pool(admin_client_logged_in: Client, admin: Any, acme: Any, pool: Any) -> None:
    make_entitlement(admin, acme, pool, "a", concurrency=16)
    b = make_entitlement(admin, acme, pool, "b", concurrency=4)
    assert b.state == "Degraded"
    url = f"/django-admin/pools/tokenentitlement/{b.pk}/change/"
    form = {
        "name": "b", "tenant": acme.pk, "pool": pool.pk, "service_class": "spot", "slo_target_ms": 200,
        "tokens_per_second": 100, "kv_cache_gib": "2", "concurrency": 4, "created_at": "",
        "state_changes-TOTAL_FORMS": 0, "state_changes-INITIAL_FORMS": 0,
        "api_keys-TOTAL_FORMS": 0, "api_keys-INITIAL_FORMS": 0,
    }
    response = admin_client_logged_in.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]
    b.refresh_from_db()
    assert (b.service_class, b.state) == ("spot", "Bound")


@pytest.mark.api
@pytest.mark.django_db
def test_api_shows_past_expiry_as_expired_before_the_tick(admin: Any, acme: Any, owner: Any, pool: Any) -> None:
    ent = make_entitlement(admin, acme, pool, "short", expires_at=timezone.now() + timedelta(hours=1))
    TokenEntitlement.objects.filter(pk=ent.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert TokenEntitlement.objects.get(pk=ent.pk).state == EntitlementState.BOUND
    body = client_as(owner).get("/api/v1/entitlements/short/").json()
    assert body["state"] == "Expired" and "expired at" in body["state_reason"]
    assert client_as(owner).get("/api/v1/entitlements/?state=Bound").json()["count"] == 0
    assert client_as(owner).get("/api/v1/entitlements/?state=Expired").json()["count"] == 1


@pytest.mark.django_db
def test_tenants_cannot_be_deleted_in_the_admin(admin_client_logged_in: Client, acme: Any) -> None:
    # Deleting a tenant must rebind its pools (apps.operations.tenants): the UI and the REST API do it.
    response = admin_client_logged_in.post(f"/django-admin/tenancy/tenant/{acme.pk}/delete/", {"post": "yes"})
    assert response.status_code == 403
    assert type(acme).objects.filter(pk=acme.pk).exists()
