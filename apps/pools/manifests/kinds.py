"""Each kind's document read into the fields of its model (errors collected by the reader)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError

from apps.policy import ServiceClass
from apps.policy.quota import QUOTA_WINDOWS
from apps.pools.manifests.limits import excerpt
from apps.pools.manifests.reader import Reader, model_errors
from apps.pools.models import K8S_NAME, QUEUE_WAIT_MAX_MS, BackendKind, spillover_error
from apps.pools.services import _clean_replicas
from apps.tenancy.models import Role
from apps.tenancy.quota import on_exceeded_error


def read_quota(r: Reader) -> dict[str, Any]:
    """`spec.quota` ({tokens | amount + currency, window, timezone}) as the quota fields; absent: none."""
    none: dict[str, Any] = {"quota_tokens": None, "quota_amount": None, "quota_currency": "", "quota_window": "",
                            "quota_timezone": "UTC", "quota_on_exceeded": "reject"}
    if r.get("spec.quota") is None:
        return none
    tokens = r.integer("spec.quota.tokens", required=False)
    amount = r.decimal("spec.quota.amount", required=False, places=4)
    window = r.string("spec.quota.window")
    if window is not None and window not in QUOTA_WINDOWS:
        r._fail("spec.quota.window", f"unknown window {excerpt(window)}; one of {', '.join(QUOTA_WINDOWS)}")
    if r.get("spec.quota.tokens") is None and r.get("spec.quota.amount") is None:
        r._fail("spec.quota", "needs tokens, or an amount and a currency")
    # What a used-up quota does: reject (the default) or spot (served as spot until the window resets).
    on_exceeded = r.string("spec.quota.onExceeded", required=False, default="reject")
    problem = None if on_exceeded is None else on_exceeded_error(on_exceeded)
    if problem:
        r._fail("spec.quota.onExceeded", problem)
    return {"quota_on_exceeded": on_exceeded or "reject", "quota_tokens": tokens, "quota_amount": amount,
            "quota_currency": r.string("spec.quota.currency", required=False, default="") or "",
            "quota_window": window or "", "quota_timezone": r.string("spec.quota.timezone", required=False,
                                                                     default="UTC") or "UTC"}


def read_pricing(r: Reader) -> dict[str, Any]:
    if r.get("spec.pricing") is None:
        return {"price_input_per_million": None, "price_output_per_million": None, "price_currency": ""}
    return {
        "price_input_per_million": r.decimal("spec.pricing.inputPerMillion", allow_zero=True, places=6),
        "price_output_per_million": r.decimal("spec.pricing.outputPerMillion", allow_zero=True, places=6),
        "price_currency": r.string("spec.pricing.currency") or "",
    }


def read_tenant(r: Reader) -> dict[str, Any]:
    members: list[dict[str, str]] | None = None
    raw = r.get("spec.members")
    if raw is not None:
        members = []
        if not isinstance(raw, list):
            r._fail("spec.members", "must be a list of {user, role}")
        else:
            for index, item in enumerate(raw):
                where = f"spec.members[{index}]"
                if not isinstance(item, dict) or not isinstance(item.get("user"), str) or not item["user"]:
                    r._fail(f"{where}.user", "is required (a username)")
                    continue
                role = item.get("role", "member")
                if role not in Role.values:
                    r._fail(f"{where}.role", f"unknown role {excerpt(role)}; one of {', '.join(Role.values)}")
                    continue
                if any(m["user"] == item["user"] for m in members):
                    r._fail(f"{where}.user", f"user {excerpt(item['user'])} is listed twice")
                    continue
                members.append({"user": item["user"], "role": role})
    return {"name": r.string("spec.displayName", required=False, default=r.name) or r.name,
            "members": members, **read_quota(r)}


def read_pool(r: Reader) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    backend_kind = r.string("spec.backend.kind", required=False, default=str(BackendKind.VLLM))
    if backend_kind is not None and backend_kind not in BackendKind.values:
        r._fail("spec.backend.kind", f"unknown backend kind {excerpt(backend_kind)}; one of {', '.join(BackendKind.values)}")
    raw_replicas = r.get("spec.backend.replicas", [])
    replicas: list[dict[str, Any]] = []
    if not isinstance(raw_replicas, list):
        r._fail("spec.backend.replicas", "must be a list of {url, enabled}")
    else:
        try:
            replicas = _clean_replicas(raw_replicas)
        except ValidationError as exc:
            for _f, message in model_errors(exc, {}):
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
        **read_pricing(r),
        "inference_objectives": read_objectives(r),
    }
    return values, replicas


def read_objectives(r: Reader) -> dict[str, str]:
    """`spec.backend.objectives`: the InferenceObjective name of each served class ({guaranteed: NAME}) handed
    to an llm-d backend; a class left out gets `tokenpools-<class>`. Absent: {}."""
    raw = r.get("spec.backend.objectives")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        r._fail("spec.backend.objectives", f"must be a mapping of service class to InferenceObjective name, got "
                f"{excerpt(raw)}")
        return {}
    known = [str(cls) for cls in ServiceClass]
    objectives: dict[str, str] = {}
    for name, objective in raw.items():
        where = f"spec.backend.objectives.{name}"
        if name not in known:
            r._fail(where, f"unknown service class {excerpt(name)}; one of {', '.join(known)}")
        elif not isinstance(objective, str) or not K8S_NAME.match(objective):
            r._fail(where, f"{excerpt(objective)} is not a Kubernetes object name: lower-case letters, digits, '-' "
                    "and '.', at most 253 characters, starting and ending with a letter or digit")
        else:
            objectives[name] = objective
    return objectives


def read_queue(r: Reader) -> dict[str, Any]:
    """`spec.qos.queue` ({max, maxWaitMs}); `spec.limits.queueMax` is the old name of `max`, still read.
    Absent: the service class's default (None)."""
    size = r.integer("spec.qos.queue.max", required=False, minimum=0)
    old = r.integer("spec.limits.queueMax", required=False, minimum=0)
    if size is not None and old is not None and size != old:
        r._fail("spec.qos.queue.max", f"is {size} but spec.limits.queueMax (its old name) is {old}; give one")
    wait = r.integer("spec.qos.queue.maxWaitMs", required=False, minimum=0)
    if wait is not None and wait > QUEUE_WAIT_MAX_MS:
        r._fail("spec.qos.queue.maxWaitMs", f"must be at most {QUEUE_WAIT_MAX_MS} (10 minutes), got {wait}")
        wait = None
    return {"queue_max": old if size is None else size, "queue_max_wait_ms": wait}


def read_spillover(r: Reader, service_class: str | None) -> str:
    """`spec.qos.spillover`: the lower class the entitlement's overflow is served as (elastic, spot or
    preemptible; only from dedicated, guaranteed or elastic). Absent: none ("")."""
    spillover = r.string("spec.qos.spillover", required=False, default="") or ""
    if not spillover:
        return ""
    # An unknown class, a class that is not lower, or an entitlement that may not spill over (the model's
    # rule, one message for apply, REST and the form); an unknown serviceClass has its own error.
    if spillover not in {str(cls) for cls in ServiceClass}:  # quoted short: the author's text
        r._fail("spec.qos.spillover", f"unknown class {excerpt(spillover)}; one of elastic, spot, preemptible")
        return ""
    problem = spillover_error(service_class or "", spillover)
    if problem:
        r._fail("spec.qos.spillover", problem)
    return spillover


def read_entitlement(r: Reader) -> dict[str, Any]:
    service_class = r.string("spec.qos.serviceClass")
    known = [str(cls) for cls in ServiceClass]
    if service_class is not None and service_class not in known:
        r._fail("spec.qos.serviceClass", f"unknown service class {excerpt(service_class)}; one of {', '.join(known)}")
    return {
        "tenant_slug": r.string("spec.tenantId"),
        "pool_name": r.string("spec.poolRef.name"),
        "service_class": service_class,
        "slo_target_ms": r.integer("spec.qos.sloTargetMs"),
        "tokens_per_second": r.integer("spec.resources.tokensPerSecond"),
        "kv_cache_gib": r.decimal("spec.resources.kvCacheGiB"),
        "concurrency": r.integer("spec.resources.concurrency"),
        "default_max_tokens": r.integer("spec.limits.defaultMaxTokens", required=False),
        **read_queue(r),
        "spillover_class": read_spillover(r, service_class if service_class in known else None),
        "expires_at": r.timestamp("spec.expiresAt"),
        **read_quota(r),
    }
