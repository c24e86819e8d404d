"""Tenant operations that reach into pools."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from apps.pools.services import money_quota_problem, tenant_delete
from apps.tenancy import services as tenancy_services
from apps.tenancy.actors import AnyUser
from apps.tenancy.models import Tenant


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


__all__ = ["tenant_delete", "tenant_quota_check", "tenant_save"]
