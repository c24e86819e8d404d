"""GitOps manifests: apply and export ``TokenPool`` and ``TokenEntitlement`` documents.

``apiVersion: tokenpools.io/v1alpha1``. The entitlement is the seed's section 4.2 shape (``tenantId`` is
a tenant slug) plus optional ``spec.expiresAt`` and ``spec.limits.{defaultMaxTokens, queueMax}``. The pool
extends the seed's shape so that capacity is declared::

    kind: TokenPool
    metadata: {name: qwen3-8b}
    spec:
      model: Qwen/Qwen3-8B
      backend: {kind: vllm, replicas: [{url: "http://127.0.0.1:8001", enabled: true}]}
      scaling: {minReplicas: 1, maxReplicas: 10}
      capacityPerReplica: {slots: 16, tokensPerSecond: 240, kvCacheGiB: 20}
      kvGeometry: {layers: 36, kvHeads: 8, headDim: 128, bytesPerElement: 2}

Applying validates every document first and writes nothing if any is wrong (errors name the document
index, kind, name and field); then all documents are written in one transaction, pools before
entitlements. Applying is idempotent: each document is reported created, updated or unchanged. A pool's
replica list is declarative (replicas missing from the document are removed).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import yaml
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.policy import ServiceClass
from apps.pools.models import BackendKind, TokenEntitlement, TokenPool
from apps.pools.services import (
    _check_pool,
    _clean_replicas,
    entitlement_create,
    entitlement_update,
    pool_create,
    pool_update,
)
from apps.tenancy.models import Tenant
from apps.tenancy.selectors import tenant_list, user_role

API_VERSION = "tokenpools.io/v1alpha1"
KINDS = ("TokenPool", "TokenEntitlement")

# The fields each kind accepts (None: a leaf; a one-element list: a list of such items; ANY: free-form).
# Unknown fields are errors, like Kubernetes' strict field validation: a typo must not be ignored silently.
ANY = object()
_METADATA = {"name": None, "labels": ANY, "annotations": ANY}
SCHEMAS: dict[str, dict[str, Any]] = {
    "TokenPool": {
        "apiVersion": None,
        "kind": None,
        "metadata": _METADATA,
        "spec": {
            "model": None,
            "backend": {"kind": None, "replicas": [{"url": None, "enabled": None}]},
            "scaling": {"minReplicas": None, "maxReplicas": None},
            "capacityPerReplica": {"slots": None, "tokensPerSecond": None, "kvCacheGiB": None},
            "kvGeometry": {"layers": None, "kvHeads": None, "headDim": None, "bytesPerElement": None},
        },
    },
    "TokenEntitlement": {
        "apiVersion": None,
        "kind": None,
        "metadata": _METADATA,
        "spec": {
            "tenantId": None,
            "poolRef": {"name": None},
            "qos": {"serviceClass": None, "sloTargetMs": None},
            "resources": {"tokensPerSecond": None, "kvCacheGiB": None, "concurrency": None},
            "limits": {"defaultMaxTokens": None, "queueMax": None},
            "expiresAt": None,
        },
    },
}


def _unknown_fields(node: Any, schema: Any, path: str = "") -> list[str]:
    """Paths in ``node`` that ``schema`` does not declare (type errors are reported elsewhere)."""
    if schema is None or schema is ANY:
        return []
    if isinstance(schema, list):
        if not isinstance(node, list):
            return []
        return [p for i, item in enumerate(node) for p in _unknown_fields(item, schema[0], f"{path}[{i}]")]
    if not isinstance(node, Mapping):
        return []
    found = []
    for key, value in node.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in schema:
            found.append(where)
        else:
            found.extend(_unknown_fields(value, schema[key], where))
    return found

# Model field -> manifest path, to report model validation errors where the author wrote the value.
POOL_PATHS = {
    "name": "metadata.name",
    "model_name": "spec.model",
    "backend_kind": "spec.backend.kind",
    "replicas": "spec.backend.replicas",
    "min_replicas": "spec.scaling.minReplicas",
    "max_replicas": "spec.scaling.maxReplicas",
    "slots_per_replica": "spec.capacityPerReplica.slots",
    "tokens_per_second_per_replica": "spec.capacityPerReplica.tokensPerSecond",
    "kv_cache_gib_per_replica": "spec.capacityPerReplica.kvCacheGiB",
    "kv_layers": "spec.kvGeometry.layers",
    "kv_heads": "spec.kvGeometry.kvHeads",
    "head_dim": "spec.kvGeometry.headDim",
    "bytes_per_element": "spec.kvGeometry.bytesPerElement",
}
ENTITLEMENT_PATHS = {
    "name": "metadata.name",
    "tenant": "spec.tenantId",
    "pool": "spec.poolRef.name",
    "service_class": "spec.qos.serviceClass",
    "slo_target_ms": "spec.qos.sloTargetMs",
    "tokens_per_second": "spec.resources.tokensPerSecond",
    "kv_cache_gib": "spec.resources.kvCacheGiB",
    "concurrency": "spec.resources.concurrency",
    "default_max_tokens": "spec.limits.defaultMaxTokens",
    "queue_max": "spec.limits.queueMax",
    "expires_at": "spec.expiresAt",
}


@dataclass(frozen=True)
class ManifestIssue:
    index: int | None
    kind: str
    name: str
    field: str
    message: str

    def __str__(self) -> str:
        where = f"document {self.index}" if self.index is not None else "manifest"
        what = " ".join(part for part in (self.kind, repr(self.name) if self.name else "") if part)
        loc = f"{where} ({what})" if what else where
        return f"{loc}: {self.field}: {self.message}" if self.field else f"{loc}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "name": self.name, "field": self.field, "message": self.message}


class ManifestError(Exception):
    """Invalid manifest: nothing was written. ``forbidden`` when a document needs rights the actor lacks."""

    def __init__(self, issues: list[ManifestIssue], forbidden: bool = False) -> None:
        super().__init__("\n".join(str(i) for i in issues))
        self.issues = issues
        self.forbidden = forbidden


@dataclass(frozen=True)
class AppliedDocument:
    index: int
    kind: str
    name: str
    action: str  # "created" | "updated" | "unchanged"

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "name": self.name, "action": self.action}


@dataclass
class ApplyResult:
    documents: list[AppliedDocument] = field(default_factory=list)

    def count(self, action: str) -> int:
        return sum(1 for d in self.documents if d.action == action)

    def summary(self) -> dict[str, int]:
        return {a: self.count(a) for a in ("created", "updated", "unchanged")}


@dataclass
class _Plan:
    index: int
    kind: str
    name: str
    values: dict[str, Any]
    replicas: list[dict[str, Any]] | None = None
    existing: Any = None


class _Collector:
    def __init__(self) -> None:
        self.issues: list[ManifestIssue] = []
        self.forbidden = False

    def add(self, index: int | None, kind: str, name: str, path: str, message: str, forbidden: bool = False) -> None:
        self.issues.append(ManifestIssue(index, kind, name, path, message))
        self.forbidden = self.forbidden or forbidden


# --- parsing -----------------------------------------------------------------------------------------


def manifests_parse(text: str) -> list[Any]:
    """YAML text (one or more ``---`` separated documents) -> list of documents; empty documents dropped."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError([ManifestIssue(None, "", "", "", f"malformed YAML: {exc}")]) from exc
    if not docs:
        raise ManifestError([ManifestIssue(None, "", "", "", "no documents found")])
    return docs


class _Reader:
    """Typed access to nested manifest values that records every problem instead of raising."""

    def __init__(self, doc: Mapping[str, Any], index: int, kind: str, name: str, errors: _Collector) -> None:
        self.doc, self.index, self.kind, self.name, self.errors = doc, index, kind, name, errors

    def _fail(self, path: str, message: str) -> None:
        self.errors.add(self.index, self.kind, self.name, path, message)

    def get(self, path: str, default: Any = None, required: bool = False) -> Any:
        node: Any = self.doc
        walked: list[str] = []
        for part in path.split("."):
            if node is None:
                break
            if not isinstance(node, Mapping):
                self._fail(".".join(walked), "must be a mapping")
                return default
            walked.append(part)
            node = node.get(part)
        if node is None:
            if required:
                self._fail(path, "is required")
            return default
        return node

    def string(self, path: str, required: bool = True, default: str | None = None) -> str | None:
        value = self.get(path, default, required)
        if value is None or isinstance(value, str):
            return value
        self._fail(path, f"must be a string, got {value!r}")
        return None

    def integer(self, path: str, required: bool = True, default: int | None = None,
                minimum: int = 1) -> int | None:
        value = self.get(path, default, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self._fail(path, f"must be an integer, got {value!r}")
            return None
        if value < minimum:
            self._fail(path, f"must be positive, got {value}" if minimum == 1 else f"must be at least {minimum}, got {value}")
            return None
        return value

    def decimal(self, path: str, required: bool = True) -> Decimal | None:
        value = self.get(path, None, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            self._fail(path, f"must be a number, got {value!r}")
            return None
        try:
            number = Decimal(str(value))
        except InvalidOperation:
            self._fail(path, f"must be a number, got {value!r}")
            return None
        if not number.is_finite() or number <= 0:
            self._fail(path, f"must be positive, got {value}")
            return None
        if number != number.quantize(Decimal("0.001")):
            self._fail(path, "at most 3 decimal places")
            return None
        return number

    def timestamp(self, path: str) -> dt.datetime | None:
        value = self.get(path)
        if value is None:
            return None
        if isinstance(value, dt.datetime):
            parsed: dt.datetime | None = value
        elif isinstance(value, str):
            try:
                parsed = parse_datetime(value)
            except ValueError:
                parsed = None
        else:
            parsed = None
        if parsed is None:
            self._fail(path, f"must be an ISO 8601 date-time, got {value!r}")
            return None
        if timezone.is_naive(parsed):
            parsed = timezone.make_aware(parsed, dt.UTC)
        return parsed


def _model_errors(exc: ValidationError, paths: Mapping[str, str]) -> list[tuple[str, str]]:
    out = []
    for name, messages in exc.message_dict.items():
        for message in messages:
            out.append((paths.get(name, name), message))
    return out


def _read_pool(r: _Reader) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    backend_kind = r.string("spec.backend.kind", required=False, default=str(BackendKind.VLLM))
    if backend_kind is not None and backend_kind not in BackendKind.values:
        r._fail("spec.backend.kind", f"unknown backend kind {backend_kind!r}; one of {', '.join(BackendKind.values)}")
    raw_replicas = r.get("spec.backend.replicas", [])
    replicas: list[dict[str, Any]] = []
    if not isinstance(raw_replicas, list):
        r._fail("spec.backend.replicas", "must be a list of {url, enabled}")
    else:
        try:
            replicas = _clean_replicas(raw_replicas)
        except ValidationError as exc:
            for _f, message in _model_errors(exc, {}):
                r._fail("spec.backend.replicas", message)
    values = {
        "model_name": r.string("spec.model"),
        "backend_kind": backend_kind,
        # minReplicas 0: the pool may scale to zero (the autoscaler's business; capacity is then zero).
        "min_replicas": r.integer("spec.scaling.minReplicas", required=False, default=1, minimum=0),
        "max_replicas": r.integer("spec.scaling.maxReplicas", required=False, default=max(1, len(replicas))),
        "slots_per_replica": r.integer("spec.capacityPerReplica.slots"),
        "tokens_per_second_per_replica": r.integer("spec.capacityPerReplica.tokensPerSecond"),
        "kv_cache_gib_per_replica": r.decimal("spec.capacityPerReplica.kvCacheGiB"),
        "kv_layers": r.integer("spec.kvGeometry.layers"),
        "kv_heads": r.integer("spec.kvGeometry.kvHeads"),
        "head_dim": r.integer("spec.kvGeometry.headDim"),
        "bytes_per_element": r.integer("spec.kvGeometry.bytesPerElement", required=False, default=2),
    }
    return values, replicas


def _read_entitlement(r: _Reader) -> dict[str, Any]:
    service_class = r.string("spec.qos.serviceClass")
    known = [str(cls) for cls in ServiceClass]
    if service_class is not None and service_class not in known:
        r._fail("spec.qos.serviceClass", f"unknown service class {service_class!r}; one of {', '.join(known)}")
    return {
        "tenant_slug": r.string("spec.tenantId"),
        "pool_name": r.string("spec.poolRef.name"),
        "service_class": service_class,
        "slo_target_ms": r.integer("spec.qos.sloTargetMs"),
        "tokens_per_second": r.integer("spec.resources.tokensPerSecond"),
        "kv_cache_gib": r.decimal("spec.resources.kvCacheGiB"),
        "concurrency": r.integer("spec.resources.concurrency"),
        "default_max_tokens": r.integer("spec.limits.defaultMaxTokens", required=False),
        "queue_max": r.integer("spec.limits.queueMax", required=False),
        "expires_at": r.timestamp("spec.expiresAt"),
    }


# --- validation and apply ----------------------------------------------------------------------------


def _pool_values_of(pool: TokenPool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = {name: getattr(pool, name) for name in POOL_PATHS if name not in ("name", "replicas")}
    replicas = [{"url": r.url, "enabled": r.enabled} for r in pool.replicas.order_by("position", "id")]
    return values, replicas


def _entitlement_values_of(ent: TokenEntitlement) -> dict[str, Any]:
    return {name: getattr(ent, name) for name in ENTITLEMENT_PATHS if name not in ("name", "tenant")}


def _validate(documents: list[Any], actor: Any) -> tuple[list[_Plan], list[_Plan]]:
    errors = _Collector()
    pools: list[_Plan] = []
    entitlements: list[_Plan] = []
    seen: set[tuple[str, str]] = set()
    is_superuser = bool(getattr(actor, "is_superuser", False))
    for index, doc in enumerate(documents):
        if not isinstance(doc, Mapping):
            errors.add(index, "", "", "", "a document must be a mapping")
            continue
        kind: str = doc["kind"] if isinstance(doc.get("kind"), str) else ""
        metadata = doc.get("metadata")
        name: str = metadata["name"] if isinstance(metadata, Mapping) and isinstance(metadata.get("name"), str) else ""
        if doc.get("apiVersion") != API_VERSION:
            errors.add(index, kind, name, "apiVersion", f"must be {API_VERSION!r}, got {doc.get('apiVersion')!r}")
        if kind not in KINDS:
            errors.add(index, kind, name, "kind", f"must be one of {', '.join(KINDS)}, got {doc.get('kind')!r}")
            continue
        if not name:
            errors.add(index, kind, name, "metadata.name", "is required")
            continue
        if (kind, name) in seen:
            errors.add(index, kind, name, "metadata.name", f"duplicate {kind} {name!r} in this manifest")
            continue
        seen.add((kind, name))
        if not isinstance(doc.get("spec"), Mapping):
            errors.add(index, kind, name, "spec", "is required and must be a mapping")
            continue
        for path in _unknown_fields(doc, SCHEMAS[kind]):
            errors.add(index, kind, name, path, "unknown field")
        reader = _Reader(doc, index, kind, name, errors)
        if kind == "TokenPool":
            if not is_superuser:
                errors.add(index, kind, name, "", "only platform operators (superusers) may manage pools", True)
                continue
            values, replicas = _read_pool(reader)
            pools.append(_Plan(index, kind, name, values, replicas, TokenPool.objects.filter(name=name).first()))
        else:
            entitlements.append(_Plan(index, kind, name, _read_entitlement(reader)))
    if errors.issues:
        raise ManifestError(errors.issues, errors.forbidden)

    for plan in pools:
        candidate = plan.existing or TokenPool(name=plan.name)
        if plan.existing is not None:  # validate on a detached copy: the real row changes only when writing
            candidate = TokenPool.objects.get(pk=plan.existing.pk)
        for key, value in plan.values.items():
            setattr(candidate, key, value)
        try:
            _check_pool(candidate, plan.replicas)
        except ValidationError as exc:
            for path, message in _model_errors(exc, POOL_PATHS):
                errors.add(plan.index, plan.kind, plan.name, path, message)

    pool_names_in_file = {p.name for p in pools}
    visible_tenants = {t.slug: t for t in tenant_list(user=actor)}
    for plan in entitlements:
        v = plan.values
        tenant = visible_tenants.get(v["tenant_slug"])
        if tenant is None:
            errors.add(plan.index, plan.kind, plan.name, "spec.tenantId", f"unknown tenant {v['tenant_slug']!r}")
            continue
        if user_role(user=actor, tenant=tenant) != "owner":
            errors.add(plan.index, plan.kind, plan.name, "", f"only owners of tenant {tenant.slug!r} may manage its "
                       "entitlements", True)
            continue
        existing = TokenEntitlement.objects.select_related("tenant").filter(name=plan.name).first()
        if existing is not None and existing.tenant_id != tenant.pk:
            errors.add(plan.index, plan.kind, plan.name, "metadata.name",
                       "an entitlement with this name already exists (entitlements cannot move between tenants)")
            continue
        pool = TokenPool.objects.filter(name=v["pool_name"]).first()
        if pool is None and v["pool_name"] not in pool_names_in_file:
            errors.add(plan.index, plan.kind, plan.name, "spec.poolRef.name", f"unknown pool {v['pool_name']!r}")
            continue
        plan.existing = existing
        plan.values = {
            "tenant": tenant,
            "pool_name": v["pool_name"],
            **{k: val for k, val in v.items() if k not in ("tenant_slug", "pool_name")},
        }
        candidate = TokenEntitlement(name=plan.name, tenant=tenant, pool=pool or TokenPool(name=v["pool_name"]),
                                     **{k: val for k, val in plan.values.items() if k not in ("tenant", "pool_name")})
        try:
            exclude_checks = ["pool"] if pool is None else []
            candidate.full_clean(exclude=["state", "state_reason", "state_changed_at", *exclude_checks],
                                 validate_unique=existing is None)
        except ValidationError as exc:
            for path, message in _model_errors(exc, ENTITLEMENT_PATHS):
                errors.add(plan.index, plan.kind, plan.name, path, message)
    if errors.issues:
        raise ManifestError(errors.issues, errors.forbidden)
    return pools, entitlements


def manifests_apply(*, actor: Any, documents: list[Any] | str, now: dt.datetime | None = None) -> ApplyResult:
    """Validate all documents, then write them in one transaction; raises ManifestError with nothing written.

    ``documents`` is YAML text or already-parsed documents. Pools need a superuser; entitlements an owner
    of the tenant named by ``tenantId`` (an unknown or invisible tenant is reported as unknown).
    """
    if isinstance(documents, str):
        documents = manifests_parse(documents)
    if not isinstance(documents, list):
        raise ManifestError([ManifestIssue(None, "", "", "", "expected a list of documents")])
    now = now or timezone.now()
    result = ApplyResult()
    try:
        with transaction.atomic():
            pool_plans, ent_plans = _validate(documents, actor)
            actions: dict[int, AppliedDocument] = {}
            for plan in pool_plans:
                if plan.existing is None:
                    pool_create(actor=actor, name=plan.name, replicas=plan.replicas or [], now=now, **plan.values)
                    action = "created"
                elif _pool_values_of(plan.existing) == (plan.values, plan.replicas):
                    action = "unchanged"
                else:
                    pool_update(actor=actor, pool=plan.existing, replicas=plan.replicas, now=now, **plan.values)
                    action = "updated"
                actions[plan.index] = AppliedDocument(plan.index, plan.kind, plan.name, action)
            for plan in ent_plans:
                values = dict(plan.values)
                tenant = values.pop("tenant")
                values["pool"] = TokenPool.objects.get(name=values.pop("pool_name"))
                if plan.existing is None:
                    entitlement_create(actor=actor, name=plan.name, tenant=tenant, now=now, **values)
                    action = "created"
                elif _entitlement_values_of(plan.existing) == values:
                    action = "unchanged"
                else:
                    entitlement_update(actor=actor, entitlement=plan.existing, now=now, **values)
                    action = "updated"
                actions[plan.index] = AppliedDocument(plan.index, plan.kind, plan.name, action)
            result.documents = [actions[i] for i in sorted(actions)]
    except ValidationError as exc:  # a concurrent writer changed something between validation and write
        raise ManifestError([ManifestIssue(None, "", "", f, m) for f, m in _model_errors(exc, {})]) from exc
    except PermissionDenied as exc:
        raise ManifestError([ManifestIssue(None, "", "", "", str(exc))], forbidden=True) from exc
    return result


# --- export ------------------------------------------------------------------------------------------


def _number(value: Decimal) -> int | float:
    return int(value) if value == value.to_integral_value() else float(value)


def pool_to_manifest(pool: TokenPool) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "TokenPool",
        "metadata": {"name": pool.name},
        "spec": {
            "model": pool.model_name,
            "backend": {
                "kind": pool.backend_kind,
                "replicas": [{"url": r.url, "enabled": r.enabled} for r in pool.replicas.order_by("position", "id")],
            },
            "scaling": {"minReplicas": pool.min_replicas, "maxReplicas": pool.max_replicas},
            "capacityPerReplica": {
                "slots": pool.slots_per_replica,
                "tokensPerSecond": pool.tokens_per_second_per_replica,
                "kvCacheGiB": _number(pool.kv_cache_gib_per_replica),
            },
            "kvGeometry": {
                "layers": pool.kv_layers,
                "kvHeads": pool.kv_heads,
                "headDim": pool.head_dim,
                "bytesPerElement": pool.bytes_per_element,
            },
        },
    }


def entitlement_to_manifest(ent: TokenEntitlement) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "tenantId": ent.tenant.slug,
        "poolRef": {"name": ent.pool.name},
        "qos": {"serviceClass": ent.service_class, "sloTargetMs": ent.slo_target_ms},
        "resources": {
            "tokensPerSecond": ent.tokens_per_second,
            "kvCacheGiB": _number(ent.kv_cache_gib),
            "concurrency": ent.concurrency,
        },
    }
    limits = {k: v for k, v in (("defaultMaxTokens", ent.default_max_tokens), ("queueMax", ent.queue_max)) if v}
    if limits:
        spec["limits"] = limits
    if ent.expires_at is not None:
        spec["expiresAt"] = ent.expires_at.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
    return {"apiVersion": API_VERSION, "kind": "TokenEntitlement", "metadata": {"name": ent.name}, "spec": spec}


def manifests_export(*, user: Any, tenant: Tenant | None = None) -> str:
    """Every pool and every entitlement the user may see (optionally one tenant's) as multi-document YAML.

    Pools come first so the output applies as is. With a tenant, only the pools its entitlements use.
    """
    from apps.pools.selectors import entitlement_list, pool_list

    ents = list(entitlement_list(user=user, tenant=tenant).order_by("name"))
    pools = pool_list(user=user).order_by("name")
    if tenant is not None:
        pools = pools.filter(pk__in={e.pool_id for e in ents})
    docs = [pool_to_manifest(p) for p in pools] + [entitlement_to_manifest(e) for e in ents]
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)
