"""Deleting a tenant spans tenancy and pools: its rows go, then the pools it held capacity in rebind."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import PermissionDenied

from apps.operations.tenants import tenant_delete
from apps.pools.models import EntitlementStateChange, TokenEntitlement
from apps.tenancy.models import ApiKey, Membership, Tenant
from apps.tenancy.services import apikey_create
from tests.pools.factories import make_entitlement, make_pool
from tests.pools.test_api_isolation import client_as


@pytest.mark.django_db
def test_deleting_a_tenant_frees_its_reservations(admin: Any, acme: Any, globex: Any, pool: Any) -> None:
    make_entitlement(admin, acme, pool, "acme-big", concurrency=16)
    waiting = make_entitlement(admin, globex, pool, "globex-wait", concurrency=4)
    assert waiting.state == "Degraded"
    tenant_delete(actor=admin, tenant=acme)
    waiting.refresh_from_db()
    assert waiting.state == "Bound"
    assert not Tenant.objects.filter(slug="acme").exists()
    assert TokenEntitlement.objects.count() == 1
    change = EntitlementStateChange.objects.filter(entitlement=waiting).order_by("at", "id").last()
    assert change is not None and "tenant acme deleted" in change.reason


@pytest.mark.django_db
def test_only_superusers_delete_tenants_and_a_refusal_changes_nothing(
    admin: Any, acme: Any, owner: Any, pool: Any
) -> None:
    ent = make_entitlement(admin, acme, pool, "acme-small")
    apikey_create(actor=owner, entitlement=ent)
    with pytest.raises(PermissionDenied, match="only platform operators"):
        tenant_delete(actor=owner, tenant=acme)
    assert Tenant.objects.filter(slug="acme").exists()
    assert (TokenEntitlement.objects.count(), ApiKey.objects.count()) == (1, 1)
    assert Membership.objects.filter(tenant=acme, user=owner).exists()


@pytest.mark.api
@pytest.mark.django_db
def test_the_rest_delete_rebinds_every_pool_the_tenant_held(admin: Any, acme: Any, globex: Any) -> None:
    first, second = make_pool(admin, "first"), make_pool(admin, "second")
    for pool in (first, second):
        make_entitlement(admin, acme, pool, f"acme-{pool.name}", concurrency=16)
    waiting = [make_entitlement(admin, globex, pool, f"globex-{pool.name}", concurrency=4)
               for pool in (first, second)]
    assert {ent.state for ent in waiting} == {"Degraded"}
    response = client_as(admin).delete("/api/v1/tenants/acme/")
    assert response.status_code == 204, response.content
    for ent in waiting:
        ent.refresh_from_db()
    assert {ent.state for ent in waiting} == {"Bound"}
