"""Read-only REST API over the gateway's usage records (per tenant, entitlement and minute) and its request
log (one record per request decided).

Routed in tokenpools_site/api_urls.py (``usage``, ``requests``). Records of other tenants do not exist for
the caller.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import django_filters
from django.http import Http404, StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, renderers, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from apps.gateway.models import RequestLogRecord, RequestOutcome, UsageRecord
from apps.gateway.selectors import request_log_list, usage_record_list, usage_spend_summary
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


class RequestLogSerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = RequestLogRecord
        fields = ["request_id", "arrived_at", "tenant", "pool", "entitlement", "service_class", "service_tier",
                  "stream", "prompt_tokens", "max_tokens", "completion_tokens", "outcome", "reason", "queue_ms",
                  "ttft_ms", "duration_ms"]
        read_only_fields = fields


class RequestLogFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    since = UtcIsoDateTimeFilter(field_name="arrived_at", lookup_expr="gte")
    until = UtcIsoDateTimeFilter(field_name="arrived_at", lookup_expr="lt")
    outcome = django_filters.ChoiceFilter(choices=RequestOutcome.choices)

    class Meta:
        model = RequestLogRecord
        fields = ["tenant", "pool", "entitlement", "outcome", "reason", "service_tier", "since", "until"]


class JsonLinesRenderer(renderers.BaseRenderer):
    """``?format=jsonl``: one JSON object per line (the list streams them itself; see `RequestLogViewSet.list`)."""

    media_type = "application/x-ndjson"
    format = "jsonl"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> bytes:
        # Only errors reach here (a bad filter): one line holding the error object.
        return (json.dumps(data) + "\n").encode()


JSONL_FIELDS = RequestLogSerializer.Meta.fields


class RequestLogViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Every request the gateway decided (issue 26), oldest first: `since`/`until` (ISO 8601, `until`
    exclusive), `entitlement`, `outcome`, `pool`, `reason`, `tenant`; paginated, or with `?format=jsonl` the
    whole filtered window streamed as JSON lines."""

    serializer_class = RequestLogSerializer
    filterset_class = RequestLogFilter
    renderer_classes = [renderers.JSONRenderer, renderers.BrowsableAPIRenderer, JsonLinesRenderer]

    def get_queryset(self) -> Any:
        return request_log_list(user=self.request.user)

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        try:
            return super().perform_content_negotiation(request, force)
        except Http404:  # DRF's answer to an unknown ?format=: bad input here, a field error like the filters'
            raise ValidationError({"format": ["must be json or jsonl"]}) from None

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        if request.accepted_renderer.format != "jsonl":
            return super().list(request, *args, **kwargs)
        records = self.filter_queryset(self.get_queryset())  # a bad filter raises here: a 400 like the list's
        response = StreamingHttpResponse(_json_lines(records), content_type="application/x-ndjson")
        response["Content-Disposition"] = 'inline; filename="requests.jsonl"'
        return response


def _json_lines(records: Any) -> Iterator[bytes]:
    """The records as JSON lines, read from the database in chunks (never the whole window in memory)."""
    rows = records.values_list(*[("tenant__slug" if f == "tenant" else f) for f in JSONL_FIELDS])
    for row in rows.iterator(chunk_size=2000):
        record = dict(zip(JSONL_FIELDS, row, strict=True))
        record["arrived_at"] = record["arrived_at"].isoformat().replace("+00:00", "Z")
        yield (json.dumps(record) + "\n").encode()
