"""Tenant operations that reach into pools."""

from __future__ import annotations

from django.db import transaction

from apps.pools.selectors import pool_list_for_tenant
from apps.pools.services import pool_rebind
from apps.tenancy.actors import AnyUser
from apps.tenancy.models import Tenant
from apps.tenancy.permissions import require_superuser


@transaction.atomic
def tenant_delete(*, actor: AnyUser, tenant: Tenant) -> None:
    """Delete a tenant with its memberships, entitlements and keys (superusers only), then rebind the pools
    its entitlements held capacity in, so that the Degraded entitlements of other tenants can bind there."""
    require_superuser(actor, "delete tenants")
    pools = pool_list_for_tenant(tenant=tenant)  # before the cascade takes the entitlements away
    tenant.delete()
    for pool in pools:
        pool_rebind(pool=pool, reason=f"tenant {tenant.slug} deleted")
