"""REST representations of tenants, users and memberships (snake_case fields).

API keys name an entitlement (pools), so their serializer lives one layer up: `apps.operations.serializers`.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from rest_framework import serializers

from apps.tenancy.models import Membership, Role, Tenant
from apps.tenancy.selectors import tenant_list, user_private_fields_visible, user_role


def request_user(serializer: serializers.Serializer) -> Any:
    request = serializer.context.get("request")
    return getattr(request, "user", None)


def quota_on_exceeded_field() -> serializers.CharField:
    """`quota_on_exceeded` of a tenant or an entitlement: a plain string the model checks (its message names the
    values), so the API, the form and apply say the same."""
    return serializers.CharField(
        required=False, allow_blank=True,
        help_text="what a used-up quota does: reject (429 quota_exceeded until the window resets, the default) or "
        "spot (the entitlement's requests are served as spot until the window resets)")


class TenantSerializer(serializers.ModelSerializer):
    my_role = serializers.SerializerMethodField(help_text="the requesting user's role: owner, member (or null)")
    quota_on_exceeded = quota_on_exceeded_field()

    class Meta:
        model = Tenant
        fields = ["slug", "name", "my_role", "quota_tokens", "quota_amount", "quota_currency", "quota_window",
                  "quota_timezone", "quota_on_exceeded", "created_at"]
        read_only_fields = ["created_at"]
        extra_kwargs: dict[str, dict[str, Any]] = {"slug": {"validators": []}}  # the service checks uniqueness, in its transaction

    def get_my_role(self, tenant: Tenant) -> str | None:
        return _role_of(self, tenant)


class QuotaStatusSerializer(serializers.Serializer):
    """A quota's current window (read-only): what the usage records say it has used."""

    unit = serializers.CharField(help_text="tokens, or the currency of a money quota")
    window = serializers.CharField(help_text="hour, day or month (calendar-aligned in `timezone`)")
    timezone = serializers.CharField()
    window_id = serializers.CharField(help_text="the current window, e.g. 2026-11 for a month")
    limit = serializers.FloatField()
    used = serializers.FloatField(help_text="used by finished requests (the usage records, flushed every few "
                                            "seconds; requests still running are not in it)")
    remaining = serializers.FloatField()
    used_percent = serializers.FloatField()
    resets_at = serializers.DateTimeField()


def _role_of(serializer: serializers.Serializer, tenant: Tenant) -> str | None:
    return user_role(user=request_user(serializer), tenant=tenant)


class UserSerializer(serializers.ModelSerializer):
    password = serializers.CharField(write_only=True, required=False, allow_blank=True, style={"input_type": "password"})
    roles = serializers.SerializerMethodField()

    class Meta:
        model = get_user_model()
        fields = ["id", "username", "email", "is_superuser", "password", "roles"]
        read_only_fields = ["id"]
        extra_kwargs: dict[str, dict[str, Any]] = {"username": {"validators": []}}

    # Left out (not blanked) where the reader may not see them: both are optional in the schema.
    PRIVATE_FIELDS = ("email", "is_superuser")

    def to_representation(self, instance: Any) -> dict[str, Any]:
        data: dict[str, Any] = super().to_representation(instance)
        if not user_private_fields_visible(user=request_user(self), other=instance):
            for name in self.PRIVATE_FIELDS:
                data.pop(name, None)
        return data

    def get_roles(self, obj: Any) -> list[dict[str, str]]:
        visible = tenant_list(user=request_user(self))
        return [
            {"tenant": m.tenant.slug, "role": m.role}
            for m in obj.memberships.select_related("tenant").filter(tenant__in=visible)
        ]


class MembershipSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", queryset=Tenant.objects.none())
    user = serializers.SlugRelatedField(slug_field="username", queryset=get_user_model().objects.none())
    role = serializers.ChoiceField(choices=Role.choices)

    class Meta:
        model = Membership
        fields = ["id", "tenant", "user", "role", "created_at"]
        read_only_fields = ["id", "created_at"]
        validators: list = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        user = request_user(self)
        if user is not None:
            tenant_field, user_field = self.fields["tenant"], self.fields["user"]
            assert isinstance(tenant_field, serializers.RelatedField)  # both declared above
            assert isinstance(user_field, serializers.RelatedField)
            # The ignores: mypy applies django-stubs' Manager.__get__ to DRF-stubs' RelatedField.queryset
            # (declared `QuerySet | Manager | None`), so any access to it reports arg-type; the code is right.
            tenant_field.queryset = tenant_list(user=user)  # type: ignore[arg-type]
            # Any existing login may be added to a tenant by its owner (superusers create the logins).
            user_field.queryset = get_user_model().objects.filter(is_active=True)  # type: ignore[arg-type]
