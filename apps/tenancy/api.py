"""REST API for tenants, users, memberships (roles) and API keys; thin views over services and selectors.

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

from apps.tenancy import selectors, services
from apps.tenancy.apiutils import call_service
from apps.tenancy.models import ApiKey, Membership, Tenant
from apps.tenancy.permissions import SuperuserCreates
from apps.tenancy.serializers import (
    ApiKeyCreatedSerializer,
    ApiKeySerializer,
    MembershipSerializer,
    TenantSerializer,
    UserSerializer,
)


class TenantViewSet(viewsets.ModelViewSet):
    """Tenants: users see the tenants they belong to; superusers see and manage all of them."""

    serializer_class = TenantSerializer
    permission_classes = [SuperuserCreates]
    lookup_field = "slug"
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> Any:
        return selectors.tenant_list(user=self.request.user)

    def get_object(self) -> Any:
        return selectors.tenant_get(user=self.request.user, slug=self.kwargs["slug"])

    def perform_create(self, serializer: BaseSerializer[Tenant]) -> None:
        serializer.instance = call_service(services.tenant_create, actor=self.request.user, **serializer.validated_data)

    def perform_update(self, serializer: BaseSerializer[Tenant]) -> None:
        serializer.instance = call_service(
            services.tenant_update, actor=self.request.user, tenant=serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance: Any) -> None:
        call_service(services.tenant_delete, actor=self.request.user, tenant=instance)


class UserViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin, viewsets.GenericViewSet):
    """Logins. Superusers see and create all; others see the users who share one of their tenants."""

    serializer_class = UserSerializer
    permission_classes = [SuperuserCreates]

    def get_queryset(self) -> Any:
        return selectors.user_list(user=self.request.user)

    def get_object(self) -> Any:
        return selectors.user_get(user=self.request.user, user_id=self.kwargs["pk"])

    @extend_schema(responses={200: UserSerializer})
    @action(detail=False, methods=["get"])
    def me(self, request: Request) -> Response:
        """The signed-in user with their roles."""
        return Response(UserSerializer(request.user, context=self.get_serializer_context()).data)

    def perform_create(self, serializer: BaseSerializer[Any]) -> None:
        data = serializer.validated_data
        serializer.instance = call_service(
            services.user_create,
            actor=self.request.user,
            username=data["username"],
            password=data.get("password") or None,
            email=data.get("email", ""),
            is_superuser=data.get("is_superuser", False),
        )


class MembershipFilter(django_filters.FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    role = django_filters.ChoiceFilter(choices=Membership._meta.get_field("role").choices)

    class Meta:
        model = Membership
        fields = ["tenant", "role"]


class MembershipViewSet(viewsets.ModelViewSet):
    """Users' roles (owner, member) in tenants. Owners of the tenant and superusers change them."""

    serializer_class = MembershipSerializer
    filterset_class = MembershipFilter
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self) -> Any:
        return selectors.membership_list(user=self.request.user)

    def get_object(self) -> Any:
        return selectors.membership_get(user=self.request.user, membership_id=self.kwargs["pk"])

    def perform_create(self, serializer: BaseSerializer[Membership]) -> None:
        data = serializer.validated_data
        serializer.instance = call_service(
            services.membership_set, actor=self.request.user, tenant=data["tenant"], user=data["user"],
            role=data["role"],
        )

    def perform_update(self, serializer: BaseSerializer[Membership]) -> None:
        membership = serializer.instance
        assert membership is not None  # UpdateModelMixin.update() hands over the object it fetched
        data = serializer.validated_data
        if ("tenant" in data and data["tenant"] != membership.tenant) or ("user" in data and data["user"] != membership.user):
            from rest_framework.exceptions import ValidationError

            raise ValidationError({"non_field_errors": ["only the role of a membership can change"]})
        serializer.instance = call_service(
            services.membership_set, actor=self.request.user, tenant=membership.tenant, user=membership.user,
            role=data.get("role", membership.role),
        )

    def perform_destroy(self, instance: Membership) -> None:
        call_service(services.membership_remove, actor=self.request.user, membership=instance)


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
        return selectors.apikey_list(user=self.request.user)

    def get_object(self) -> Any:
        return selectors.apikey_get(user=self.request.user, key_id=self.kwargs["pk"])

    @extend_schema(responses={201: ApiKeyCreatedSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = ApiKeySerializer(data=request.data, context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        key, secret = call_service(
            services.apikey_create, actor=request.user, entitlement=data["entitlement"], name=data.get("name", ""),
            expires_at=data.get("expires_at"),
        )
        key.secret = secret  # type: ignore[attr-defined]
        out = ApiKeyCreatedSerializer(key, context=self.get_serializer_context())
        return Response(out.data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: ApiKey) -> None:
        call_service(services.apikey_revoke, actor=self.request.user, key=instance)

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        key = call_service(services.apikey_revoke, actor=request.user, key=self.get_object())
        return Response(ApiKeySerializer(key, context=self.get_serializer_context()).data)
