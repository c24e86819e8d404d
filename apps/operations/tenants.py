"""Tenant operations that reach into pools."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from apps.pools.selectors import pool_list_for_tenant
from apps.pools.services import money_quota_problem, pool_rebind
from apps.tenancy import services as tenancy_services
from apps.tenancy.actors import AnyUser
from apps.tenancy.models import Tenant
from apps.tenancy.permissions import require_superuser


def tenant_quota_check(tenant: Tenant) -> None:
    """A tenant's money quota must be priceable at the pools of all its entitlements."""
    problems = [problem for ent in tenant.entitlements.select_related("pool")
                if (problem := money_quota_problem(tenant, ent.pool, f"tenant {tenant.slug!r}"))]
    if problems:
        raise ValidationError({"quota_currency": sorted(set(problems))})


@transaction.atomic
def tenant_save(*, actor: AnyUser, tenant: Tenant | None = None, **fields: Any) -> Tenant:
    """Create (``tenant`` None) or change a tenant with `apps.tenancy.services`, then check its money quota
    against its entitlements' pools; nothing is written when it does not fit."""
    if tenant is None:
        saved = tenancy_services.tenant_create(actor=actor, **fields)
    else:
        saved = tenancy_services.tenant_update(actor=actor, tenant=tenant, **fields)
    tenant_quota_check(saved)
    return saved


@transaction.atomic
def tenant_delete(*, actor: AnyUser, tenant: Tenant) -> None:
    """Delete a tenant with its memberships, entitlements and keys (superusers only), then rebind the pools
    its entitlements held capacity in, so that the Degraded entitlements of other tenants can bind there."""
    require_superuser(actor, "delete tenants")
    pools = pool_list_for_tenant(tenant=tenant)  # before the cascade takes the entitlements away
    tenant.delete()
    for pool in pools:
        pool_rebind(pool=pool, reason=f"tenant {tenant.slug} deleted")
