"""Writes for tenants, memberships, users and API keys.

Every service takes the acting user as ``actor`` and checks the role rules documented in
``apps.tenancy.models`` (the checks live in ``apps.tenancy.permissions``). Failures raise ``django.core.exceptions.ValidationError`` (with a field ->
messages dict) for bad input and ``django.core.exceptions.PermissionDenied`` for a forbidden action;
nothing is written in either case (each service runs in one transaction).

Deleting a tenant also rebinds the pools its entitlements held capacity in, so it spans tenancy and pools
and lives one layer above both: ``apps.pools.services.tenant_delete``.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

# SYSTEM and SystemActor live in apps.tenancy.actors; re-exported here, where commands and tests import them.
from apps.tenancy.actors import SYSTEM as SYSTEM
from apps.tenancy.actors import AnyUser
from apps.tenancy.actors import SystemActor as SystemActor
from apps.tenancy.models import ApiKey, Membership, Role, Tenant
from apps.tenancy.permissions import require_key_revoker, require_member, require_owner, require_superuser
from apps.tenancy.selectors import apikey_hash

KEY_PREFIX = "tp-"
# How many characters of the secret (after "tp-") are kept to show the key in lists.
DISPLAY_PREFIX_CHARS = 8


def _full_clean(obj: Any, exclude: list[str] | None = None) -> None:
    obj.full_clean(exclude=exclude)


# --- tenants -----------------------------------------------------------------------------------------


TENANT_QUOTA_FIELDS = ("quota_tokens", "quota_amount", "quota_currency", "quota_window", "quota_timezone",
                       "quota_on_exceeded")


def _unknown_quota_fields(quota: dict[str, Any]) -> None:
    unknown = set(quota) - set(TENANT_QUOTA_FIELDS)
    if unknown:
        raise ValidationError({name: ["unknown or read-only field"] for name in sorted(unknown)})


@transaction.atomic
def tenant_create(*, actor: AnyUser, name: str, slug: str, **quota: Any) -> Tenant:
    """Create a tenant (superusers only), with its quota (``TENANT_QUOTA_FIELDS``) if given. Raises
    ValidationError on a bad or duplicate slug or a bad quota. A money quota must also be priceable at the
    pools of the tenant's entitlements: `apps.operations.tenants.tenant_save` checks that."""
    require_superuser(actor, "create tenants")
    _unknown_quota_fields(quota)
    tenant = Tenant(name=name, slug=slug, **quota)
    _full_clean(tenant)
    tenant.save()
    return tenant


@transaction.atomic
def tenant_update(*, actor: AnyUser, tenant: Tenant, name: str | None = None, slug: str | None = None,
                  **quota: Any) -> Tenant:
    """Rename a tenant, change its slug or its quota (superusers only)."""
    require_superuser(actor, "change tenants")
    _unknown_quota_fields(quota)
    if name is not None:
        tenant.name = name
    if slug is not None:
        tenant.slug = slug
    for field, value in quota.items():
        setattr(tenant, field, value)
    _full_clean(tenant)
    tenant.save()
    return tenant


# --- users and memberships ---------------------------------------------------------------------------


@transaction.atomic
def user_create(
    *, actor: AnyUser, username: str, password: str | None, email: str = "", is_superuser: bool = False
) -> Any:
    """Create a login (superusers only). ``password=None`` creates a user who cannot log in by password."""
    require_superuser(actor, "create users")
    User = get_user_model()
    user = User(username=username, email=email, is_superuser=is_superuser, is_staff=is_superuser)
    if password:
        from django.contrib.auth.password_validation import validate_password

        try:
            validate_password(password, user)
        except ValidationError as exc:
            raise ValidationError({"password": exc.messages}) from exc
        user.set_password(password)
    else:
        user.set_unusable_password()
    _full_clean(user, exclude=["password"])
    user.save()
    return user


@transaction.atomic
def membership_set(*, actor: AnyUser, tenant: Tenant, user: Any, role: str) -> Membership:
    """Give ``user`` the ``role`` in ``tenant`` (creating or changing the membership); owners and superusers."""
    require_owner(actor, tenant, "manage memberships")
    if role not in Role.values:
        raise ValidationError({"role": [f"unknown role {role!r}; choose one of {', '.join(Role.values)}"]})
    membership, created = Membership.objects.select_for_update().get_or_create(
        tenant=tenant, user=user, defaults={"role": role}
    )
    if not created and membership.role != role:
        _forbid_removing_last_owner(membership, new_role=role)
        membership.role = role
        membership.save(update_fields=["role"])
    return membership


def _forbid_removing_last_owner(membership: Membership, new_role: str | None) -> None:
    if membership.role != Role.OWNER or new_role == Role.OWNER:
        return
    other_owners = Membership.objects.filter(tenant=membership.tenant, role=Role.OWNER).exclude(pk=membership.pk)
    if not other_owners.exists():
        raise ValidationError({"role": [f"tenant {membership.tenant.slug!r} must keep at least one owner"]})


@transaction.atomic
def membership_remove(*, actor: AnyUser, membership: Membership) -> None:
    """Remove a user's role in a tenant (owners and superusers); the last owner cannot be removed."""
    require_owner(actor, membership.tenant, "manage memberships")
    if not getattr(actor, "is_superuser", False):
        _forbid_removing_last_owner(membership, new_role=None)
    membership.delete()


# --- API keys ----------------------------------------------------------------------------------------


def _new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@transaction.atomic
def apikey_create(
    *,
    actor: AnyUser,
    entitlement: Any,
    name: str = "",
    expires_at: datetime | None = None,
    now: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for an entitlement and return ``(key, secret)``; the secret is never retrievable again.

    Owners and members of the entitlement's tenant (and superusers) may create keys.
    """
    tenant = entitlement.tenant
    require_member(actor, tenant, "create its keys")
    now = now or timezone.now()
    if expires_at is not None and expires_at <= now:
        raise ValidationError({"expires_at": ["must be in the future"]})
    if len(name or "") > 200:
        raise ValidationError({"name": ["at most 200 characters"]})
    created_by = actor if getattr(actor, "pk", None) else None
    # Only saved logins have a pk (SYSTEM and the anonymous user have none): a row of the user model.
    assert created_by is None or isinstance(created_by, get_user_model())
    for _attempt in range(5):
        secret = _new_secret()
        key = ApiKey(
            tenant=tenant,
            entitlement=entitlement,
            name=name or "",
            prefix=secret[: len(KEY_PREFIX) + DISPLAY_PREFIX_CHARS],
            secret_hash=apikey_hash(secret),
            created_by=created_by,
            created_at=now,
            expires_at=expires_at,
        )
        try:
            with transaction.atomic():
                key.save()
        except IntegrityError:  # a digest collision of 256 random bits: practically never, try again
            continue
        return key, secret
    raise RuntimeError("could not generate a unique API key")


@transaction.atomic
def apikey_revoke(*, actor: AnyUser, key: ApiKey, now: datetime | None = None) -> ApiKey:
    """Revoke a key (owners and superusers; members only the keys they created). Revoking twice is a no-op."""
    require_key_revoker(actor, key)
    if key.revoked_at is None:
        key.revoked_at = now or timezone.now()
        key.save(update_fields=["revoked_at"])
    return key


# The longest a replaced secret may stay valid after a rotation.
MAX_ROTATION_GRACE_S = 30 * 86400
DEFAULT_ROTATION_GRACE_S = 86400


def apikey_rotate(*, actor: AnyUser, key: ApiKey, grace_s: int = DEFAULT_ROTATION_GRACE_S,
                  now: datetime | None = None) -> tuple[ApiKey, str]:
    """A new secret for the key's entitlement, with its name and expiry, returned as ``(new key, secret)``
    (shown once); the replaced key stays valid for `grace_s` seconds (0: revoked at once) so that clients can
    move over. Whoever may revoke the key may rotate it; a revoked or expired key cannot be."""
    require_key_revoker(actor, key)
    now = now or timezone.now()
    if isinstance(grace_s, bool) or not isinstance(grace_s, int) or not 0 <= grace_s <= MAX_ROTATION_GRACE_S:
        raise ValidationError({"grace_period_s": [f"must be a whole number of seconds from 0 to {MAX_ROTATION_GRACE_S}"]})
    if not key.is_active(now):
        raise ValidationError({"key": [f"a {key.status} key cannot be rotated; create a new one"]})
    with transaction.atomic():
        new_key, secret = apikey_create(actor=actor, entitlement=key.entitlement, name=key.name,
                                        expires_at=key.expires_at, now=now)
        if grace_s == 0:
            key.revoked_at = now
            key.save(update_fields=["revoked_at"])
        else:
            until = now + timedelta(seconds=grace_s)
            key.expires_at = until if key.expires_at is None else min(key.expires_at, until)
            key.save(update_fields=["expires_at"])
    return new_key, secret


def apikey_mark_used(*, key: ApiKey, now: datetime | None = None) -> None:
    """Record that the gateway accepted the key (one UPDATE, no read)."""
    when = now or timezone.now()
    ApiKey.objects.filter(pk=key.pk).update(last_used_at=when)
    key.last_used_at = when


def apikeys_mark_used(*, used_at: dict[int, datetime]) -> int:
    """The gateway's batch of keys it accepted, with when it last did: each key's `last_used_at` moves forward
    only (several gateway processes flush in any order). Returns how many keys were updated."""
    updated = 0
    with transaction.atomic():
        for key_id, when in used_at.items():
            updated += ApiKey.objects.filter(pk=key_id).filter(
                Q(last_used_at__isnull=True) | Q(last_used_at__lt=when)).update(last_used_at=when)
    return updated
