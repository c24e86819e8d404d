"""GitOps manifests: apply and export ``Tenant``, ``TokenPool`` and ``TokenEntitlement`` documents.

``apiVersion: tokenpools.io/v1alpha1``. The entitlement is the seed's section 4.2 shape (``tenantId`` is
a tenant slug) plus optional ``spec.expiresAt``, ``spec.limits.defaultMaxTokens``, ``spec.qos.queue``
({max, maxWaitMs}: the entitlement's own queue, each absent for the class default; ``spec.limits.queueMax``
is still read as ``max``'s old name), ``spec.qos.spillover`` (elastic|spot|preemptible: a lower class the
overflow is served as; from dedicated, guaranteed or elastic only) and ``spec.quota`` ({tokens | amount +
currency, window: hour|day|month, timezone, onExceeded: reject|spot}; tenants' quotas too). A ``Tenant`` declares the tenant itself (``apps.pools.manifests.tenants``). The
pool extends the seed's shape so that capacity (and, optionally, prices per million tokens) is declared::

    kind: TokenPool
    metadata: {name: qwen3-8b}
    spec:
      model: Qwen/Qwen3-8B
      backend: {kind: vllm, replicas: [{url: "http://127.0.0.1:8001", enabled: true}]}
      # or an llm-d inference gateway, with the InferenceObjective of each served class (default
      # tokenpools-<class>; `manage.py export --inference-objectives POOL` writes them):
      # backend: {kind: llm-d, replicas: [{url: "http://gateway"}], objectives: {guaranteed: premium}}
      scaling: {minReplicas: 1, maxReplicas: 10}
      capacityPerReplica: {slots: 16, tokensPerSecond: 240, kvCacheGiB: 20}
      kvGeometry: {layers: 36, kvHeads: 8, headDim: 128, bytesPerElement: 2}
      pricing: {inputPerMillion: 0.15, outputPerMillion: 0.60, currency: USD}

Applying validates every document first and writes nothing if any is wrong (errors name the document
index, kind, name and field); then all documents are written in one transaction, tenants before pools
before entitlements, in any document order. Applying is idempotent: each document is reported created, updated
(with the manifest paths that changed) or unchanged, and entitlements left Pending or Degraded are listed with
their reason; ``dry_run`` rolls it all back. A pool's replica list is declarative (replicas missing from the
document are removed). ``apps.pools.manifests.sources`` reads files, directories and stdin into one manifest.

Input is bounded (``apps.pools.manifests.limits``): ``MANIFEST_MAX_BYTES`` per manifest, 32 levels of nesting,
200,000 values, no YAML aliases (refused before anything is expanded); errors quote values as 80-character
excerpts and list at most 100 problems.
"""

from __future__ import annotations

from apps.pools.manifests.apply import _validate, manifests_apply
from apps.pools.manifests.export import entitlement_to_manifest, manifests_export, pool_to_manifest
from apps.pools.manifests.reader import (
    API_VERSION,
    KINDS,
    SCHEMAS,
    AppliedDocument,
    ApplyResult,
    ManifestError,
    ManifestIssue,
    manifests_parse,
)
from apps.pools.manifests.tenants import tenant_to_manifest

__all__ = [
    "API_VERSION",
    "KINDS",
    "SCHEMAS",
    "AppliedDocument",
    "ApplyResult",
    "ManifestError",
    "ManifestIssue",
    "_validate",
    "entitlement_to_manifest",
    "manifests_apply",
    "manifests_export",
    "manifests_parse",
    "pool_to_manifest",
    "tenant_to_manifest",
]
