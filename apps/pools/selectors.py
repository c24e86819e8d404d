"""Reads for pools, entitlements and state history, scoped to the user asking.

Pools are a platform resource: every signed-in user may read them (tenants need to see what they can
bind to), only superusers change them. Entitlements are visible to the users of their tenant and to
superusers; ``*_get`` raises ``Http404`` for anything outside the user's scope.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Prefetch, Q, QuerySet
from django.http import Http404
from django.utils import timezone

from apps.policy import InstanceSnapshot
from apps.pools.models import (
    Capacity,
    EntitlementState,
    EntitlementStateChange,
    Replica,
    TokenEntitlement,
    TokenPool,
)
from apps.tenancy.actors import AnyUser
from apps.tenancy.models import Tenant
from apps.tenancy.selectors import tenant_list


def pool_list(*, user: AnyUser) -> QuerySet[TokenPool]:
    """All pools for any signed-in user (read-only for tenants), with replicas prefetched."""
    if not getattr(user, "is_authenticated", False):
        return TokenPool.objects.none()
    return TokenPool.objects.prefetch_related(Prefetch("replicas", queryset=Replica.objects.order_by("position", "id")))


def pool_get(*, user: AnyUser, name: str) -> TokenPool:
    try:
        return pool_list(user=user).get(name=name)
    except TokenPool.DoesNotExist as exc:
        raise Http404(f"no pool {name!r}") from exc


def pool_list_for_tenant(*, tenant: Tenant) -> list[TokenPool]:
    """The pools the tenant holds entitlements in (system-wide: for an operation that checked its actor).

    By id: the order every writer locks pools in, so that two rebinding operations never deadlock.
    """
    return list(TokenPool.objects.filter(entitlements__tenant=tenant).distinct().order_by("pk"))


@dataclass(frozen=True)
class PoolUsage:
    """A pool's capacity against what its Bound entitlements reserve (for the UI and the API)."""

    enabled_replicas: int
    capacity: Capacity
    reserved: Capacity
    free: Capacity
    bytes_per_token: int
    entitlements_by_state: dict[str, int]


def pool_reserved(*, pool: TokenPool) -> Capacity:
    """Sum of the reservations of the pool's Bound entitlements (spot and preemptible reserve nothing)."""
    total = Capacity.zero()
    for ent in pool.entitlements.filter(state=EntitlementState.BOUND):
        total = total + ent.reservation
    return total


def pool_usage(*, user: AnyUser, pool: TokenPool) -> PoolUsage:
    """Capacity, reservations and free room of a pool, plus how many of its entitlements are in each state."""
    if not getattr(user, "is_authenticated", False):
        raise Http404("no such pool")
    capacity = pool.capacity()
    reserved = pool_reserved(pool=pool)
    counts = {state: 0 for state in EntitlementState.values}
    for state in pool.entitlements.values_list("state", flat=True):
        counts[state] = counts.get(state, 0) + 1
    return PoolUsage(
        enabled_replicas=pool.enabled_replica_count(),
        capacity=capacity,
        reserved=reserved,
        free=capacity - reserved,
        bytes_per_token=pool.bytes_per_token,
        entitlements_by_state=counts,
    )


def entitlement_list(
    *,
    user: AnyUser,
    tenant: Tenant | None = None,
    pool: TokenPool | None = None,
    state: str | None = None,
    service_class: str | None = None,
) -> QuerySet[TokenEntitlement]:
    """Entitlements of the tenants the user may see, optionally narrowed; tenant and pool loaded."""
    qs = TokenEntitlement.objects.select_related("tenant", "pool").filter(tenant__in=tenant_list(user=user))
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    if pool is not None:
        qs = qs.filter(pool=pool)
    if state:
        qs = qs.filter(entitlement_state_q(state))
    if service_class:
        qs = qs.filter(service_class=service_class)
    return qs


def entitlement_state_q(state: str, now: datetime | None = None) -> Q:
    """Match entitlements by their effective state: past ``expires_at`` counts as Expired before the tick."""
    past = Q(expires_at__lte=now or timezone.now())
    if state == EntitlementState.EXPIRED:
        return Q(state=state) | past
    return Q(state=state) & ~past


def entitlement_get(*, user: AnyUser, name: str) -> TokenEntitlement:
    try:
        return entitlement_list(user=user).get(name=name)
    except TokenEntitlement.DoesNotExist as exc:
        raise Http404(f"no entitlement {name!r}") from exc


def entitlement_state_changes(*, user: AnyUser, entitlement: TokenEntitlement) -> QuerySet[EntitlementStateChange]:
    """The entitlement's state history, oldest first (empty if the user may not see the entitlement)."""
    return EntitlementStateChange.objects.filter(
        entitlement=entitlement, entitlement__tenant__in=tenant_list(user=user)
    ).order_by("at", "id")


def pool_instance_snapshots(*, pool: TokenPool) -> list[InstanceSnapshot]:
    """The last scrape of each enabled, healthy replica as the policy's saturation input.

    System-wide (no user): the gateway and the control loops read it off the request path.
    ``updated_at`` is the scrape's epoch time, so callers judge staleness on the wall clock.
    """
    return [
        InstanceSnapshot(
            queue_depth=float(r.num_requests_waiting or 0),
            kv_utilization=float(r.kv_cache_usage or 0.0),
            updated_at=r.scraped_at.timestamp() if r.scraped_at else None,
            batch_size=float(r.num_requests_running or 0),
        )
        for r in pool.replicas.filter(enabled=True, healthy=True).order_by("position", "id")
    ]
