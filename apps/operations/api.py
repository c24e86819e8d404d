"""REST endpoints that span tenancy and pools: tenants (deleting one rebinds pools) and API keys (a key names
an entitlement). Thin views over the services and selectors of both apps and `apps.operations.tenants`.

Who may do what is documented in ``apps.tenancy.models``: objects of tenants a user does not belong to
answer 404; a visible object the user may not change answers 403.
"""

from __future__ import annotations

from typing import Any

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from apps.operations.serializers import ApiKeyCreatedSerializer, ApiKeySerializer
from apps.operations.tenants import tenant_delete
from apps.tenancy import selectors as tenancy_selectors
from apps.tenancy import services as tenancy_services
from apps.tenancy.apiutils import call_service
from apps.tenancy.models import ApiKey, Tenant
from apps.tenancy.permissions import SuperuserCreates
from apps.tenancy.serializers import TenantSerializer


class TenantViewSet(viewsets.ModelViewSet):
    """Tenants: users see the tenants they belong to; superusers see and manage all of them."""

    serializer_class = TenantSerializer
    permission_classes = [SuperuserCreates]
    lookup_field = "slug"
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> Any:
        return tenancy_selectors.tenant_list(user=self.request.user)

    def get_object(self) -> Any:
        return tenancy_selectors.tenant_get(user=self.request.user, slug=self.kwargs["slug"])

    def perform_create(self, serializer: BaseSerializer[Tenant]) -> None:
        serializer.instance = call_service(
            tenancy_services.tenant_create, actor=self.request.user, **serializer.validated_data
        )

    def perform_update(self, serializer: BaseSerializer[Tenant]) -> None:
        serializer.instance = call_service(
            tenancy_services.tenant_update, actor=self.request.user, tenant=serializer.instance,
            **serializer.validated_data,
        )

    def perform_destroy(self, instance: Any) -> None:
        call_service(tenant_delete, actor=self.request.user, tenant=instance)


class ApiKeyFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    entitlement = django_filters.CharFilter(field_name="entitlement__name")
    revoked = django_filters.BooleanFilter(field_name="revoked_at", lookup_expr="isnull", exclude=True)

    class Meta:
        model = ApiKey
        fields = ["tenant", "entitlement", "revoked"]


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin,
                    mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """API keys. The secret appears only in the creation response; lists show the prefix.

    Owners and members of the tenant create keys; owners revoke any of the tenant's keys, members only
    the keys they created. ``DELETE`` and ``POST .../revoke/`` both revoke (the row stays, for audit).
    """

    serializer_class = ApiKeySerializer
    filterset_class = ApiKeyFilter

    def get_queryset(self) -> Any:
        return tenancy_selectors.apikey_list(user=self.request.user)

    def get_object(self) -> Any:
        return tenancy_selectors.apikey_get(user=self.request.user, key_id=self.kwargs["pk"])

    @extend_schema(responses={201: ApiKeyCreatedSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = ApiKeySerializer(data=request.data, context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        key, secret = call_service(
            tenancy_services.apikey_create, actor=request.user, entitlement=data["entitlement"],
            name=data.get("name", ""), expires_at=data.get("expires_at"),
        )
        key.secret = secret  # type: ignore[attr-defined]
        out = ApiKeyCreatedSerializer(key, context=self.get_serializer_context())
        return Response(out.data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: ApiKey) -> None:
        call_service(tenancy_services.apikey_revoke, actor=self.request.user, key=instance)

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        key = call_service(tenancy_services.apikey_revoke, actor=request.user, key=self.get_object())
        return Response(ApiKeySerializer(key, context=self.get_serializer_context()).data)
