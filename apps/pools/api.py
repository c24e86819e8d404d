"""REST API for pools, entitlements and manifests; thin views over services and selectors.

Pools are readable by every signed-in user and changed by superusers only (403 otherwise).
Entitlements of other tenants answer 404; a tenant's members read them, its owners change them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import IO, Any

import django_filters
from django.http import Http404, HttpResponse, QueryDict
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.parsers import BaseParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer
from rest_framework.views import APIView

from apps.pools import selectors, services
from apps.pools.manifests import ManifestError, manifests_apply, manifests_export
from apps.pools.manifests.limits import too_large
from apps.pools.models import SERVICE_CLASS_CHOICES, EntitlementState, TokenEntitlement, TokenPool
from apps.pools.serializers import (
    APPLY_REQUEST_SCHEMAS,
    EXPORT_RESPONSE_SCHEMA,
    ApplyErrorsSerializer,
    ApplyReportSerializer,
    ApplyRequestSerializer,
    DiffReportSerializer,
    EntitlementSerializer,
    PoolSerializer,
    StateChangeSerializer,
)
from apps.tenancy.apischema import FIELD_ERRORS, NOT_FOUND
from apps.tenancy.apiutils import (
    NAME_IN_PATH,
    NUL_MESSAGE,
    JSONParser,
    MultiPartParser,
    call_service,
)
from apps.tenancy.permissions import SuperuserOrReadOnly
from apps.tenancy.selectors import tenant_get


# A pool that still has entitlements cannot be deleted: a 400.
@extend_schema_view(destroy=extend_schema(responses={204: None, 400: FIELD_ERRORS}))
class PoolViewSet(viewsets.ModelViewSet):
    """Token pools with their replicas and derived capacity; superusers create, change and delete them.

    Writing ``replicas`` replaces the pool's replica list. A capacity change re-binds the entitlements.
    """

    serializer_class = PoolSerializer
    permission_classes = [SuperuserOrReadOnly]
    lookup_field = "name"
    lookup_value_regex = NAME_IN_PATH
    filterset_fields = ["backend_kind"]

    def get_queryset(self) -> Any:
        return selectors.pool_list(user=self.request.user)

    def get_object(self) -> Any:
        return selectors.pool_get(user=self.request.user, name=self.kwargs["name"])

    def perform_create(self, serializer: BaseSerializer[TokenPool]) -> None:
        data = dict(serializer.validated_data)
        serializer.instance = call_service(services.pool_create, actor=self.request.user, **data)

    def perform_update(self, serializer: BaseSerializer[TokenPool]) -> None:
        pool = serializer.instance
        assert pool is not None  # UpdateModelMixin.update() hands over the object it fetched
        data = dict(serializer.validated_data)
        name = data.pop("name", pool.name)
        if name != pool.name:
            raise ValidationError({"name": ["a pool cannot be renamed"]})
        replicas = data.pop("replicas", None)
        serializer.instance = call_service(
            services.pool_update, actor=self.request.user, pool=pool, replicas=replicas, **data
        )

    def perform_destroy(self, instance: Any) -> None:
        call_service(services.pool_delete, actor=self.request.user, pool=instance)


class EntitlementFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=EntitlementState.choices, method="filter_state")
    service_class = django_filters.ChoiceFilter(choices=SERVICE_CLASS_CHOICES)
    pool = django_filters.CharFilter(field_name="pool__name")
    tenant = django_filters.CharFilter(field_name="tenant__slug")

    class Meta:
        model = TokenEntitlement
        fields = ["state", "service_class", "pool", "tenant"]

    def filter_state(self, queryset: Any, name: str, value: str) -> Any:
        return queryset.filter(selectors.entitlement_state_q(value))


class EntitlementViewSet(viewsets.ModelViewSet):
    """Entitlements of the user's tenants; owners create, change and delete them (members read).

    Creating or changing one binds it at once: the response carries its ``state`` and ``state_reason``.
    """

    serializer_class = EntitlementSerializer
    filterset_class = EntitlementFilter
    lookup_field = "name"
    lookup_value_regex = NAME_IN_PATH

    def get_queryset(self) -> Any:
        return selectors.entitlement_list(user=self.request.user)

    def get_object(self) -> Any:
        return selectors.entitlement_get(user=self.request.user, name=self.kwargs["name"])

    def perform_create(self, serializer: BaseSerializer[TokenEntitlement]) -> None:
        serializer.instance = call_service(
            services.entitlement_create, actor=self.request.user, **serializer.validated_data
        )

    def perform_update(self, serializer: BaseSerializer[TokenEntitlement]) -> None:
        ent = serializer.instance
        assert ent is not None  # UpdateModelMixin.update() hands over the object it fetched
        data = dict(serializer.validated_data)
        if data.pop("name", ent.name) != ent.name:
            raise ValidationError({"name": ["an entitlement cannot be renamed"]})
        if data.pop("tenant", ent.tenant) != ent.tenant:
            raise ValidationError({"tenant": ["an entitlement cannot move to another tenant"]})
        serializer.instance = call_service(services.entitlement_update, actor=self.request.user, entitlement=ent,
                                           **data)

    def perform_destroy(self, instance: Any) -> None:
        call_service(services.entitlement_delete, actor=self.request.user, entitlement=instance)

    # filters=False: the entitlement filters of the list do not apply to one entitlement's history.
    @extend_schema(responses={200: StateChangeSerializer(many=True)}, filters=False)
    @action(detail=True, methods=["get"])
    def history(self, request: Request, name: str | None = None) -> Response:
        """Every state change of the entitlement (from, to, reason, when), oldest first."""
        ent = self.get_object()
        changes = selectors.entitlement_state_changes(user=request.user, entitlement=ent)
        page = self.paginate_queryset(changes)
        if page is not None:
            return self.get_paginated_response(StateChangeSerializer(page, many=True).data)
        return Response(StateChangeSerializer(changes, many=True).data)


class YAMLTextParser(BaseParser):
    """Hands a YAML body to the view as text; the manifest service parses it (and reports bad YAML)."""

    media_type = "application/yaml"

    # The ignore: the stub narrows parse() to a Mapping or DataAndFiles, but DRF keeps whatever a parser
    # returns as request.data (JSONParser itself may return a list); ApplyView.post() expects this str.
    def parse(  # type: ignore[override]
        self, stream: IO[Any] | None, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> str:
        raw = stream.read() if stream is not None else b""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValidationError({"errors": [_body_issue("body is not UTF-8")]}) from exc
        if "\x00" in text:
            raise ValidationError({"errors": [_body_issue(NUL_MESSAGE)]})
        return text


def _body_issue(message: str) -> dict[str, Any]:
    return {"index": None, "kind": "", "name": "", "field": "", "message": message}


class XYAMLTextParser(YAMLTextParser):
    media_type = "application/x-yaml"


class TextYAMLParser(YAMLTextParser):
    media_type = "text/yaml"


class PlainTextParser(YAMLTextParser):
    media_type = "text/plain"


class FormOrYAMLParser(YAMLTextParser):
    """`application/x-www-form-urlencoded`, which `curl --data-binary @file.yaml` sends unless told otherwise:
    a form (`manifest=...` or `documents=...`) is read as a form; any other body is the manifest's YAML, as
    the README's curl example sends it."""

    media_type = "application/x-www-form-urlencoded"

    def parse(  # type: ignore[override]
        self, stream: IO[Any] | None, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        text = super().parse(stream, media_type, parser_context)
        if FORM_FIELD.match(text):
            return QueryDict(text, encoding="utf-8")
        return text


FORM_FIELD = re.compile(r"(manifest|documents)=")

DRY_RUN_PARAMETER = OpenApiParameter("dryRun", bool, description="validate and report, writing nothing")


class ApplyView(APIView):
    """``POST /api/v1/apply``: apply TokenPool/TokenEntitlement manifests (idempotent).

    Body: YAML (``application/yaml``, ``text/plain``), a multipart ``file`` upload, a JSON list of
    documents, or JSON ``{"manifest": "<yaml>"}`` or ``{"documents": [...]}`` (exactly one of the two). All
    documents are validated before anything is written; ``?dryRun=true`` validates and reports the same, writing
    nothing. 200 with what was created/updated/unchanged (and ``dryRun``); 400
    ``{"errors": [{index, kind, name, field, message}]}`` for bad input (YAML aliases, nesting past 32
    levels included); 403 when a document needs rights the user lacks (pools: superusers; entitlements:
    tenant owners); 413 for a body larger than ``MANIFEST_MAX_BYTES``, refused before it is read.
    """

    parser_classes = [JSONParser, YAMLTextParser, XYAMLTextParser, TextYAMLParser, PlainTextParser,
                      FormOrYAMLParser, MultiPartParser]

    @extend_schema(parameters=[DRY_RUN_PARAMETER], request=APPLY_REQUEST_SCHEMAS, responses={
        200: OpenApiResponse(ApplyReportSerializer, description="what was (or, with dryRun, would be) created, "
                                                                "updated or unchanged"),
        400: OpenApiResponse(ApplyErrorsSerializer, description="bad input: nothing was written"),
        403: OpenApiResponse(ApplyErrorsSerializer, description="a document needs rights the user lacks"),
        413: OpenApiResponse(ApplyErrorsSerializer, description="the body is larger than MANIFEST_MAX_BYTES"),
    })
    def post(self, request: Request) -> Response:
        dry_run = _dry_run(request)
        documents = _request_documents(request)
        if isinstance(documents, Response):
            return documents
        try:
            result = manifests_apply(actor=request.user, documents=documents, dry_run=dry_run)
        except ManifestError as exc:
            return Response({"errors": [i.as_dict() for i in exc.issues]}, status=403 if exc.forbidden else 400)
        return Response({**result.summary(), "dryRun": result.dry_run,
                         "documents": [d.as_dict() for d in result.documents]})


class DiffView(APIView):
    """``POST /api/v1/diff``: what applying the manifests would change (``kubectl diff``), writing nothing.

    The body and permissions are those of ``POST /api/v1/apply`` (the same checks, as a dry run). 200 with
    ``changed`` (whether anything would change) and, per object that would, a unified diff of it as stored
    against it as applied, both in the manifests' field names; 400/403/413 as for apply.
    """

    parser_classes = ApplyView.parser_classes

    @extend_schema(request=APPLY_REQUEST_SCHEMAS, responses={
        200: OpenApiResponse(DiffReportSerializer, description="the objects that would change, as unified diffs"),
        400: OpenApiResponse(ApplyErrorsSerializer, description="bad input"),
        403: OpenApiResponse(ApplyErrorsSerializer, description="a document needs rights the user lacks"),
        413: OpenApiResponse(ApplyErrorsSerializer, description="the body is larger than MANIFEST_MAX_BYTES"),
    })
    def post(self, request: Request) -> Response:
        documents = _request_documents(request)
        if isinstance(documents, Response):
            return documents
        try:
            result = manifests_apply(actor=request.user, documents=documents, compare=True)
        except ManifestError as exc:
            return Response({"errors": [i.as_dict() for i in exc.issues]}, status=403 if exc.forbidden else 400)
        changed = [d for d in result.diffs if d.changed]
        return Response({"changed": bool(changed), "unchanged": len(result.diffs) - len(changed),
                         "diffs": [{"kind": d.kind, "name": d.name, "diff": d.unified()} for d in changed]})


def _dry_run(request: Request) -> bool:
    """``?dryRun=true`` (Kubernetes' ``dryRun=All`` too); anything but true/false is a field error."""
    value = request.query_params.get("dryRun", "false").strip().lower()
    if value in ("true", "1", "all"):
        return True
    if value in ("false", "0", ""):
        return False
    raise ValidationError({"dryRun": ["must be true or false"]})


def _request_documents(request: Request) -> Any:
    """The manifest of an apply or diff request: YAML text, a list of documents, or a 413 Response."""
    try:
        size = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        size = 0
    problem = too_large(size)  # before the body is read: its parsers hold all of it in memory
    if problem:
        return Response({"errors": [_body_issue(problem)]}, status=413)
    body = request.data
    upload = request.FILES.get("file") if hasattr(request, "FILES") else None
    if upload is not None:  # curl -F file=@manifest.yaml
        try:
            documents: Any = upload.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValidationError({"file": ["not UTF-8 text"]}) from exc
        if "\x00" in documents:
            raise ValidationError({"file": [NUL_MESSAGE]})
        return documents
    if isinstance(body, str | list):
        return body
    payload = ApplyRequestSerializer(data=body)
    payload.is_valid(raise_exception=True)
    data = payload.validated_data
    if ("manifest" in data) == ("documents" in data):
        raise ValidationError({"non_field_errors": ["send exactly one of 'manifest' or 'documents'"]})
    return data.get("manifest", data.get("documents"))


class ExportView(APIView):
    """``GET /api/v1/export``: the pools and entitlements the user may see, as manifests ``apply`` accepts."""

    @extend_schema(parameters=[OpenApiParameter("tenant", str, description="only this tenant (slug)")],
                   responses={(200, "application/yaml"): OpenApiResponse(EXPORT_RESPONSE_SCHEMA,
                                                                         description="multi-document YAML"),
                              404: NOT_FOUND})
    def get(self, request: Request) -> HttpResponse:
        tenant = None
        slug = request.query_params.get("tenant")
        if slug and "\x00" in slug:  # no slug holds one, and PostgreSQL refuses to compare text with NUL
            raise Http404(f"no tenant {slug!r}")
        if slug:
            tenant = tenant_get(user=request.user, slug=slug)
        return HttpResponse(manifests_export(user=request.user, tenant=tenant), content_type="application/yaml")
