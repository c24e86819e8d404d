"""Reads for tenants, memberships and API keys, always scoped to the user asking.

Every selector takes the ``user`` it answers for: a superuser sees everything, anyone else only the
tenants they belong to. ``*_get`` selectors raise ``Http404`` for objects outside the user's scope, so
that other tenants' objects are indistinguishable from missing ones (both DRF and plain views turn it
into a 404).
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.http import Http404
from django.utils import timezone

from apps.tenancy.actors import AnyUser
from apps.tenancy.models import ApiKey, Membership, Role, Tenant


def _is_superuser(user: AnyUser) -> bool:
    return bool(getattr(user, "is_active", False) and getattr(user, "is_superuser", False))


def tenant_list(*, user: AnyUser) -> QuerySet[Tenant]:
    """Tenants the user may see: all for superusers, else the ones they hold a role in."""
    if _is_superuser(user):
        return Tenant.objects.all()
    if not getattr(user, "is_authenticated", False):
        return Tenant.objects.none()
    # Past both checks only a login is left (SYSTEM is a superuser, the anonymous user is not authenticated).
    assert isinstance(user, get_user_model())
    return Tenant.objects.filter(memberships__user=user).distinct()


def tenant_get(*, user: AnyUser, slug: str) -> Tenant:
    """One visible tenant by slug; ``Http404`` if missing or not the user's."""
    try:
        return tenant_list(user=user).get(slug=slug)
    except Tenant.DoesNotExist as exc:
        raise Http404(f"no tenant {slug!r}") from exc


def user_role(*, user: AnyUser, tenant: Tenant) -> str | None:
    """The user's role in the tenant: ``"owner"``, ``"member"`` or None (superusers count as owners)."""
    if _is_superuser(user):
        return str(Role.OWNER)
    if not getattr(user, "is_authenticated", False):
        return None
    # Past both checks only a login is left (SYSTEM is a superuser, the anonymous user is not authenticated).
    assert isinstance(user, get_user_model())
    return Membership.objects.filter(tenant=tenant, user=user).values_list("role", flat=True).first()


def user_is_owner(*, user: AnyUser, tenant: Tenant) -> bool:
    return user_role(user=user, tenant=tenant) == Role.OWNER


def owned_tenant_ids(*, user: AnyUser) -> set[int]:
    """Ids of tenants the user owns (all tenants for a superuser)."""
    if _is_superuser(user):
        return set(Tenant.objects.values_list("id", flat=True))
    if not getattr(user, "is_authenticated", False):
        return set()
    # Past both checks only a login is left (SYSTEM is a superuser, the anonymous user is not authenticated).
    assert isinstance(user, get_user_model())
    return set(Membership.objects.filter(user=user, role=Role.OWNER).values_list("tenant_id", flat=True))


def membership_list(*, user: AnyUser, tenant: Tenant | None = None) -> QuerySet[Membership]:
    """Memberships of the tenants the user may see (optionally one tenant)."""
    qs = Membership.objects.select_related("tenant", "user").filter(tenant__in=tenant_list(user=user))
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    return qs


def membership_get(*, user: AnyUser, membership_id: int | str) -> Membership:
    try:
        return membership_list(user=user).get(pk=membership_id)
    except (Membership.DoesNotExist, ValueError, TypeError) as exc:
        raise Http404("no such membership") from exc


def user_list(*, user: AnyUser) -> QuerySet:
    """Users visible to the user: everyone for superusers, else the people sharing one of their tenants."""
    User = get_user_model()
    if _is_superuser(user):
        return User.objects.all().order_by("username")
    if not getattr(user, "is_authenticated", False):
        return User.objects.none()
    return User.objects.filter(memberships__tenant__in=tenant_list(user=user)).distinct().order_by("username")


def user_private_fields_visible(*, user: AnyUser, other: Any) -> bool:
    """Whether `user` may read `other`'s email and superuser flag: their own record, or a site operator
    (active superuser or staff). A tenant owner sees only the usernames of the people in their tenants: adding
    a username to a tenant must not reveal who that login is or what it may do elsewhere."""
    if getattr(user, "pk", None) is not None and user.pk == getattr(other, "pk", None):
        return True
    return bool(getattr(user, "is_active", False)
                and (getattr(user, "is_superuser", False) or getattr(user, "is_staff", False)))


def user_get(*, user: AnyUser, user_id: int | str) -> Any:
    User = get_user_model()
    try:
        return user_list(user=user).get(pk=user_id)
    except (User.DoesNotExist, ValueError, TypeError) as exc:
        raise Http404("no such user") from exc


def apikey_list(
    *,
    user: AnyUser,
    tenant: Tenant | None = None,
    entitlement: Any = None,
    include_revoked: bool = True,
) -> QuerySet[ApiKey]:
    """API keys of the tenants the user may see, newest first (members see all keys of their tenant)."""
    qs = ApiKey.objects.select_related("tenant", "entitlement", "entitlement__pool", "created_by").filter(
        tenant__in=tenant_list(user=user)
    )
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    if entitlement is not None:
        qs = qs.filter(entitlement=entitlement)
    if not include_revoked:
        qs = qs.filter(revoked_at__isnull=True)
    return qs


def apikey_get(*, user: AnyUser, key_id: int | str, include_revoked: bool = True) -> ApiKey:
    """One visible key; ``Http404`` if missing, not the user's, or revoked while ``include_revoked`` is False."""
    try:
        return apikey_list(user=user, include_revoked=include_revoked).get(pk=key_id)
    except (ApiKey.DoesNotExist, ValueError, TypeError) as exc:
        raise Http404("no such API key") from exc


def apikey_hash(secret: str) -> str:
    """SHA-256 hex digest of a key's secret (what is stored and looked up)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def apikey_resolve(*, secret: str, now: datetime | None = None) -> ApiKey | None:
    """The gateway's lookup: the active key for a presented secret, or None.

    Returns None for unknown, revoked and expired keys. The key comes with its entitlement, the
    entitlement's pool and the tenant loaded. The lookup goes by the digest (an index hit that tells an
    attacker nothing about the secret) and the digests are compared once more with ``hmac.compare_digest``.
    The entitlement's own state (Bound, Degraded, Expired) is for the caller to judge.
    """
    if not isinstance(secret, str) or not secret:
        return None
    digest = apikey_hash(secret)
    key = (
        ApiKey.objects.select_related("tenant", "entitlement", "entitlement__pool", "entitlement__tenant")
        .filter(secret_hash=digest)
        .first()
    )
    if key is None or not hmac.compare_digest(key.secret_hash, digest):
        return None
    if not key.is_active(now or timezone.now()):
        return None
    return key
