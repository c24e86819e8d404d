"""REST representations of pools (with replicas and derived capacity) and entitlements (snake_case)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.pools.manifests.reader import API_VERSION, KINDS
from apps.pools.models import (
    QUEUE_DEFAULTS_HELP,
    QUEUE_WAIT_MAX_MS,
    SERVICE_CLASS_CHOICES,
    SERVICE_CLASS_HELP,
    SERVICE_CLASS_WEIGHT,
    BackendKind,
    Capacity,
    EntitlementStateChange,
    TokenEntitlement,
    TokenPool,
)
from apps.pools.selectors import pool_usage
from apps.tenancy.models import Tenant
from apps.tenancy.selectors import tenant_list
from apps.tenancy.serializers import quota_on_exceeded_field


def _capacity_dict(cap: Capacity) -> dict[str, Any]:
    return {"slots": cap.slots, "tokens_per_second": cap.tokens_per_second, "kv_bytes": cap.kv_bytes,
            "kv_gib": round(cap.kv_gib, 3)}


class ReplicaSerializer(serializers.Serializer):
    id = serializers.IntegerField(read_only=True)
    url = serializers.CharField(max_length=500)
    enabled = serializers.BooleanField(default=True)
    # The last scrape of the replica's /metrics (null until the scrape tick has seen it).
    healthy = serializers.BooleanField(read_only=True, allow_null=True)
    scrape_error = serializers.CharField(read_only=True)
    scraped_at = serializers.DateTimeField(read_only=True, allow_null=True)
    num_requests_running = serializers.IntegerField(read_only=True, allow_null=True)
    num_requests_waiting = serializers.IntegerField(read_only=True, allow_null=True)
    kv_cache_usage = serializers.FloatField(read_only=True, allow_null=True)
    kv_cache_tokens = serializers.IntegerField(read_only=True, allow_null=True)
    kv_cache_bytes = serializers.IntegerField(read_only=True, allow_null=True)


class CapacitySerializer(serializers.Serializer):
    slots = serializers.IntegerField()
    tokens_per_second = serializers.IntegerField()
    kv_bytes = serializers.IntegerField()
    kv_gib = serializers.FloatField()


class PoolSerializer(serializers.ModelSerializer):
    """A pool. Capacity fields are per replica; ``capacity`` = enabled replicas x per-replica capacity."""

    backend_kind = serializers.ChoiceField(choices=BackendKind.choices, default=BackendKind.VLLM)
    replicas = ReplicaSerializer(many=True, required=False)
    # Checked by the model (one message for the API, the form and apply): classes known, names Kubernetes names.
    inference_objectives = serializers.JSONField(
        required=False,
        help_text="for an llm-d backend: the InferenceObjective name of each served class, e.g. "
        '{"guaranteed": "premium"}; a class left out gets tokenpools-<class>')
    kv_cache_gib_per_replica = serializers.DecimalField(max_digits=12, decimal_places=3)
    bytes_per_token = serializers.IntegerField(read_only=True, help_text="c = 2 * layers * kv_heads * head_dim * bytes")
    kv_cache_bytes_per_replica = serializers.IntegerField(read_only=True)
    usage = serializers.SerializerMethodField()
    measured_capacity = serializers.SerializerMethodField(
        help_text="per-replica KV size measured by the scrape (vllm:cache_config_info); null until scraped"
    )
    desired_replicas = serializers.IntegerField(
        read_only=True, allow_null=True,
        help_text="autoscaling signal: replicas the entitled baselines and observed demand call for",
    )

    class Meta:
        model = TokenPool
        fields = [
            "name", "model_name", "backend_kind", "replicas", "min_replicas", "max_replicas",
            "slots_per_replica", "tokens_per_second_per_replica", "kv_cache_gib_per_replica",
            "kv_cache_bytes_per_replica", "kv_layers", "kv_heads", "head_dim", "bytes_per_element",
            "bytes_per_token", "price_input_per_million", "price_output_per_million", "price_currency",
            "inference_objectives", "usage",
            "measured_capacity", "desired_replicas", "desired_replicas_reason", "desired_replicas_at", "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at", "desired_replicas_reason", "desired_replicas_at"]
        # Types only here; ranges, uniqueness and cross-field rules are the service's (one source of truth).
        extra_kwargs = {
            "name": {"validators": []},
            **{f: {"min_value": None, "validators": []} for f in (
                "min_replicas", "max_replicas", "slots_per_replica", "tokens_per_second_per_replica",
                "kv_layers", "kv_heads", "head_dim", "bytes_per_element")},
        }

    def get_usage(self, pool: TokenPool) -> dict[str, Any]:
        request = self.context.get("request")
        assert request is not None, "PoolSerializer needs the request in its context"
        usage = pool_usage(user=request.user, pool=pool)
        return {
            "enabled_replicas": usage.enabled_replicas,
            "capacity": _capacity_dict(usage.capacity),
            "reserved": _capacity_dict(usage.reserved),
            "free": _capacity_dict(usage.free),
            "entitlements_by_state": usage.entitlements_by_state,
        }

    def get_measured_capacity(self, pool: TokenPool) -> dict[str, Any] | None:
        if pool.measured_at is None:
            return None
        return {
            "kv_cache_tokens_per_replica": pool.measured_kv_cache_tokens_per_replica,
            "kv_cache_bytes_per_replica": pool.measured_kv_cache_bytes_per_replica,
            "measured_at": serializers.DateTimeField().to_representation(pool.measured_at),
        }


class QueueSerializer(serializers.Serializer):
    """An entitlement's own queue as it applies (the schema of ``queue_effective``)."""

    max = serializers.IntegerField(help_text="how many requests over its own limits may wait (0: none)")
    max_wait_ms = serializers.IntegerField(help_text="how long each may wait, in ms")


class EntitlementSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", queryset=Tenant.objects.none(),
                                          help_text="tenant slug")
    pool = serializers.SlugRelatedField(slug_field="name", queryset=TokenPool.objects.all(), help_text="pool name")
    service_class = serializers.ChoiceField(choices=SERVICE_CLASS_CHOICES, help_text=SERVICE_CLASS_HELP)
    kv_cache_gib = serializers.DecimalField(max_digits=12, decimal_places=3)
    # Declared without bounds: the model's validators answer (one message for the API, the form and apply).
    queue_max = serializers.IntegerField(
        required=False, allow_null=True,
        help_text="how many requests over the entitlement's own limits may wait (0: refused at once); null: the "
        f"service class's default ({QUEUE_DEFAULTS_HELP})")
    queue_max_wait_ms = serializers.IntegerField(
        required=False, allow_null=True,
        help_text=f"how long each may wait, 0 to {QUEUE_WAIT_MAX_MS} ms (10 minutes); null: the service class's "
        "default")
    # Plain strings: the model's rules answer (which classes, lower than the entitlement's own; reject or spot).
    spillover_class = serializers.CharField(
        required=False, allow_blank=True,
        help_text="a lower class (elastic, spot or preemptible) its requests are served as, at once, on idle "
        "capacity, when its own limits would make them wait or refuse them; only for dedicated, guaranteed and "
        "elastic entitlements; blank: none")
    quota_on_exceeded = quota_on_exceeded_field()
    queue_effective = serializers.SerializerMethodField(
        help_text="the queue the entitlement gets, with the class's defaults where queue_max or queue_max_wait_ms "
        "is null")
    weight = serializers.SerializerMethodField(
        help_text="base weight of the service class (seed Table 1): "
        + ", ".join(f"{name} {weight:g}" for name, weight in SERVICE_CLASS_WEIGHT.items())
    )

    class Meta:
        model = TokenEntitlement
        fields = [
            "name", "tenant", "pool", "service_class", "weight", "slo_target_ms", "tokens_per_second",
            "kv_cache_gib", "concurrency", "default_max_tokens", "queue_max", "queue_max_wait_ms", "queue_effective",
            "spillover_class", "expires_at", "quota_tokens",
            "quota_amount", "quota_currency", "quota_window", "quota_timezone", "quota_on_exceeded", "state",
            "state_reason",
            "state_changed_at", "created_at", "updated_at",
        ]
        read_only_fields = ["state", "state_reason", "state_changed_at", "created_at", "updated_at"]
        extra_kwargs = {
            "name": {"validators": []},
            **{f: {"min_value": None, "validators": []} for f in (
                "slo_target_ms", "tokens_per_second", "concurrency", "default_max_tokens")},
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        request = self.context.get("request")
        if request is not None:
            tenant_field = self.fields["tenant"]
            assert isinstance(tenant_field, serializers.RelatedField)  # declared above
            # The ignore: mypy applies django-stubs' Manager.__get__ to DRF-stubs' RelatedField.queryset
            # (declared `QuerySet | Manager | None`), so any access to it reports arg-type; the code is right.
            tenant_field.queryset = tenant_list(user=request.user)  # type: ignore[arg-type]

    def get_weight(self, ent: TokenEntitlement) -> float:
        return SERVICE_CLASS_WEIGHT[ent.service_class]

    @extend_schema_field(QueueSerializer())
    def get_queue_effective(self, ent: TokenEntitlement) -> dict[str, int]:
        size, wait = ent.queue_effective
        return {"max": size, "max_wait_ms": wait}


    def to_representation(self, ent: TokenEntitlement) -> dict[str, Any]:
        data = super().to_representation(ent)
        # Past expires_at an entitlement is Expired, even before the periodic expiry tick has recorded it.
        if ent.effective_state() != ent.state:
            data["state"] = ent.effective_state()
            assert ent.expires_at is not None  # only an entitlement past its expires_at changes state here
            data["state_reason"] = f"expired at {ent.expires_at.isoformat()}"
        return data


class StateChangeSerializer(serializers.ModelSerializer):
    # Plain strings: the state enum is already named in the schema by the entitlement's ``state``.
    from_state = serializers.CharField(read_only=True)
    to_state = serializers.CharField(read_only=True)

    class Meta:
        model = EntitlementStateChange
        fields = ["from_state", "to_state", "reason", "at"]


class ApplyRequestSerializer(serializers.Serializer):
    """JSON form of an apply request; raw YAML bodies (application/yaml, text/plain) are accepted too."""

    manifest = serializers.CharField(required=False, help_text="multi-document YAML text")
    documents = serializers.ListField(child=serializers.DictField(), required=False, allow_empty=False)


# The apply request as the schema states it: exactly one of `manifest` (YAML text) or `documents` (a non-empty
# list), or the list itself, or a YAML body, or a multipart `file` upload. (Raw schemas: a serializer cannot
# say "exactly one of".)
_DOCUMENT = {"type": "object", "additionalProperties": {}, "description": "one manifest document (a mapping)"}
_MANIFEST_TEXT = {"type": "string", "minLength": 1, "description": "multi-document YAML text"}
_DOCUMENTS = {"type": "array", "items": _DOCUMENT, "minItems": 1}
APPLY_REQUEST_SCHEMAS: dict[str, Any] = {
    "application/json": {"oneOf": [
        {"type": "object", "properties": {"manifest": _MANIFEST_TEXT}, "required": ["manifest"],
         "not": {"required": ["documents"]}},
        {"type": "object", "properties": {"documents": _DOCUMENTS}, "required": ["documents"],
         "not": {"required": ["manifest"]}},
        _DOCUMENTS,
    ]},
    **{media: {"type": "string", "description": "multi-document YAML"}
       for media in ("application/yaml", "application/x-yaml", "text/yaml", "text/plain")},
    "application/x-www-form-urlencoded": {"type": "object", "properties": {"manifest": _MANIFEST_TEXT},
                                          "required": ["manifest"]},
    "multipart/form-data": {"type": "object", "properties": {
        "file": {"type": "string", "format": "binary", "description": "a YAML file"}, "manifest": _MANIFEST_TEXT}},
}


# GET /api/v1/export: a multi-document YAML stream; as data (read with a multi-document loader, e.g.
# yaml.safe_load_all) the list of its documents, each one that `apply` accepts.
EXPORT_RESPONSE_SCHEMA: dict[str, Any] = {
    "type": "array",
    "description": "multi-document YAML (`---` between documents); as data, the list of its documents",
    "items": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"type": "string", "enum": [API_VERSION]},
            "kind": {"type": "string", "enum": list(KINDS)},
            "metadata": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            "spec": {"type": "object", "additionalProperties": {}},
        },
    },
}


class ManifestIssueSerializer(serializers.Serializer):
    index = serializers.IntegerField(allow_null=True, help_text="the document's position; null for the whole manifest")
    kind = serializers.CharField()
    name = serializers.CharField()
    field = serializers.CharField()
    message = serializers.CharField()


class ApplyErrorsSerializer(serializers.Serializer):
    """Why nothing was applied: ``errors`` for the manifest's problems; field errors of the request itself
    (``file``, ``non_field_errors``) or ``detail`` otherwise."""

    # The ignore: the field shadows Serializer.errors in the stubs only (the metaclass takes declared fields
    # off the class); the response's key is "errors".
    errors = ManifestIssueSerializer(many=True, required=False)  # type: ignore[assignment]
    detail = serializers.CharField(required=False)


class AppliedDocumentSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    kind = serializers.CharField()
    name = serializers.CharField()
    action = serializers.ChoiceField(choices=["created", "updated", "unchanged"])


class ApplyReportSerializer(serializers.Serializer):
    created = serializers.IntegerField()
    dryRun = serializers.BooleanField(help_text="true when nothing was written (?dryRun=true)")
    updated = serializers.IntegerField()
    unchanged = serializers.IntegerField()
    documents = AppliedDocumentSerializer(many=True)


class ObjectDiffSerializer(serializers.Serializer):
    kind = serializers.CharField()
    name = serializers.CharField()
    diff = serializers.CharField(help_text="unified diff: the object as stored against it as the manifest applies it")


class DiffReportSerializer(serializers.Serializer):
    changed = serializers.BooleanField(help_text="whether applying the manifest would change anything")
    unchanged = serializers.IntegerField(help_text="how many of the objects named would not change")
    diffs = ObjectDiffSerializer(many=True)
