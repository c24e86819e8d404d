"""Reads of the operator's overview (issue 28), scoped to the user like every selector: a superuser sees
every pool's load, tenant, quota and entitlement; anyone else the same figures for their own tenants only
(a pool's load and fairness summed over their entitlements, never another tenant's).

Sources: the live samples (telemetry history, passed in: it is async and lives in the consumer's loop),
the gateway's request log (refusals, TTFT), the usage records (quota burn) and the quota states.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db.models import Count, Q
from django.db.models.functions import TruncMinute

from apps.dashboard import overview
from apps.dashboard.samples import PoolSample, Visibility, samples_visible
from apps.gateway.models import RequestLogRecord, RequestOutcome
from apps.gateway.quotas import entitlement_quota_status, quota_used, tenant_quota_status
from apps.pools import selectors as pool_selectors
from apps.pools.models import Replica, TokenEntitlement
from apps.tenancy import selectors as tenancy_selectors

SLO_ROWS = 20  # entitlements listed under SLO attainment, the furthest over their target first
QUOTA_ROWS = 10
# The p99s are computed from at most this many of the latest served requests (every push reads them): under
# heavy traffic the last 15 minutes hold more, and the newest 50,000 give the same p99 within a rank or two.
SLO_MAX_REQUESTS = 50_000
_HAS_QUOTA = Q(quota_window__gt="") & (Q(quota_tokens__isnull=False) | Q(quota_amount__isnull=False))


@dataclass(frozen=True)
class OverviewScope:
    """What one viewer may see: every pool's name, and the entitlements (None: all) whose figures count."""

    pools: list[str]
    visibility: Visibility


@dataclass(frozen=True)
class Overview:
    operator: bool
    pools: list[overview.PoolLoad]
    refusals: overview.Refusals
    quotas: list[overview.QuotaBurn]
    slo: list[overview.SloAttainment]


def overview_scope(*, user: Any) -> OverviewScope:
    pools = list(pool_selectors.pool_list(user=user).values_list("name", flat=True))
    if user.is_superuser:
        return OverviewScope(pools, Visibility())
    names = pool_selectors.entitlement_list(user=user).values_list("name", flat=True)
    return OverviewScope(pools, Visibility(entitlements=frozenset(names), pool_totals=False))


def overview_get(*, user: Any, samples: Mapping[str, Sequence[PoolSample]], now: dt.datetime) -> Overview:
    """The overview for `user` at `now`, from the pools' recent `samples` (cut here to what the user may see)."""
    scope = overview_scope(user=user)
    since = now - dt.timedelta(seconds=overview.WINDOW_S)
    entitlements = pool_selectors.entitlement_list(user=user).select_related("tenant", "pool")
    tenant_ids = list(tenancy_selectors.tenant_list(user=user).values_list("id", flat=True))
    return Overview(
        operator=bool(user.is_superuser),
        pools=_pool_loads(user=user, scope=scope, samples=samples),
        refusals=_refusals(tenant_ids=tenant_ids, since=since, now=now),
        quotas=overview.nearest_limits(_quota_burns(user=user, entitlements=entitlements, since=since, now=now),
                                       QUOTA_ROWS),
        slo=_slo(entitlements=entitlements, since=since),
    )


def _pool_loads(*, user: Any, scope: OverviewScope, samples: Mapping[str, Sequence[PoolSample]]
                ) -> list[overview.PoolLoad]:
    loads = []
    for pool in pool_selectors.pool_list(user=user).order_by("name"):
        capacity = pool.capacity()
        enabled = Replica.objects.filter(pool=pool, enabled=True)
        loads.append(overview.pool_load(
            pool.name, samples_visible(samples.get(pool.name, ()), scope.visibility),
            slots=capacity.slots, tokens_per_s=float(capacity.tokens_per_second), kv_bytes=float(capacity.kv_bytes),
            healthy_replicas=enabled.filter(healthy=True).count(), replicas=enabled.count(),
            unchecked_replicas=enabled.filter(healthy__isnull=True).count(),
        ))
    return loads


def _refusals(*, tenant_ids: list[int], since: dt.datetime, now: dt.datetime) -> overview.Refusals:
    rows = (RequestLogRecord.objects
            .filter(arrived_at__gte=since, outcome=RequestOutcome.REJECTED, tenant_id__in=tenant_ids)
            .annotate(minute=TruncMinute("arrived_at"))
            .values("tenant__slug", "reason", "minute")
            .annotate(n=Count("id")))
    return overview.refusals_by_minute(
        ((r["tenant__slug"] or "", r["reason"], r["minute"], r["n"]) for r in rows), now)


def _weights(owner: Any, pool: Any) -> tuple[float, float] | None:
    """Per-token weights of a quota in its own unit (as the gateway prices it): tokens count 1, money the
    pool's price per token; None for a pool without prices in the quota's currency (it costs nothing there)."""
    if owner.quota_tokens is not None:
        return 1.0, 1.0
    if not pool.has_prices or pool.price_currency != owner.quota_currency:
        return None
    million = Decimal(1_000_000)
    return float(pool.price_input_per_million / million), float(pool.price_output_per_million / million)


def _quota_burns(*, user: Any, entitlements: Any, since: dt.datetime, now: dt.datetime
                 ) -> list[overview.QuotaBurn]:
    burns: list[overview.QuotaBurn] = []
    for ent in entitlements.filter(_HAS_QUOTA):
        status = entitlement_quota_status(ent, now)
        weights = _weights(ent, ent.pool)
        if status is None or weights is None:
            continue
        recent = quota_used(tenant_id=ent.tenant_id, entitlement=ent.name, since=since,
                            weights_by_entitlement={ent.name: weights})
        burns.append(overview.quota_burn(scope="entitlement", name=ent.name, tenant=ent.tenant.slug,
                                         status=status, used_recently=recent, now=now))
    for tenant in tenancy_selectors.tenant_list(user=user).filter(_HAS_QUOTA):
        status = tenant_quota_status(tenant, now)
        if status is None:
            continue
        weights_by_ent = {}
        for ent in TokenEntitlement.objects.filter(tenant=tenant).select_related("pool"):
            weights = _weights(tenant, ent.pool)
            if weights is not None:
                weights_by_ent[ent.name] = weights
        recent = quota_used(tenant_id=tenant.pk, entitlement=None, since=since, weights_by_entitlement=weights_by_ent)
        burns.append(overview.quota_burn(scope="tenant", name=tenant.slug, tenant=tenant.slug, status=status,
                                         used_recently=recent, now=now))
    return burns


def _slo(*, entitlements: Any, since: dt.datetime) -> list[overview.SloAttainment]:
    by_name = {ent.name: ent for ent in entitlements}
    ttfts: dict[str, list[float]] = {}
    rows = (RequestLogRecord.objects
            .filter(arrived_at__gte=since, outcome=RequestOutcome.SERVED, ttft_ms__isnull=False,
                    entitlement__in=list(by_name))
            .order_by("-arrived_at")
            .values_list("entitlement", "ttft_ms")[:SLO_MAX_REQUESTS])
    for name, ttft in rows:
        ttfts.setdefault(name, []).append(float(ttft or 0.0))
    rows_out = [overview.slo_attainment(name, by_name[name].tenant.slug, float(by_name[name].slo_target_ms), values)
                for name, values in ttfts.items()]

    def worst_first(row: overview.SloAttainment) -> tuple[float, str]:
        ratio = (row.p99_ms or 0.0) / row.target_ms if row.target_ms > 0 else 0.0
        return (-ratio, row.entitlement)

    return sorted(rows_out, key=worst_first)[:SLO_ROWS]


async def pool_histories(pools: Sequence[str]) -> dict[str, list[PoolSample]]:
    """The recent samples of each pool (the telemetry history: in process or Redis)."""
    from apps.dashboard.history import history_store

    store = history_store()
    return {pool: await store.recent(pool) for pool in pools}
