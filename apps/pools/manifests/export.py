"""`export`: what a user may see, as documents that `apply` takes back as they are (tenants first, then
pools, then entitlements)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import yaml

from apps.pools.manifests.reader import API_VERSION
from apps.pools.manifests.tenants import quota_to_manifest, tenant_to_manifest
from apps.pools.models import TokenEntitlement, TokenPool
from apps.tenancy.models import Tenant
from apps.tenancy.selectors import tenant_list


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
                **({"objectives": dict(sorted(pool.inference_objectives.items()))} if pool.inference_objectives
                   else {}),
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
            **({"pricing": {
                "inputPerMillion": _number(pool.price_input_per_million),
                "outputPerMillion": _number(pool.price_output_per_million),
                "currency": pool.price_currency,
            }} if pool.price_input_per_million is not None and pool.price_output_per_million is not None else {}),
        },
    }


def _queue(ent: TokenEntitlement) -> dict[str, Any]:
    """`queue: {max, maxWaitMs}` with the values set (0 included: a queue of none); none set: no key."""
    queue = {k: v for k, v in (("max", ent.queue_max), ("maxWaitMs", ent.queue_max_wait_ms)) if v is not None}
    return {"queue": queue} if queue else {}


def entitlement_to_manifest(ent: TokenEntitlement) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "tenantId": ent.tenant.slug,
        "poolRef": {"name": ent.pool.name},
        "qos": {"serviceClass": ent.service_class, "sloTargetMs": ent.slo_target_ms, **_queue(ent),
                **({"spillover": ent.spillover_class} if ent.spillover_class else {})},
        "resources": {
            "tokensPerSecond": ent.tokens_per_second,
            "kvCacheGiB": _number(ent.kv_cache_gib),
            "concurrency": ent.concurrency,
        },
    }
    if ent.default_max_tokens:
        spec["limits"] = {"defaultMaxTokens": ent.default_max_tokens}
    if ent.has_quota:
        spec["quota"] = quota_to_manifest(ent)
    if ent.expires_at is not None:
        spec["expiresAt"] = ent.expires_at.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
    return {"apiVersion": API_VERSION, "kind": "TokenEntitlement", "metadata": {"name": ent.name}, "spec": spec}


def manifests_export(*, user: Any, tenant: Tenant | None = None) -> str:
    """Every tenant, pool and entitlement the user may see (optionally one tenant's) as multi-document YAML.

    Tenants and pools come first so the output applies as is. With a tenant, only the pools its
    entitlements use.
    """
    from apps.pools.selectors import entitlement_list, pool_list

    ents = list(entitlement_list(user=user, tenant=tenant).order_by("name"))
    pools = pool_list(user=user).order_by("name")
    if tenant is not None:
        pools = pools.filter(pk__in={e.pool_id for e in ents})
    tenants = tenant_list(user=user) if tenant is None else Tenant.objects.filter(pk=tenant.pk)
    docs = ([tenant_to_manifest(t) for t in tenants.order_by("slug")] + [pool_to_manifest(p) for p in pools]
            + [entitlement_to_manifest(e) for e in ents])
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)
