"""``GET /api/v1/audit/`` (and ``/api/v1/audit/ID/``): the audit log, newest first, paginated and filtered like the other lists; read-only.
A tenant's owners see their tenants' entries, superusers all (``apps.audit.selectors.audit_entry_list``)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers, viewsets

from apps.audit.models import AuditEntry
from apps.audit.selectors import AuditEntryFilter, audit_entry_list


class AuditEntrySerializer(serializers.ModelSerializer):
    before = serializers.JSONField(allow_null=True, help_text="the audited fields before (changed ones on update)")
    after = serializers.JSONField(allow_null=True, help_text="the audited fields after (changed ones on update)")

    class Meta:
        model = AuditEntry
        fields = ["id", "at", "actor_id", "actor_username", "through", "kind", "object_id", "object_name",
                  "tenant_slug", "action", "before", "after"]
        read_only_fields = fields


class AuditEntryViewSet(viewsets.ReadOnlyModelViewSet):
    """Who changed which tenant, membership, user role, pool, replica, entitlement or key, when, through what
    (ui, api, apply, delete, prune, admin, command, system), with the fields before and after."""

    serializer_class = AuditEntrySerializer
    filterset_class = AuditEntryFilter

    def get_queryset(self) -> Any:
        return audit_entry_list(user=self.request.user)
