"""REST endpoints that span tenancy and pools: tenants (deleting one rebinds pools) and API keys (a key names
an entitlement). Thin views over the services and selectors of both apps and `apps.operations.tenants`.

Who may do what is documented in ``apps.tenancy.models``: objects of tenants a user does not belong to
answer 404; a visible object the user may not change answers 403.
"""

from __future__ import annotations

from typing import Any

import django_filters
from django import forms
from django.db.models import Q
from django.utils import timezone
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from apps.operations.serializers import (
    ApiKeyCreatedSerializer,
    ApiKeyRotatedSerializer,
    ApiKeyRotateSerializer,
    ApiKeySerializer,
    EntitlementWithQuotaSerializer,
    TenantWithQuotaSerializer,
)
from apps.operations.tenants import tenant_delete, tenant_save
from apps.pools.api import EntitlementViewSet as PoolsEntitlementViewSet
from apps.tenancy import selectors as tenancy_selectors
from apps.tenancy import services as tenancy_services
from apps.tenancy.apiutils import NAME_IN_PATH, call_service
from apps.tenancy.models import ApiKey, Tenant
from apps.tenancy.permissions import SuperuserCreates


class EntitlementViewSet(PoolsEntitlementViewSet):
    """Entitlements of the user's tenants; owners create, change and delete them (members read).

    Creating or changing one binds it at once: the response carries its ``state`` and ``state_reason``, and
    its ``quota_status`` (the usage records live with the gateway: joined here, above pools).
    """

    serializer_class = EntitlementWithQuotaSerializer


class TenantViewSet(viewsets.ModelViewSet):
    """Tenants: users see the tenants they belong to; superusers see and manage all of them."""

    serializer_class = TenantWithQuotaSerializer
    permission_classes = [SuperuserCreates]
    lookup_field = "slug"
    lookup_value_regex = NAME_IN_PATH

    def get_queryset(self) -> Any:
        return tenancy_selectors.tenant_list(user=self.request.user)

    def get_object(self) -> Any:
        return tenancy_selectors.tenant_get(user=self.request.user, slug=self.kwargs["slug"])

    def perform_create(self, serializer: BaseSerializer[Tenant]) -> None:
        serializer.instance = call_service(tenant_save, actor=self.request.user, **serializer.validated_data)

    def perform_update(self, serializer: BaseSerializer[Tenant]) -> None:
        serializer.instance = call_service(
            tenant_save, actor=self.request.user, tenant=serializer.instance, **serializer.validated_data,
        )

    def perform_destroy(self, instance: Any) -> None:
        call_service(tenant_delete, actor=self.request.user, tenant=instance)


class StrictBooleanField(forms.NullBooleanField):
    """``true``/``false`` (or ``1``/``0``); anything else is a field error, where Django's field reads it as unset."""

    # The ignore: the stubs give NullBooleanField BooleanField's `-> bool`; Django's own returns None too.
    def to_python(self, value: Any) -> bool | None:  # type: ignore[override]
        if value in (None, ""):
            return None
        if value in (True, "true", "True", "1"):
            return True
        if value in (False, "false", "False", "0"):
            return False
        raise forms.ValidationError("must be true or false")


class StrictBooleanFilter(django_filters.BooleanFilter):
    field_class = StrictBooleanField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # A text widget hands the raw value to the field (the default select reads unknown values as unset).
        kwargs.setdefault("widget", forms.TextInput)
        super().__init__(*args, **kwargs)


KEY_STATUSES = [("active", "active"), ("expired", "expired"), ("revoked", "revoked")]


class ApiKeyFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    entitlement = django_filters.CharFilter(field_name="entitlement__name")
    revoked = StrictBooleanFilter(field_name="revoked_at", lookup_expr="isnull", exclude=True,
                                  help_text="true: only revoked keys (which the list leaves out by default)")
    status = django_filters.ChoiceFilter(choices=KEY_STATUSES, method="filter_status",
                                         help_text="only keys in this state; `revoked` lists revoked keys for audit")

    class Meta:
        model = ApiKey
        fields = ["tenant", "entitlement", "revoked", "status"]

    def filter_status(self, queryset: Any, name: str, value: str) -> Any:
        if value == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        expired = Q(expires_at__isnull=False, expires_at__lte=timezone.now())
        live = queryset.filter(revoked_at__isnull=True)
        return live.filter(expired) if value == "expired" else live.exclude(expired)


@extend_schema_view(destroy=extend_schema(description="Revoke the key: the gateway refuses it from then on, and it "
                                          "leaves the API's view (404 afterwards; `?status=revoked` lists it)."))
class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin,
                    mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """API keys. The secret appears only in the creation response; lists show the prefix.

    Owners and members of the tenant create keys; owners revoke any of the tenant's keys, members only
    the keys they created. ``DELETE`` and ``POST .../revoke/`` both revoke; a revoked key then leaves the
    API's view (a 404, and the list leaves it out) but its row stays for audit: ``?status=revoked`` (or
    ``?revoked=true``) lists revoked keys.
    """

    serializer_class = ApiKeySerializer
    filterset_class = ApiKeyFilter

    def get_queryset(self) -> Any:
        params = self.request.query_params
        audit = self.action == "list" and bool(params.get("status") or params.get("revoked"))
        return tenancy_selectors.apikey_list(user=self.request.user, include_revoked=audit)

    def get_object(self) -> Any:
        return tenancy_selectors.apikey_get(user=self.request.user, key_id=self.kwargs["pk"], include_revoked=False)

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

    @extend_schema(request=ApiKeyRotateSerializer, responses={201: ApiKeyRotatedSerializer})
    @action(detail=True, methods=["post"])
    def rotate(self, request: Request, pk: str | None = None) -> Response:
        """A new secret for the key's entitlement (in this answer only); the replaced key keeps working for
        ``grace_period_s`` (default a day; 0 revokes it at once), so clients can move over. Both are listed, each
        with its expiry."""
        options = ApiKeyRotateSerializer(data=request.data)
        options.is_valid(raise_exception=True)
        old = self.get_object()
        key, secret = call_service(tenancy_services.apikey_rotate, actor=request.user, key=old,
                                   grace_s=options.validated_data["grace_period_s"])
        key.secret = secret  # type: ignore[attr-defined]
        key.replaced = old  # type: ignore[attr-defined]
        out = ApiKeyRotatedSerializer(key, context=self.get_serializer_context())
        return Response(out.data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Revoke the key, as ``DELETE`` does, and answer with it as it is now (``status``: revoked)."""
        key = call_service(tenancy_services.apikey_revoke, actor=request.user, key=self.get_object())
        return Response(ApiKeySerializer(key, context=self.get_serializer_context()).data)
