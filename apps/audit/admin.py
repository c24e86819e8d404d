"""The audit log in the Django admin: read only (entries are written by the recorder, never by hand)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin

from apps.audit.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ["at", "actor_username", "through", "action", "kind", "object_name", "tenant_slug"]
    list_filter = ["through", "action", "kind"]
    search_fields = ["object_name", "actor_username", "tenant_slug"]

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False
