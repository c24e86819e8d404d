"""Django admin (``/django-admin/``, superusers) for tenants, memberships and API keys.

Tenants are deleted through the UI or the REST API (which rebind their pools), not here. Keys are created through the API, the UI or ``manage.py create_key`` (the secret must be shown once);
here they can only be inspected and revoked.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.utils import timezone

from apps.tenancy.models import ApiKey, Membership, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created_at"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        # Deleting a tenant frees the capacity its entitlements reserved, so the pools must be rebound in the
        # same operation (apps.pools.services.tenant_delete): the UI and the REST API do that; a bare
        # admin delete would leave other entitlements Degraded for no reason.
        return False


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["tenant", "user", "role", "created_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__slug"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "tenant", "entitlement", "status", "created_at", "expires_at", "revoked_at",
                    "last_used_at"]
    list_filter = ["tenant"]
    search_fields = ["prefix", "name", "entitlement__name"]
    readonly_fields = ["tenant", "entitlement", "prefix", "created_by", "created_at", "last_used_at", "revoked_at"]
    exclude = ["secret_hash"]
    actions = ["revoke"]

    def has_add_permission(self, request: Any) -> bool:
        return False

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: Any, queryset: Any) -> None:
        # One save per key, not QuerySet.update(): each revocation is recorded in the audit log.
        now = timezone.now()
        for key in queryset.filter(revoked_at__isnull=True):
            key.revoked_at = now
            key.save(update_fields=["revoked_at"])
