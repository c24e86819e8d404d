"""Forms of the admin UI pages.

Plain forms, not ModelForms: they only parse and check the shape of the input. The rules (roles, names,
capacity, binding) live in the services, whose ``ValidationError`` is folded back into the form by
``add_service_errors`` so the page shows it next to the field it concerns.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, cast

from django import forms
from django.core.exceptions import ValidationError
from django.db.models import QuerySet

from apps.policy import ServiceClass
from apps.pools.models import (
    QUEUE_DEFAULTS_HELP,
    QUEUE_MAX_MESSAGE,
    QUEUE_WAIT_MAX_MS,
    QUEUE_WAIT_MESSAGE,
    SERVICE_CLASS_CHOICES,
    SERVICE_CLASS_HELP,
    BackendKind,
    Replica,
    TokenEntitlement,
    TokenPool,
)
from apps.tenancy.models import Role, Tenant


def add_service_errors(form: forms.Form, error: ValidationError) -> None:
    """Attach a service's ValidationError to the form: per field where the field is on the form."""
    if hasattr(error, "error_dict"):
        for field, messages in error.message_dict.items():
            target = field if field in form.fields else None
            for message in messages:
                text = message if target else (message if field == "__all__" else f"{field}: {message}")
                form.add_error(target, text)
    else:
        for message in error.messages:
            form.add_error(None, message)


class DateTimeLocalInput(forms.DateTimeInput):
    """The browser's own date-time picker; its value format is ``YYYY-MM-DDTHH:MM``."""

    input_type = "datetime-local"

    def __init__(self, attrs: dict[str, Any] | None = None) -> None:
        super().__init__(attrs=attrs, format="%Y-%m-%dT%H:%M")


def _expires_field() -> forms.DateTimeField:
    return forms.DateTimeField(
        required=False,
        widget=DateTimeLocalInput(),
        input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S"],
        help_text="Optional, in UTC. Leave empty for no expiry.",
    )


def _quota_form_fields() -> dict[str, forms.Field]:
    return {
        "quota_window": forms.ChoiceField(
            choices=[("", "no quota"), ("hour", "hour"), ("day", "day"), ("month", "month")], required=False,
            label="Quota window", help_text="Calendar-aligned in the quota's timezone."),
        "quota_tokens": forms.IntegerField(min_value=1, required=False, label="Quota (tokens)",
                                           help_text="Prompt plus completion tokens per window."),
        "quota_amount": forms.DecimalField(min_value=Decimal("0.0001"), max_digits=14, decimal_places=4,
                                           required=False, label="Quota (money)",
                                           help_text="Instead of tokens: priced at the pool's prices."),
        "quota_currency": forms.CharField(max_length=3, required=False, label="Quota currency"),
        "quota_timezone": forms.CharField(max_length=64, required=False, initial="UTC", label="Quota timezone"),
        "quota_on_exceeded": forms.ChoiceField(
            choices=[("reject", "reject"), ("spot", "serve as spot")], required=False, initial="reject",
            label="When the quota is used up",
            help_text="reject: 429 quota_exceeded until the window resets; spot: its requests are served as spot "
            "until the window resets."),
    }


QUOTA_FORM_FIELDS = _quota_form_fields()
QUOTA_NAMES = tuple(QUOTA_FORM_FIELDS)


class TenantForm(forms.Form):
    name = forms.CharField(max_length=200)
    slug = forms.CharField(
        max_length=63,
        help_text="Lowercase letters, digits and inner hyphens; used in URLs and the API.",
    )
    quota_window = QUOTA_FORM_FIELDS["quota_window"]
    quota_tokens = QUOTA_FORM_FIELDS["quota_tokens"]
    quota_amount = QUOTA_FORM_FIELDS["quota_amount"]
    quota_currency = QUOTA_FORM_FIELDS["quota_currency"]
    quota_timezone = QUOTA_FORM_FIELDS["quota_timezone"]
    quota_on_exceeded = QUOTA_FORM_FIELDS["quota_on_exceeded"]


class MembershipForm(forms.Form):
    username = forms.CharField(max_length=150, help_text="An existing login.")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class PoolForm(forms.Form):
    name = forms.CharField(max_length=253, help_text="Kubernetes object name style: lowercase, digits, '.', '-'.")
    model_name = forms.CharField(max_length=300, label="Model")
    backend_kind = forms.ChoiceField(choices=BackendKind.choices, initial=BackendKind.VLLM, label="Backend")
    min_replicas = forms.IntegerField(min_value=0, initial=1)
    max_replicas = forms.IntegerField(min_value=1, initial=1)
    slots_per_replica = forms.IntegerField(min_value=1, initial=16, label="Slots per replica")
    tokens_per_second_per_replica = forms.IntegerField(min_value=1, label="Tokens/s per replica")
    kv_cache_gib_per_replica = forms.DecimalField(
        min_value=Decimal("0.001"), max_digits=12, decimal_places=3, label="KV cache GiB per replica"
    )
    kv_layers = forms.IntegerField(min_value=1, label="KV layers (L)")
    kv_heads = forms.IntegerField(min_value=1, label="KV heads (H_kv)")
    head_dim = forms.IntegerField(min_value=1, label="Head dimension (d_h)")
    bytes_per_element = forms.IntegerField(min_value=1, initial=2, label="Bytes per element (b)")
    replicas = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "placeholder": "http://10.0.0.5:8000\nhttp://10.0.0.6:8000 disabled"}),
        help_text="One backend URL per line; add ' disabled' after a URL to keep it out of capacity.",
    )
    inference_objectives = forms.CharField(
        required=False, label="InferenceObjectives (llm-d)",
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "guaranteed: premium\nspot: batch"}),
        help_text="For an llm-d backend: one 'class: InferenceObjective name' per line; a class left out gets "
        "tokenpools-<class>.")

    def __init__(self, *args: Any, editing: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if editing:
            # pool_update cannot rename a pool: its name is how entitlements and the API refer to it.
            del self.fields["name"]

    def clean_replicas(self) -> list[dict[str, Any]]:
        replicas: list[dict[str, Any]] = []
        for line in self.cleaned_data.get("replicas", "").splitlines():
            parts = line.split()
            if not parts:
                continue
            if len(parts) > 2 or (len(parts) == 2 and parts[1].lower() != "disabled"):
                raise ValidationError(f"cannot read {line.strip()!r}: write a URL, optionally followed by 'disabled'")
            replicas.append({"url": parts[0], "enabled": len(parts) == 1})
        return replicas

    def clean_inference_objectives(self) -> dict[str, str]:
        """'class: name' lines -> {class: name}; which classes and names are valid is the model's rule."""
        objectives: dict[str, str] = {}
        for line in self.cleaned_data.get("inference_objectives", "").splitlines():
            if not line.strip():
                continue
            service_class, sep, name = line.partition(":")
            if not sep or not service_class.strip() or not name.strip():
                raise ValidationError(f"cannot read {line.strip()[:80]!r}: write 'class: InferenceObjective name'")
            if service_class.strip() in objectives:
                raise ValidationError(f"{service_class.strip()[:40]!r} is listed twice")
            objectives[service_class.strip()] = name.strip()
        return objectives

    @staticmethod
    def objectives_as_text(pool: TokenPool) -> str:
        return "\n".join(f"{cls}: {name}" for cls, name in sorted((pool.inference_objectives or {}).items()))

    @staticmethod
    def replicas_as_text(pool: TokenPool) -> str:
        replicas = Replica.objects.filter(pool=pool).order_by("position", "id")
        return "\n".join(r.url if r.enabled else f"{r.url} disabled" for r in replicas)

    @classmethod
    def initial_for(cls, pool: TokenPool) -> dict[str, Any]:
        text_fields = ("replicas", "inference_objectives")
        initial: dict[str, Any] = {name: getattr(pool, name) for name in cls.base_fields if name not in text_fields}
        initial["replicas"] = cls.replicas_as_text(pool)
        initial["inference_objectives"] = cls.objectives_as_text(pool)
        return initial


class EntitlementForm(forms.Form):
    name = forms.CharField(max_length=253, help_text="Unique; lowercase letters, digits, '.' and '-'.")
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none(), empty_label=None)
    pool = forms.ModelChoiceField(queryset=TokenPool.objects.none(), empty_label=None, to_field_name="name")
    service_class = forms.ChoiceField(choices=SERVICE_CLASS_CHOICES, initial=ServiceClass.GUARANTEED,
                                      help_text=SERVICE_CLASS_HELP + ".")
    slo_target_ms = forms.IntegerField(min_value=1, initial=200, label="SLO target (ms)")
    tokens_per_second = forms.IntegerField(min_value=1, label="Tokens/s")
    kv_cache_gib = forms.DecimalField(
        min_value=Decimal("0.001"), max_digits=12, decimal_places=3, label="KV cache (GiB)"
    )
    concurrency = forms.IntegerField(min_value=1, help_text="Concurrent requests (decode slots).")
    default_max_tokens = forms.IntegerField(min_value=1, required=False, label="Default max_tokens")
    queue_max = forms.IntegerField(
        min_value=0, required=False, label="Queue size", error_messages={"min_value": QUEUE_MAX_MESSAGE},
        help_text="Requests over this entitlement's own limits that may wait (0: refused at once). Blank: the "
        f"class default ({QUEUE_DEFAULTS_HELP}).")
    queue_max_wait_ms = forms.IntegerField(
        min_value=0, max_value=QUEUE_WAIT_MAX_MS, required=False, label="Queue wait (ms)",
        error_messages={"min_value": QUEUE_WAIT_MESSAGE, "max_value": QUEUE_WAIT_MESSAGE},
        help_text=f"How long each may wait, up to {QUEUE_WAIT_MAX_MS} ms (10 minutes). Blank: the class default.")
    # Any class here; which ones an entitlement may name is the model's rule (spillover_error), shown on the field.
    spillover_class = forms.ChoiceField(
        choices=[("", "none"), *[(c.value, c.value) for c in ServiceClass]], required=False,
        label="Spillover class",
        help_text="A lower class (elastic, spot or preemptible) its requests are served as, at once, on idle "
        "capacity, when its own limits would make them wait or refuse them. Only dedicated, guaranteed and "
        "elastic entitlements spill over.")
    expires_at = _expires_field()
    quota_window = QUOTA_FORM_FIELDS["quota_window"]
    quota_tokens = QUOTA_FORM_FIELDS["quota_tokens"]
    quota_amount = QUOTA_FORM_FIELDS["quota_amount"]
    quota_currency = QUOTA_FORM_FIELDS["quota_currency"]
    quota_timezone = QUOTA_FORM_FIELDS["quota_timezone"]
    quota_on_exceeded = QUOTA_FORM_FIELDS["quota_on_exceeded"]

    def __init__(
        self,
        *args: Any,
        tenants: QuerySet[Tenant] | None,
        pools: QuerySet[TokenPool],
        **kwargs: Any,
    ) -> None:
        """``tenants=None`` is the edit form: an entitlement's name and tenant never change."""
        super().__init__(*args, **kwargs)
        cast(forms.ModelChoiceField, self.fields["pool"]).queryset = pools
        if tenants is None:
            del self.fields["name"]
            del self.fields["tenant"]
        else:
            cast(forms.ModelChoiceField, self.fields["tenant"]).queryset = tenants

    @classmethod
    def initial_for(cls, entitlement: TokenEntitlement) -> dict[str, Any]:
        names = [n for n in cls.base_fields if n not in {"name", "tenant"}]
        initial: dict[str, Any] = {name: getattr(entitlement, name) for name in names}
        initial["pool"] = entitlement.pool.name
        return initial


class ApiKeyForm(forms.Form):
    entitlement = forms.ModelChoiceField(
        queryset=TokenEntitlement.objects.none(),
        empty_label=None,
        to_field_name="name",
        help_text="The key calls the gateway under this entitlement.",
    )
    name = forms.CharField(max_length=200, required=False, help_text="Optional label, e.g. 'ci' or 'laptop'.")
    expires_at = _expires_field()

    def __init__(self, *args: Any, entitlements: QuerySet[TokenEntitlement], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cast(forms.ModelChoiceField, self.fields["entitlement"]).queryset = entitlements
