"""The InferenceObjective manifests of an llm-d pool (``manage.py export --inference-objectives POOL``).

The gateway hands an llm-d inference gateway the served class's InferenceObjective name on every request
(``x-gateway-inference-objective``); these documents create those objectives, one per service class, so that
llm-d's flow control orders and sheds the classes as tokenpools does: dedicated and guaranteed above the
default, elastic at it, spot and preemptible below it (llm-d sheds negative priorities first under load).

The schema is the Gateway API Inference Extension's (``inference.networking.x-k8s.io/v1alpha2``, kind
``InferenceObjective``: ``spec.priority``, higher served first, unset is 0; ``spec.poolRef`` names an
InferencePool in the same namespace, group ``inference.networking.k8s.io``).
"""

from __future__ import annotations

from typing import Any

import yaml

from apps.policy import ServiceClass
from apps.pools.models import TokenPool

OBJECTIVE_API_VERSION = "inference.networking.x-k8s.io/v1alpha2"
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
# Each class's priority: positive for the reserved classes (dedicated highest), 0 for elastic (llm-d's default
# for a request without an objective), negative for the classes llm-d may shed (preemptible lowest).
OBJECTIVE_PRIORITY: dict[ServiceClass, int] = {
    ServiceClass.DEDICATED: 100,
    ServiceClass.GUARANTEED: 50,
    ServiceClass.ELASTIC: 0,
    ServiceClass.SPOT: -50,
    ServiceClass.PREEMPTIBLE: -100,
}


def objective_name(pool: TokenPool, service_class: str) -> str:
    """The InferenceObjective name of a class on `pool`: its map, else `tokenpools-<class>` (the rule of the
    gateway's PoolInfo.objective_for)."""
    return str((pool.inference_objectives or {}).get(service_class) or f"tokenpools-{service_class}")


def objective_manifests(pool: TokenPool, *, inference_pool: str | None = None,
                        namespace: str | None = None) -> list[dict[str, Any]]:
    """One InferenceObjective per service class, highest priority first; `poolRef` names `inference_pool`
    (default: the pool's own name)."""
    metadata_extra = {"namespace": namespace} if namespace else {}
    docs = []
    for cls in ServiceClass:
        docs.append({
            "apiVersion": OBJECTIVE_API_VERSION,
            "kind": "InferenceObjective",
            "metadata": {"name": objective_name(pool, cls.value), **metadata_extra,
                         "labels": {"tokenpools.io/pool": pool.name, "tokenpools.io/service-class": cls.value}},
            "spec": {
                "priority": OBJECTIVE_PRIORITY[cls],
                "poolRef": {"group": INFERENCE_POOL_GROUP, "kind": "InferencePool",
                            "name": inference_pool or pool.name},
            },
        })
    return docs


def objectives_export(pool: TokenPool, *, inference_pool: str | None = None, namespace: str | None = None) -> str:
    """`objective_manifests` as multi-document YAML."""
    docs = objective_manifests(pool, inference_pool=inference_pool, namespace=namespace)
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)
