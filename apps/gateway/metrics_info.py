"""Gauges that describe what the gateway serves, for dashboards (deploy/grafana/tokenpools.json, issue 28).

The request counters say what was served; these say what was promised and where it runs, so a dashboard can
draw one against the other without a second data source:

- `tokenpools_entitlement_info{tenant,pool,entitlement,service_class} 1`: the tenant (slug) and class of
  each entitlement (every per-entitlement series carries `tenant` and `pool` itself: the join is needed
  only for the class).
- `tokenpools_entitlement_tokens_per_second{tenant,pool,entitlement}`: the entitled rate (served against
  entitled).
- `tokenpools_entitlement_slo_ttft_seconds{tenant,pool,entitlement}`: the TTFT target (TTFT against the SLO).
- `tokenpools_replica_healthy{pool,replica}` and `tokenpools_replica_kv_usage{pool,replica}`: each replica's
  health as the gateway sees it and the KV cache use (0..1) its vLLM metrics reported last.

All are read at scrape time from the snapshot and the replica sets the gateway already holds: nothing per
request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from apps.gateway.app import Gateway

Series = dict[tuple[str, ...], float]


def owners(gateway: Gateway) -> Mapping[str, tuple[str, str]]:
    """entitlement -> (tenant slug, pool) of the current snapshot: the `tenant` and `pool` labels of every
    per-entitlement series (`GatewayMetrics.owners_source`)."""
    snapshot = gateway.snapshots.current
    return snapshot.owners if snapshot is not None else {}


def entitlement_info(gateway: Gateway) -> Series:
    snapshot = gateway.snapshots.current
    if snapshot is None:
        return {}
    return {(snapshot.owners.get(limits.entitlement_id, ("", ""))[0], pool.name, limits.entitlement_id,
             str(limits.service_class)): 1.0
            for pool in snapshot.pools.values() for limits in pool.entitlements}


def _per_entitlement(gateway: Gateway, seconds: bool) -> Series:
    snapshot = gateway.snapshots.current
    if snapshot is None:
        return {}
    values: Series = {}
    for pool in snapshot.pools.values():
        for limits in pool.entitlements:
            value = limits.slo_target_ms / 1000.0 if seconds else limits.tokens_per_second
            if value is not None:
                values[(pool.name, limits.entitlement_id)] = float(value)
    return values


def replica_healthy(gateway: Gateway) -> Series:
    return {(pool, url): 1.0 if replicas.healthy.get(url, True) else 0.0
            for pool, replicas in gateway.replicas.items() for url in replicas.urls}


def replica_kv_usage(gateway: Gateway) -> Series:
    return {(pool, url): float(snapshot.kv_utilization)
            for pool, replicas in gateway.replicas.items() for url, snapshot in replicas.metrics.items()}


def register_info_gauges(gateway: Gateway) -> None:
    gateway.metrics.owners_source = lambda: owners(gateway)
    add = gateway.metrics.add_gauge
    add("tokenpools_entitlement_info", "An entitlement's tenant and service class (value 1; join on entitlement).",
        ("tenant", "pool", "entitlement", "service_class"), lambda: entitlement_info(gateway))
    add("tokenpools_entitlement_tokens_per_second", "The entitlement's entitled token rate.",
        ("pool", "entitlement"), lambda: _per_entitlement(gateway, seconds=False))
    add("tokenpools_entitlement_slo_ttft_seconds", "The entitlement's TTFT target.",
        ("pool", "entitlement"), lambda: _per_entitlement(gateway, seconds=True))
    add("tokenpools_replica_healthy", "1 when the gateway routes to the replica, 0 when it marked it down.",
        ("pool", "replica"), lambda: replica_healthy(gateway))
    add("tokenpools_replica_kv_usage", "KV cache use (0..1) the replica's vLLM metrics reported last.",
        ("pool", "replica"), lambda: replica_kv_usage(gateway))
