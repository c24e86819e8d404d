"""Read-only REST API over the gateway's usage records (per tenant, entitlement and minute).

Route it with ``router.register("usage", UsageRecordViewSet, basename="usage")`` in
tokenpools_site/api_urls.py. Records of other tenants do not exist for the caller.
"""

from __future__ import annotations

from typing import Any

import django_filters
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from apps.gateway.models import UsageRecord
from apps.gateway.selectors import usage_record_list, usage_spend_summary
from apps.tenancy.apiutils import UtcIsoDateTimeFilter


class UsageRecordSerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = UsageRecord
        fields = ["id", "tenant", "entitlement", "service_tier", "minute", "requests", "prompt_tokens",
                  "completion_tokens", "rejected"]
        read_only_fields = fields


class UsageRecordFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    since = UtcIsoDateTimeFilter(field_name="minute", lookup_expr="gte")
    until = UtcIsoDateTimeFilter(field_name="minute", lookup_expr="lt")

    class Meta:
        model = UsageRecord
        fields = ["tenant", "entitlement", "service_tier", "since", "until"]


class UsageRecordViewSet(viewsets.ReadOnlyModelViewSet):
    """Tokens and requests per tenant, entitlement and minute, as the gateway accounted them."""

    serializer_class = UsageRecordSerializer
    filterset_class = UsageRecordFilter

    def get_queryset(self) -> Any:
        return usage_record_list(user=self.request.user)

    @extend_schema(
        parameters=[OpenApiParameter("period", str, enum=["day", "month"], description="group by UTC day or month")],
        responses=inline_serializer("UsageSummaryRow", {
            "tenant": serializers.CharField(), "entitlement": serializers.CharField(),
            "service_tier": serializers.CharField(help_text="the class that served these tokens"),
            "period": serializers.CharField(help_text="YYYY-MM-DD or YYYY-MM (UTC)"),
            "requests": serializers.IntegerField(), "prompt_tokens": serializers.IntegerField(),
            "completion_tokens": serializers.IntegerField(), "rejected": serializers.IntegerField(),
            "spend": serializers.DictField(allow_null=True, help_text="{amount, currency} at the pool's prices"),
        }, many=True),
    )
    @action(detail=False, methods=["get"], pagination_class=None)
    def summary(self, request: Request) -> Response:
        """Tokens and spend per tenant, entitlement, served tier and day or month (the same filters as the list)."""
        period = request.query_params.get("period", "day")
        if period not in ("day", "month"):
            raise ValidationError({"period": [f"must be day or month, got {period!r}"]})
        records = self.filter_queryset(self.get_queryset())
        return Response(usage_spend_summary(user=request.user, period=period, filters=records))
