"""Manifest documents for tests and benchmarks: a pool on the project's tiny model and entitlements on it."""

from __future__ import annotations


def tiny_pool(name: str, backend_url: str, *, slots: int = 16, tokens_per_second: int = 1_000_000,
              kv_cache_gib: float = 1, bytes_per_element: int = 4, model: str | None = None) -> str:
    """A one-replica vLLM pool whose KV geometry is the tiny model's (4 layers, 2 KV heads of 64)."""
    return f"""
apiVersion: tokenpools.io/v1alpha1
kind: TokenPool
metadata: {{name: {name}}}
spec:
  model: {model or name}
  backend: {{kind: vllm, replicas: [{{url: "{backend_url}"}}]}}
  scaling: {{minReplicas: 1, maxReplicas: 1}}
  capacityPerReplica: {{slots: {slots}, tokensPerSecond: {tokens_per_second}, kvCacheGiB: {kv_cache_gib}}}
  kvGeometry: {{layers: 4, kvHeads: 2, headDim: 64, bytesPerElement: {bytes_per_element}}}
"""


def entitlement(name: str, *, tenant: str, pool: str, service_class: str, concurrency: int,
                tokens_per_second: int = 200_000, kv_cache_gib: float = 0.25, slo_target_ms: int = 2000,
                queue_max: int | None = None) -> str:
    """A TokenEntitlement document; `queue_max` sets its own queue's size (None: the class's default)."""
    queue = "" if queue_max is None else f", queue: {{max: {queue_max}}}"
    return f"""
apiVersion: tokenpools.io/v1alpha1
kind: TokenEntitlement
metadata: {{name: {name}}}
spec:
  tenantId: {tenant}
  poolRef: {{name: {pool}}}
  qos: {{serviceClass: {service_class}, sloTargetMs: {slo_target_ms}{queue}}}
  resources: {{tokensPerSecond: {tokens_per_second}, kvCacheGiB: {kv_cache_gib}, concurrency: {concurrency}}}
"""


def documents(*parts: str) -> str:
    return "---".join(parts)
