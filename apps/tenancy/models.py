"""Tenants, the users' roles in them, and API keys (hashed at rest).

Roles (decided here, enforced in ``apps.tenancy.permissions`` and the services):

* superuser: operates the platform; sees and changes everything, alone manages pools, tenants and users.
* owner of a tenant: reads the tenant's objects; creates, edits and deletes its entitlements; creates and
  revokes any of its API keys; adds, changes and removes its memberships.
* member of a tenant: reads the tenant's objects; may create API keys for the tenant's entitlements
  (a member needs a key to call the gateway) and revoke the keys they created themselves, nothing else.
* anyone else: the tenant's objects do not exist for them (404).
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from apps.tenancy.quota import QuotaFields

slug_validator = RegexValidator(
    r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
    "Use lowercase letters, digits and inner hyphens (DNS label style, at most 63 characters).",
)


class Tenant(QuotaFields, models.Model):
    """A customer of the platform. Its quota (`QuotaFields`), if any, is shared by all its entitlements."""

    name = models.CharField(max_length=200)
    slug = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    # Moves on every save: the gateways reload their snapshot when a tenant's quota changes.
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    MEMBER = "member", "Member"


class Membership(models.Model):
    """A user's role in one tenant (a user may belong to several tenants)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["tenant__slug", "user__username"]
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="tenancy_membership_unique")]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


class ApiKey(models.Model):
    """A secret that lets a client call the gateway for one entitlement of one tenant.

    The secret itself is never stored: only its SHA-256 hex digest (looked up by the gateway) and a short
    display prefix so people can tell their keys apart.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    entitlement = models.ForeignKey("pools.TokenEntitlement", on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200, blank=True, default="")
    prefix = models.CharField(max_length=32, db_index=True)
    secret_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="api_keys"
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.entitlement_id})"

    def is_active(self, now: datetime | None = None) -> bool:
        now = now or timezone.now()
        if self.revoked_at is not None:
            return False
        return not (self.expires_at is not None and self.expires_at <= now)

    @property
    def status(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"
