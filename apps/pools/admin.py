"""Django admin (``/django-admin/``, superusers) for pools, replicas and entitlements.

Saving here goes around the services' forms but not around binding: every save re-evaluates the pool.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin

from apps.pools.models import EntitlementStateChange, Replica, TokenEntitlement, TokenPool
from apps.pools.services import pool_rebind


class ReplicaInline(admin.TabularInline):
    model = Replica
    extra = 0


@admin.register(TokenPool)
class TokenPoolAdmin(admin.ModelAdmin):
    list_display = ["name", "model_name", "backend_kind", "slots_per_replica", "tokens_per_second_per_replica",
                    "kv_cache_gib_per_replica", "bytes_per_token"]
    list_filter = ["backend_kind"]
    search_fields = ["name", "model_name"]
    readonly_fields = ["bytes_per_token", "created_at"]
    inlines = [ReplicaInline]

    def save_related(self, request: Any, form: Any, formsets: Any, change: bool) -> None:
        super().save_related(request, form, formsets, change)
        pool_rebind(pool=form.instance, reason="changed in the Django admin")


class StateChangeInline(admin.TabularInline):
    model = EntitlementStateChange
    extra = 0
    can_delete = False
    readonly_fields = ["from_state", "to_state", "reason", "at"]

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False


@admin.register(TokenEntitlement)
class TokenEntitlementAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "pool", "service_class", "tokens_per_second", "kv_cache_gib", "concurrency",
                    "state", "expires_at"]
    list_filter = ["state", "service_class", "pool", "tenant"]
    search_fields = ["name", "tenant__slug"]
    readonly_fields = ["state", "state_reason", "state_changed_at", "created_at", "updated_at"]
    inlines = [StateChangeInline]

    def save_model(self, request: Any, obj: Any, form: Any, change: bool) -> None:
        old_pool_id = TokenEntitlement.objects.filter(pk=obj.pk).values_list("pool_id", flat=True).first()
        super().save_model(request, obj, form, change)
        for pool in TokenPool.objects.filter(pk__in={obj.pool_id, old_pool_id} - {None}).order_by("pk"):
            pool_rebind(pool=pool, reason="changed in the Django admin")

    def delete_model(self, request: Any, obj: Any) -> None:
        pool = obj.pool
        super().delete_model(request, obj)
        pool_rebind(pool=pool, reason=f"entitlement {obj.name} deleted in the Django admin")
