"""The autoscaling signal: how many replicas a pool should run (seed 000, section 4: "entitlements
authorize both admission and autoscaling").

On each dimension (slots, tokens/s, KV bytes) the pool needs the larger of what its Bound
reserving entitlements are entitled to (dedicated and guaranteed baselines, elastic baselines as
time-averaged reservations) and what is observed (running + waiting requests, KV in use, token
demand). Divided by one replica's capacity and rounded up, the largest dimension wins, clamped to
``min_replicas..max_replicas``. The number is stored on the pool, shown on the REST API and
exported as the Prometheus gauge ``tokenpools_pool_desired_replicas{pool}`` for an external
scaler (KEDA, a Dynamo planner) to act on; nothing here starts or stops a backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q
from django.utils import timezone

from apps.pools.models import RESERVING_CLASSES, Capacity, EntitlementState, TokenPool, gib_to_bytes

DIMENSIONS = ("slots", "tokens_per_second", "kv_bytes")
METRIC_NAME = "tokenpools_pool_desired_replicas"


@dataclass(frozen=True, slots=True)
class Demand:
    """An amount on the three dimensions; floats because observed demand is a rate or a fraction."""

    slots: float = 0.0
    tokens_per_second: float = 0.0
    kv_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    desired: int
    # Replicas each dimension alone calls for (before clamping), and the dimension that decided.
    by_dimension: Mapping[str, int]
    driver: str
    reason: str


def desired_replicas(
    *,
    per_replica: Capacity,
    entitled: Demand,
    observed: Demand,
    min_replicas: int,
    max_replicas: int,
    target_utilization: float = 1.0,
) -> ScalingDecision:
    """clamp(max over dimensions of ceil(max(entitled, observed) / (per-replica * target)), min, max).

    ``target_utilization`` < 1 leaves headroom (0.8: scale out when replicas would be 80 % full).
    A dimension whose per-replica capacity is zero is ignored: it cannot be scaled by replicas.
    """
    if not 0.0 < target_utilization <= 1.0:
        raise ValueError(f"target_utilization must be in (0, 1], got {target_utilization!r}")
    if min_replicas > max_replicas:
        raise ValueError(f"min_replicas ({min_replicas}) exceeds max_replicas ({max_replicas})")
    needs: dict[str, int] = {}
    for name in DIMENSIONS:
        per = float(getattr(per_replica, name)) * target_utilization
        if per <= 0:
            continue
        need = max(float(getattr(entitled, name)), float(getattr(observed, name)), 0.0)
        # The epsilon keeps float noise (3.0000000001) from asking for a whole extra replica.
        needs[name] = math.ceil(need / per - 1e-9) if need > 0 else 0
    driver = max(needs, key=lambda name: needs[name]) if needs else "slots"
    unclamped = needs.get(driver, 0)
    desired = min(max_replicas, max(min_replicas, unclamped))
    if unclamped > max_replicas:
        reason = f"{driver} needs {unclamped} replicas; capped at max_replicas={max_replicas}"
    elif unclamped < min_replicas:
        reason = f"demand fits {unclamped} replicas; kept at min_replicas={min_replicas}"
    else:
        reason = f"{driver} needs {unclamped} replicas"
    return ScalingDecision(desired, needs, driver, reason)


def pool_entitled_demand(*, pool: TokenPool, now: datetime | None = None) -> Demand:
    """Sum of the baselines of the pool's Bound reserving entitlements (spot and preemptible have
    no baseline to honour, so they only count through observed demand)."""
    now = now or timezone.now()
    slots = tokens = kv = 0.0
    # Three columns, not model instances: with 10,000 entitlements, a tick building 10,000 instances (and
    # their fields) every 15 s gave the collector a 28 ms pause that stopped the gateway's loop with it.
    rows = pool.entitlements.filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=now),  # not past expiry (TokenEntitlement.is_past_expiry)
        state=EntitlementState.BOUND, service_class__in=RESERVING_CLASSES,
    ).values_list("concurrency", "tokens_per_second", "kv_cache_gib")
    for concurrency, tokens_per_second, kv_cache_gib in rows:
        slots += concurrency
        tokens += tokens_per_second
        kv += gib_to_bytes(kv_cache_gib)
    return Demand(slots, tokens, kv)


def pool_observed_demand(*, pool: TokenPool, tokens_per_second: float = 0.0) -> Demand:
    """What the scrape saw on the enabled, healthy replicas: requests running or waiting, KV in use
    (usage x measured size, else the configured size); token demand comes from the gateway's counters."""
    slots = kv = 0.0
    configured_kv = pool.kv_cache_bytes_per_replica
    for replica in pool.replicas.filter(enabled=True, healthy=True):
        slots += (replica.num_requests_running or 0) + (replica.num_requests_waiting or 0)
        size = replica.kv_cache_bytes or pool.measured_kv_cache_bytes_per_replica or configured_kv
        kv += (replica.kv_cache_usage or 0.0) * size
    return Demand(slots, max(0.0, tokens_per_second), kv)


def pool_per_replica_capacity(pool: TokenPool) -> Capacity:
    """One replica's capacity, with the measured KV size once a scrape has seen it."""
    per = pool.per_replica_capacity
    measured = pool.measured_kv_cache_bytes_per_replica
    return Capacity(per.slots, per.tokens_per_second, measured or per.kv_bytes)


def pools_autoscale(
    *,
    now: datetime | None = None,
    observed_tokens_per_second: Mapping[str, float] | None = None,
    target_utilization: float = 1.0,
) -> dict[str, ScalingDecision]:
    """Compute and store every pool's desired replica count; returns the decisions by pool name."""
    now = now or timezone.now()
    tokens = observed_tokens_per_second or {}
    decisions: dict[str, ScalingDecision] = {}
    for pool in TokenPool.objects.order_by("id"):
        decision = desired_replicas(
            per_replica=pool_per_replica_capacity(pool),
            entitled=pool_entitled_demand(pool=pool, now=now),
            observed=pool_observed_demand(pool=pool, tokens_per_second=tokens.get(pool.name, 0.0)),
            min_replicas=pool.min_replicas,
            max_replicas=max(pool.max_replicas, pool.min_replicas),
            target_utilization=target_utilization,
        )
        # update(): no updated_at bump, so the gateways' change marker does not move every tick.
        TokenPool.objects.filter(pk=pool.pk).update(
            desired_replicas=decision.desired, desired_replicas_reason=decision.reason[:300],
            desired_replicas_at=now,
        )
        decisions[pool.name] = decision
    return decisions


def desired_replicas_metric_lines() -> list[str]:
    """Prometheus text lines of the gauge (pools never computed yet are left out)."""
    lines = [
        f"# HELP {METRIC_NAME} Replicas the pool should run: entitled baselines and observed demand "
        "over per-replica capacity, within min..max replicas.",
        f"# TYPE {METRIC_NAME} gauge",
    ]
    rows = TokenPool.objects.filter(desired_replicas__isnull=False).order_by("name")
    for name, desired in rows.values_list("name", "desired_replicas"):
        escaped = name.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        lines.append(f'{METRIC_NAME}{{pool="{escaped}"}} {desired}')
    return lines


def desired_replicas_by_pool() -> dict[tuple[str, ...], float]:
    """The same values as `{(pool,): desired}` (the shape of `GatewayMetrics.add_gauge`). It reads the
    ORM, so not from inside an event loop: the gateway uses `workers.services.desired_replicas_gauge`."""
    rows = TokenPool.objects.filter(desired_replicas__isnull=False).values_list("name", "desired_replicas")
    return {(name,): float(desired or 0) for name, desired in rows}
