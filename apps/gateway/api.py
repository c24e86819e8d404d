"""Read-only REST API over the gateway's usage records (per tenant, entitlement and minute).

Route it with ``router.register("usage", UsageRecordViewSet, basename="usage")`` in
tokenpools_site/api_urls.py. Records of other tenants do not exist for the caller.
"""

from __future__ import annotations

from typing import Any

import django_filters
from rest_framework import serializers, viewsets

from apps.gateway.models import UsageRecord
from apps.gateway.selectors import usage_record_list
from apps.tenancy.apiutils import UtcIsoDateTimeFilter


class UsageRecordSerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = UsageRecord
        fields = ["id", "tenant", "entitlement", "minute", "requests", "prompt_tokens", "completion_tokens",
                  "rejected"]
        read_only_fields = fields


class UsageRecordFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    since = UtcIsoDateTimeFilter(field_name="minute", lookup_expr="gte")
    until = UtcIsoDateTimeFilter(field_name="minute", lookup_expr="lt")

    class Meta:
        model = UsageRecord
        fields = ["tenant", "entitlement", "since", "until"]


class UsageRecordViewSet(viewsets.ReadOnlyModelViewSet):
    """Tokens and requests per tenant, entitlement and minute, as the gateway accounted them."""

    serializer_class = UsageRecordSerializer
    filterset_class = UsageRecordFilter

    def get_queryset(self) -> Any:
        return usage_record_list(user=self.request.user)
