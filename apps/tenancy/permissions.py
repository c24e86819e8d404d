"""Who may do what: the rule checks the services call, and DRF permission classes for the REST API.

The `require_*` checks raise `django.core.exceptions.PermissionDenied` (403); every service of tenancy
and pools calls them before it writes, with the role rules documented in `apps.tenancy.models`.
Everything tenant-scoped is decided by the services (403) and the selectors (404); the DRF classes only
refuse early what no tenant user may do at all, before any input is parsed.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from rest_framework.permissions import SAFE_METHODS, BasePermission

from apps.tenancy.actors import AnyUser
from apps.tenancy.models import ApiKey, Role, Tenant
from apps.tenancy.selectors import user_role

# --- rule checks of the services ---------------------------------------------------------------------


def require_superuser(actor: AnyUser, action: str) -> None:
    if not (getattr(actor, "is_active", False) and getattr(actor, "is_superuser", False)):
        raise PermissionDenied(f"only platform operators (superusers) may {action}")


def require_owner(actor: AnyUser, tenant: Tenant, action: str) -> None:
    """Owners of the tenant (and superusers, who count as owners of every tenant)."""
    if user_role(user=actor, tenant=tenant) != Role.OWNER:
        raise PermissionDenied(f"only owners of tenant {tenant.slug!r} may {action}")


def require_member(actor: AnyUser, tenant: Tenant, action: str) -> None:
    """Owners and members of the tenant (and superusers)."""
    if user_role(user=actor, tenant=tenant) is None:
        raise PermissionDenied(f"only users of tenant {tenant.slug!r} may {action}")


def require_key_revoker(actor: AnyUser, key: ApiKey) -> None:
    """Owners revoke any key of their tenant (superusers any key); members only the keys they created."""
    role = user_role(user=actor, tenant=key.tenant)
    if role is None:
        raise PermissionDenied("not your key")
    if role != Role.OWNER and key.created_by_id != getattr(actor, "pk", None):
        raise PermissionDenied("members may only revoke the keys they created")


# --- DRF permission classes --------------------------------------------------------------------------


def _is_operator(request: Any) -> bool:
    user = request.user
    return bool(user and user.is_authenticated and user.is_active and user.is_superuser)


class SuperuserOrReadOnly(BasePermission):
    """Any signed-in user reads; only superusers write (pools)."""

    message = "only platform operators (superusers) may change this"

    def has_permission(self, request: Any, view: Any) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        return request.method in SAFE_METHODS or _is_operator(request)


class SuperuserCreates(BasePermission):
    """Only superusers use the collection's create (tenants, users); object rights are the services'."""

    message = "only platform operators (superusers) may create this"

    def has_permission(self, request: Any, view: Any) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        return getattr(view, "action", None) != "create" or _is_operator(request)
