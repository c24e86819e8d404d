from __future__ import annotations

from django.contrib import admin

from apps.gateway.models import UsageRecord


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    """Read-only: the gateway writes these; people only look."""

    list_display = ("minute", "tenant", "entitlement", "requests", "prompt_tokens", "completion_tokens", "rejected")
    list_filter = ("tenant",)
    search_fields = ("entitlement",)
    date_hierarchy = "minute"

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False
