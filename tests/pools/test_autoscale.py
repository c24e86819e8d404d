"""The autoscaling signal: desired replicas from entitled baselines and observed demand."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rest_framework.test import APIClient

from apps.pools.autoscale import (
    Demand,
    desired_replicas,
    desired_replicas_by_pool,
    desired_replicas_metric_lines,
    pool_entitled_demand,
    pools_autoscale,
)
from apps.pools.models import GIB, Capacity, Replica, TokenPool
from tests.pools.factories import make_entitlement, make_pool

PER = Capacity(slots=16, tokens_per_second=240, kv_bytes=20 * GIB)


def test_the_largest_dimension_decides() -> None:
    # slots 40/16 -> 3, tokens 500/240 -> 3, KV 90/20 GiB -> 5: KV decides.
    decision = desired_replicas(per_replica=PER, entitled=Demand(40, 500, 90 * GIB), observed=Demand(),
                                min_replicas=1, max_replicas=10)
    assert decision.desired == 5
    assert decision.by_dimension == {"slots": 3, "tokens_per_second": 3, "kv_bytes": 5}
    assert decision.driver == "kv_bytes"


def test_observed_demand_above_entitlements_scales_out() -> None:
    # Entitled 16 slots (1 replica) but 70 requests running or waiting: ceil(70 / 16) = 5.
    decision = desired_replicas(per_replica=PER, entitled=Demand(16, 100, GIB), observed=Demand(70, 50, GIB),
                                min_replicas=1, max_replicas=10)
    assert (decision.desired, decision.driver) == (5, "slots")
    # Exactly full replicas need no extra one: 48 slots -> 3, 480 tok/s -> 2.
    exact = desired_replicas(per_replica=PER, entitled=Demand(48, 480, 0), observed=Demand(),
                             min_replicas=1, max_replicas=10)
    assert exact.desired == 3


def test_clamped_to_min_and_max() -> None:
    idle = desired_replicas(per_replica=PER, entitled=Demand(), observed=Demand(), min_replicas=2, max_replicas=10)
    assert idle.desired == 2 and "min_replicas=2" in idle.reason
    huge = desired_replicas(per_replica=PER, entitled=Demand(1000, 0, 0), observed=Demand(),
                            min_replicas=1, max_replicas=10)
    assert huge.desired == 10 and "63 replicas" in huge.reason and "max_replicas=10" in huge.reason


def test_target_utilization_leaves_headroom() -> None:
    # 40 slots at 80 % of 16 per replica (12.8): ceil(3.125) = 4 instead of 3.
    decision = desired_replicas(per_replica=PER, entitled=Demand(40, 0, 0), observed=Demand(),
                                min_replicas=1, max_replicas=10, target_utilization=0.8)
    assert decision.desired == 4
    with pytest.raises(ValueError):
        desired_replicas(per_replica=PER, entitled=Demand(), observed=Demand(), min_replicas=1, max_replicas=1,
                         target_utilization=0)


@pytest.mark.django_db
def test_entitled_demand_counts_bound_reserving_entitlements_only(admin: Any, acme: Any) -> None:
    pool = make_pool(admin, replicas=4)  # 64 slots, 960 tok/s, 80 GiB
    make_entitlement(admin, acme, pool, "g", "guaranteed", concurrency=10, tokens_per_second=100, kv_cache_gib=4)
    make_entitlement(admin, acme, pool, "e", "elastic", concurrency=20, tokens_per_second=300, kv_cache_gib=8)
    make_entitlement(admin, acme, pool, "s", "spot", concurrency=50, tokens_per_second=900, kv_cache_gib=50)
    make_entitlement(admin, acme, pool, "x", "dedicated", concurrency=5, tokens_per_second=5, kv_cache_gib=1,
                     expires_at=datetime.now(UTC) - timedelta(minutes=1))
    demand = pool_entitled_demand(pool=pool)
    assert demand == Demand(30, 400, 12 * GIB)


@pytest.mark.django_db
def test_pools_autoscale_stores_exposes_and_exports(admin: Any, acme: Any) -> None:
    pool = make_pool(admin, replicas=2)  # per replica: 16 slots, 240 tok/s, 20 GiB
    make_entitlement(admin, acme, pool, "e", "elastic", concurrency=20, tokens_per_second=100, kv_cache_gib=2)
    # The scrape saw 30 running + 10 waiting on one replica, at 50 % of a measured 10 GiB cache.
    first = pool.replicas.order_by("position").first()
    Replica.objects.filter(pk=first.pk).update(healthy=True, num_requests_running=30, num_requests_waiting=10,
                                               kv_cache_usage=0.5, kv_cache_bytes=10 * GIB)
    TokenPool.objects.filter(pk=pool.pk).update(measured_kv_cache_bytes_per_replica=10 * GIB)
    updated_before = TokenPool.objects.get(pk=pool.pk).updated_at

    decisions = pools_autoscale(observed_tokens_per_second={pool.name: 1000.0})

    # slots max(20, 40) / 16 -> 3; tokens max(100, 1000) / 240 -> 5; KV max(2, 5) GiB / 10 GiB -> 1.
    assert decisions[pool.name].by_dimension == {"slots": 3, "tokens_per_second": 5, "kv_bytes": 1}
    assert decisions[pool.name].desired == 5
    stored = TokenPool.objects.get(pk=pool.pk)
    assert stored.desired_replicas == 5 and "tokens_per_second" in stored.desired_replicas_reason
    assert stored.updated_at == updated_before

    client = APIClient()
    client.force_authenticate(admin)
    body = client.get(f"/api/v1/pools/{pool.name}/").json()
    assert body["desired_replicas"] == 5
    assert body["desired_replicas_reason"] == stored.desired_replicas_reason
    # Read-only: a client cannot set it.
    client.patch(f"/api/v1/pools/{pool.name}/", {"desired_replicas": 1}, format="json")
    assert TokenPool.objects.get(pk=pool.pk).desired_replicas == 5

    lines = desired_replicas_metric_lines()
    assert lines[0].startswith("# HELP tokenpools_pool_desired_replicas ")
    assert lines[1] == "# TYPE tokenpools_pool_desired_replicas gauge"
    assert lines[2:] == [f'tokenpools_pool_desired_replicas{{pool="{pool.name}"}} 5']
    assert desired_replicas_by_pool() == {(pool.name,): 5.0}
