"""Reading manifest documents: the schema of each kind, typed access that collects every problem, and the
errors and results of an apply."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import yaml
from django.core.exceptions import ValidationError
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.pools.manifests.limits import MAX_ISSUES, ManifestLimitError, excerpt, load_all, short, too_large

API_VERSION = "tokenpools.io/v1alpha1"
KINDS = ("Tenant", "TokenPool", "TokenEntitlement")

# The fields each kind accepts (None: a leaf; a one-element list: a list of such items; ANY: free-form).
# Unknown fields are errors, like Kubernetes' strict field validation: a typo must not be ignored silently.
ANY = object()
_METADATA = {"name": None, "labels": ANY, "annotations": ANY}
_QUOTA = {"tokens": None, "amount": None, "currency": None, "window": None, "timezone": None, "onExceeded": None}
SCHEMAS: dict[str, dict[str, Any]] = {
    "Tenant": {
        "apiVersion": None,
        "kind": None,
        "metadata": _METADATA,
        "spec": {"displayName": None, "members": [{"user": None, "role": None}], "quota": _QUOTA},
    },
    "TokenPool": {
        "apiVersion": None,
        "kind": None,
        "metadata": _METADATA,
        "spec": {
            "model": None,
            # objectives: {class: InferenceObjective name} for an llm-d backend (checked by read_objectives).
            "backend": {"kind": None, "replicas": [{"url": None, "enabled": None}], "objectives": ANY},
            "scaling": {"minReplicas": None, "maxReplicas": None},
            "capacityPerReplica": {"slots": None, "tokensPerSecond": None, "kvCacheGiB": None},
            "kvGeometry": {"layers": None, "kvHeads": None, "headDim": None, "bytesPerElement": None},
            "pricing": {"inputPerMillion": None, "outputPerMillion": None, "currency": None},
        },
    },
    "TokenEntitlement": {
        "apiVersion": None,
        "kind": None,
        "metadata": _METADATA,
        "spec": {
            "tenantId": None,
            "poolRef": {"name": None},
            "qos": {"serviceClass": None, "sloTargetMs": None, "queue": {"max": None, "maxWaitMs": None},
                    "spillover": None},
            "resources": {"tokensPerSecond": None, "kvCacheGiB": None, "concurrency": None},
            "limits": {"defaultMaxTokens": None, "queueMax": None},  # queueMax: spec.qos.queue.max's old name
            "quota": _QUOTA,
            "expiresAt": None,
        },
    },
}


def unknown_fields(node: Any, schema: Any, path: str = "") -> list[str]:
    """Paths in ``node`` that ``schema`` does not declare (type errors are reported elsewhere)."""
    if schema is None or schema is ANY:
        return []
    if isinstance(schema, list):
        if not isinstance(node, list):
            return []
        return [p for i, item in enumerate(node) for p in unknown_fields(item, schema[0], f"{path}[{i}]")]
    if not isinstance(node, Mapping):
        return []
    found = []
    for key, value in node.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in schema:
            found.append(where)
        else:
            found.extend(unknown_fields(value, schema[key], where))
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
    "price_input_per_million": "spec.pricing.inputPerMillion",
    "price_output_per_million": "spec.pricing.outputPerMillion",
    "price_currency": "spec.pricing.currency",
    "inference_objectives": "spec.backend.objectives",
}
QUOTA_PATHS = {
    "quota_tokens": "spec.quota.tokens",
    "quota_amount": "spec.quota.amount",
    "quota_currency": "spec.quota.currency",
    "quota_window": "spec.quota.window",
    "quota_timezone": "spec.quota.timezone",
    "quota_on_exceeded": "spec.quota.onExceeded",
}
TENANT_PATHS = {"slug": "metadata.name", "name": "spec.displayName", **QUOTA_PATHS}
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
    "queue_max": "spec.qos.queue.max",
    "queue_max_wait_ms": "spec.qos.queue.maxWaitMs",
    "spillover_class": "spec.qos.spillover",
    "expires_at": "spec.expiresAt",
    **QUOTA_PATHS,
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
    fields: tuple[str, ...] = ()  # when updated: the manifest paths that changed (spec.quota.amount, ...)

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "name": self.name, "action": self.action}


@dataclass(frozen=True)
class EntitlementWarning:
    """An entitlement the apply left Pending or Degraded, with its binding's reason."""

    name: str
    state: str
    reason: str


@dataclass
class ApplyResult:
    documents: list[AppliedDocument] = field(default_factory=list)
    warnings: list[EntitlementWarning] = field(default_factory=list)
    dry_run: bool = False
    # With `compare`: every object named, as stored and as it would be (apps.pools.manifests.diff.ObjectDiff).
    diffs: list[Any] = field(default_factory=list)

    def count(self, action: str) -> int:
        return sum(1 for d in self.documents if d.action == action)

    def summary(self) -> dict[str, int]:
        return {a: self.count(a) for a in ("created", "updated", "unchanged")}


@dataclass
class Plan:
    index: int
    kind: str
    name: str
    values: dict[str, Any]
    replicas: list[dict[str, Any]] | None = None
    existing: Any = None


def changed_paths(before: Mapping[str, Any], after: Mapping[str, Any], paths: Mapping[str, str]) -> tuple[str, ...]:
    """The manifest paths of the model fields whose values differ, in ``paths``' order, each once."""
    found = [paths.get(name, name) for name in paths if name in after and before.get(name) != after[name]]
    found += [name for name in after if name not in paths and before.get(name) != after[name]]
    return tuple(dict.fromkeys(found))


class Collector:
    def __init__(self) -> None:
        self.issues: list[ManifestIssue] = []
        self.forbidden = False

    def add(self, index: int | None, kind: str, name: str, path: str, message: str, forbidden: bool = False) -> None:
        self.forbidden = self.forbidden or forbidden
        # Kinds, names and field paths are the author's text: quoted short; past MAX_ISSUES only counted.
        if len(self.issues) < MAX_ISSUES:
            self.issues.append(ManifestIssue(index, short(kind), short(name), short(path), message))
        elif len(self.issues) == MAX_ISSUES:
            self.issues.append(ManifestIssue(None, "", "", "", "more problems left out"))


# --- parsing -----------------------------------------------------------------------------------------


def manifests_parse(text: str) -> list[Any]:
    """YAML text (one or more ``---`` separated documents) -> list of documents; empty documents dropped.

    Bounded (``apps.pools.manifests.limits``): size, depth and node count; YAML aliases are refused."""
    problem = too_large(len(text.encode("utf-8", "surrogatepass")))
    if problem:
        raise ManifestError([ManifestIssue(None, "", "", "", problem)])
    try:
        docs = [d for d in load_all(text) if d is not None]
    except ManifestLimitError as exc:
        raise ManifestError([ManifestIssue(exc.index, "", "", "", exc.message)]) from exc
    except yaml.YAMLError as exc:
        # PyYAML's messages quote a snippet of one line (~75 characters) at most; the cut is a backstop.
        raise ManifestError([ManifestIssue(None, "", "", "", short(f"malformed YAML: {exc}", 1000))]) from exc
    except (ValueError, OverflowError) as exc:  # a value YAML's constructors cannot build: 2024-13-45, 10**5000
        raise ManifestError([ManifestIssue(None, "", "", "", short(f"malformed YAML: {exc}", 200))]) from exc
    if not docs:
        raise ManifestError([ManifestIssue(None, "", "", "", "no documents found")])
    return docs


class Reader:
    """Typed access to nested manifest values that records every problem instead of raising."""

    def __init__(self, doc: Mapping[str, Any], index: int, kind: str, name: str, errors: Collector) -> None:
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
        self._fail(path, f"must be a string, got {excerpt(value)}")
        return None

    def integer(self, path: str, required: bool = True, default: int | None = None,
                minimum: int = 1) -> int | None:
        value = self.get(path, default, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self._fail(path, f"must be an integer, got {excerpt(value)}")
            return None
        if value < minimum:
            self._fail(path, f"must be positive, got {value}" if minimum == 1 else f"must be at least {minimum}, got {value}")
            return None
        return value

    def decimal(self, path: str, required: bool = True, allow_zero: bool = False, places: int = 3) -> Decimal | None:
        value = self.get(path, None, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            self._fail(path, f"must be a number, got {excerpt(value)}")
            return None
        try:
            number = Decimal(str(value))
        except InvalidOperation:
            self._fail(path, f"must be a number, got {excerpt(value)}")
            return None
        if not number.is_finite() or number < 0 or (number == 0 and not allow_zero):
            self._fail(path, f"must be {'zero or more' if allow_zero else 'positive'}, got {short(str(value))}")
            return None
        try:
            exact = number == number.quantize(Decimal(1).scaleb(-places))
        except InvalidOperation:  # too many digits to quantize (1e999999): no column holds it either
            self._fail(path, f"is out of range, got {short(str(value))}")
            return None
        if not exact:
            self._fail(path, f"at most {places} decimal places")
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
            self._fail(path, f"must be an ISO 8601 date-time, got {excerpt(value)}")
            return None
        if timezone.is_naive(parsed):
            parsed = timezone.make_aware(parsed, dt.UTC)
        return parsed


def model_errors(exc: ValidationError, paths: Mapping[str, str]) -> list[tuple[str, str]]:
    out = []
    for name, messages in exc.message_dict.items():
        for message in messages:
            out.append((paths.get(name, name), message))
    return out
