"""REST API for users and memberships (roles); thin views over services and selectors.

Tenants (whose delete rebinds pools) and API keys (which name an entitlement) span tenancy and pools: their
endpoints are in `apps.operations.api`.

Who may do what is documented in ``apps.tenancy.models``: objects of tenants a user does not belong to
answer 404; a visible object the user may not change answers 403.
"""

from __future__ import annotations

from typing import Any

import django_filters
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from apps.tenancy import selectors, services
from apps.tenancy.apischema import FIELD_ERRORS
from apps.tenancy.apiutils import call_service
from apps.tenancy.models import Membership
from apps.tenancy.permissions import SuperuserCreates
from apps.tenancy.serializers import MembershipSerializer, UserSerializer


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


# A tenant keeps at least one owner: removing the last one is a 400.
@extend_schema_view(destroy=extend_schema(responses={204: None, 400: FIELD_ERRORS}))
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
