"""Reads composed for the admin UI pages, built on the tenancy and pools selectors (so already scoped).

Each function takes the ``user`` it answers for, like the selectors it calls: a superuser sees every
tenant, anyone else only the tenants they belong to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Q, QuerySet

from apps.dashboard.bars import UsageBar, usage_bars
from apps.pools import selectors as pool_selectors
from apps.pools.models import EntitlementState, Replica, TokenEntitlement, TokenPool
from apps.pools.selectors import PoolUsage
from apps.tenancy import selectors as tenancy_selectors
from apps.tenancy.models import ApiKey, Tenant

# How many Degraded/Pending entitlements the home page lists before the full list is one click away.
ATTENTION_LIMIT = 10


@dataclass(frozen=True)
class HomeOverview:
    tenant_rows: Sequence[tuple[Tenant, str]]
    entitlements_by_state: dict[str, int]
    needs_attention: list[TokenEntitlement]
    pool_count: int


def home_overview(*, user: Any) -> HomeOverview:
    """The user's tenants with their role and counts, entitlements by state, and what needs attention."""
    tenants = tenancy_selectors.tenant_list(user=user).annotate(
        entitlement_count=Count("entitlements", distinct=True),
        key_count=Count("api_keys", filter=Q(api_keys__revoked_at__isnull=True), distinct=True),
    )
    if user.is_superuser:
        tenant_rows = [(tenant, "operator") for tenant in tenants]
    else:
        roles = {m.tenant.pk: m.role for m in tenancy_selectors.membership_list(user=user).filter(user=user)}
        tenant_rows = [(tenant, roles.get(tenant.pk, "")) for tenant in tenants]
    entitlements = pool_selectors.entitlement_list(user=user)
    by_state = {state: 0 for state in EntitlementState.values}
    for state in entitlements.values_list("state", flat=True):
        by_state[state] = by_state.get(state, 0) + 1
    attention = entitlements.filter(state__in=[EntitlementState.DEGRADED, EntitlementState.PENDING])
    return HomeOverview(
        tenant_rows=tenant_rows,
        entitlements_by_state=by_state,
        needs_attention=list(attention[:ATTENTION_LIMIT]),
        pool_count=pool_selectors.pool_list(user=user).count(),
    )


def tenants_with_counts(*, user: Any) -> QuerySet[Tenant]:
    return tenancy_selectors.tenant_list(user=user).annotate(
        member_count=Count("memberships", distinct=True),
        entitlement_count=Count("entitlements", distinct=True),
    )


def owned_tenants(*, user: Any) -> QuerySet[Tenant]:
    """Tenants whose entitlements the user may create and change (all of them for a superuser)."""
    owned = tenancy_selectors.owned_tenant_ids(user=user)
    return tenancy_selectors.tenant_list(user=user).filter(pk__in=owned)


def key_rows(*, user: Any) -> list[tuple[ApiKey, bool]]:
    """The user's visible keys, each with whether they may revoke it (owners: any; members: their own)."""
    owned = tenancy_selectors.owned_tenant_ids(user=user)
    return [
        (key, key.revoked_at is None and (key.tenant.pk in owned or _created_by(key, user)))
        for key in tenancy_selectors.apikey_list(user=user)
    ]


def _created_by(key: ApiKey, user: Any) -> bool:
    return key.created_by is not None and key.created_by.pk == user.pk


def pool_replica(*, pool: TokenPool, replica_id: int) -> Replica | None:
    """One replica of a pool, or None (pools are readable by every signed-in user)."""
    return Replica.objects.filter(pool=pool, pk=replica_id).first()


@dataclass(frozen=True)
class PoolPage:
    pool: TokenPool
    usage: PoolUsage
    bars: list[UsageBar]
    visible_entitlements: list[TokenEntitlement]
    hidden_count: int


def pool_page(*, user: Any, pool: TokenPool) -> PoolPage:
    """A pool's bars (reserved vs capacity on slots, tokens/s and KV bytes) and the entitlements the user
    may see on it; other tenants' entitlements only count in the bars and in ``hidden_count``."""
    usage = pool_selectors.pool_usage(user=user, pool=pool)
    bars = usage_bars(
        reserved={
            "slots": usage.reserved.slots,
            "tokens_per_second": usage.reserved.tokens_per_second,
            "kv_bytes": usage.reserved.kv_bytes,
        },
        capacity={
            "slots": usage.capacity.slots,
            "tokens_per_second": usage.capacity.tokens_per_second,
            "kv_bytes": usage.capacity.kv_bytes,
        },
    )
    visible = list(pool_selectors.entitlement_list(user=user, pool=pool))
    return PoolPage(
        pool=pool,
        usage=usage,
        bars=bars,
        visible_entitlements=visible,
        hidden_count=sum(usage.entitlements_by_state.values()) - len(visible),
    )


def pool_rows(*, user: Any) -> list[tuple[TokenPool, PoolUsage]]:
    return [(pool, pool_selectors.pool_usage(user=user, pool=pool)) for pool in pool_selectors.pool_list(user=user)]


# --- live dashboards ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveAccess:
    """What a viewer of a live page may see: the pool whose samples feed it, the entitlements whose
    series are drawn (None: all of them, operators) and the figures shown."""

    pool: str
    visibility: Any  # apps.dashboard.samples.Visibility (kept out of this module's imports: no cycle)
    figure_ids: tuple[str, ...]
    title: str


def live_pool_access(*, user: Any, name: str) -> LiveAccess:
    """A pool's live page: operators see every entitlement and the pool totals; a tenant user only the
    entitlements of their tenants on this pool (pools themselves are readable by every signed-in user).
    Raises ``Http404`` for an unknown pool."""
    from apps.dashboard.figures import figure_ids
    from apps.dashboard.samples import Visibility

    pool = pool_selectors.pool_get(user=user, name=name)
    if user.is_superuser:
        visibility = Visibility(entitlements=None, pool_totals=True)
    else:
        names = pool_selectors.entitlement_list(user=user, pool=pool).values_list("name", flat=True)
        visibility = Visibility(entitlements=frozenset(names), pool_totals=False)
    return LiveAccess(pool.name, visibility, tuple(figure_ids(pool_totals=visibility.pool_totals)),
                      f"Pool {pool.name}")


def live_entitlement_access(*, user: Any, name: str) -> LiveAccess:
    """An entitlement's live page: its own series only (pool totals for operators). ``Http404`` for an
    entitlement outside the user's tenants."""
    from apps.dashboard.figures import figure_ids
    from apps.dashboard.samples import Visibility

    entitlement = pool_selectors.entitlement_get(user=user, name=name)
    visibility = Visibility(entitlements=frozenset({entitlement.name}), pool_totals=bool(user.is_superuser))
    ids = tuple(i for i in figure_ids(pool_totals=visibility.pool_totals) if i != "kv")
    return LiveAccess(entitlement.pool.name, visibility, ids, f"Entitlement {entitlement.name}")
