"""REST representation of API keys: a key names an entitlement of pools, so it lives above tenancy and pools."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from apps.gateway.quotas import entitlement_quota_status, tenant_quota_status
from apps.pools.selectors import entitlement_list
from apps.pools.serializers import EntitlementSerializer
from apps.tenancy.models import ApiKey, Tenant
from apps.tenancy.serializers import QuotaStatusSerializer, TenantSerializer, request_user
from apps.tenancy.services import DEFAULT_ROTATION_GRACE_S, MAX_ROTATION_GRACE_S


class TenantWithQuotaSerializer(TenantSerializer):
    """A tenant with its quota's current window (the usage records live with the gateway, above tenancy)."""

    quota_status = serializers.SerializerMethodField()

    class Meta(TenantSerializer.Meta):
        fields = [*TenantSerializer.Meta.fields, "quota_status"]

    @extend_schema_field(QuotaStatusSerializer(allow_null=True))
    def get_quota_status(self, tenant: Tenant) -> dict[str, Any] | None:
        return tenant_quota_status(tenant)


def _after(fields: list[str], anchor: str, name: str) -> list[str]:
    index = fields.index(anchor) + 1
    return [*fields[:index], name, *fields[index:]]


@extend_schema_serializer(component_name="Entitlement")
class EntitlementWithQuotaSerializer(EntitlementSerializer):
    """An entitlement with its own quota's current window (the usage records live with the gateway: pools
    never import it, this layer above both joins them)."""

    quota_status = serializers.SerializerMethodField()

    class Meta(EntitlementSerializer.Meta):
        fields = _after(list(EntitlementSerializer.Meta.fields), "quota_timezone", "quota_status")

    @extend_schema_field(QuotaStatusSerializer(allow_null=True))
    def get_quota_status(self, ent: Any) -> dict[str, Any] | None:
        return entitlement_quota_status(ent)


class ApiKeySerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    entitlement = serializers.SlugRelatedField(slug_field="name", queryset=ApiKey.objects.none())
    # Null for keys made by the system (`manage.py create_key`, the demo) or whose creator was deleted.
    created_by: serializers.SlugRelatedField[AbstractBaseUser] = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )
    status = serializers.CharField(read_only=True)

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "tenant", "entitlement", "status", "created_by", "created_at",
                  "expires_at", "revoked_at", "last_used_at"]
        read_only_fields = ["id", "prefix", "tenant", "status", "created_by", "created_at", "revoked_at",
                            "last_used_at"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        user = request_user(self)
        if user is not None:
            entitlement_field = self.fields["entitlement"]
            assert isinstance(entitlement_field, serializers.RelatedField)  # declared above
            # The ignore: a clash of the stubs on RelatedField.queryset, see MembershipSerializer.__init__.
            entitlement_field.queryset = entitlement_list(user=user)  # type: ignore[arg-type]


class ApiKeyCreatedSerializer(ApiKeySerializer):
    """The creation response: the only time the secret is ever shown."""

    secret = serializers.CharField(read_only=True, help_text="shown once; store it now, it cannot be retrieved")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "secret"]


class ApiKeyRotateSerializer(serializers.Serializer):
    """``POST /api/v1/keys/ID/rotate/``: how long the replaced secret stays valid."""

    grace_period_s = serializers.IntegerField(
        min_value=0, max_value=MAX_ROTATION_GRACE_S, default=DEFAULT_ROTATION_GRACE_S,
        help_text="seconds the replaced secret keeps working (0: revoked at once); default one day")


class ApiKeyRotatedSerializer(ApiKeyCreatedSerializer):
    """The rotation's answer: the new key with its secret (shown once), and the replaced one as it is now."""

    replaced = ApiKeySerializer(read_only=True, help_text="the replaced key, with its new expiry (or revoked)")

    class Meta(ApiKeyCreatedSerializer.Meta):
        fields = [*ApiKeyCreatedSerializer.Meta.fields, "replaced"]
