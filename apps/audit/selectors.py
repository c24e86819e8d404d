"""Reads of the audit log: superusers see every entry, a tenant's owners their tenants' entries, others none."""

from __future__ import annotations

import django_filters
from django.db.models import QuerySet

from apps.audit.context import CHANNELS
from apps.audit.models import Action, AuditEntry
from apps.audit.recorder import SPECS, USER_SPEC
from apps.tenancy.actors import AnyUser
from apps.tenancy.apiutils import UtcIsoDateTimeFilter
from apps.tenancy.selectors import owned_tenant_ids

KINDS = sorted({spec.kind for spec in SPECS.values()} | {USER_SPEC.kind})


def audit_entry_list(*, user: AnyUser) -> QuerySet[AuditEntry]:
    """Newest first. Platform objects (pools, replicas, users) carry no tenant: superusers alone see them."""
    if getattr(user, "is_active", False) and getattr(user, "is_superuser", False):
        return AuditEntry.objects.all()
    return AuditEntry.objects.filter(tenant_id__in=owned_tenant_ids(user=user))


class AuditEntryFilter(django_filters.FilterSet):
    """The filters of the REST list and of the UI page."""

    kind = django_filters.ChoiceFilter(choices=[(k, k) for k in KINDS], help_text="the object's kind")
    object = django_filters.CharFilter(field_name="object_name", help_text="the object's name (exact)")
    actor = django_filters.CharFilter(field_name="actor_username", help_text="who acted: a username, or system")
    tenant = django_filters.CharFilter(field_name="tenant_slug", help_text="the object's tenant (slug)")
    through = django_filters.ChoiceFilter(choices=[(c, c) for c in CHANNELS], help_text="the way in")
    action = django_filters.ChoiceFilter(choices=Action.choices)
    since = UtcIsoDateTimeFilter(field_name="at", lookup_expr="gte", help_text="entries at or after (ISO 8601)")

    class Meta:
        model = AuditEntry
        fields = ["kind", "object", "actor", "tenant", "through", "action", "since"]
