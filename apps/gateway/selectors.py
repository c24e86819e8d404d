"""ORM reads of the gateway: the whole key/entitlement/pool picture, and a cheap marker of its changes.

These run off the request path only (the snapshot refresher's thread); the per-request path reads
the immutable snapshot built from them. The gateway serves every tenant, so these selectors are
system-wide rather than scoped to a user.
"""

from __future__ import annotations

from typing import Any

from django.db import connection

from apps.pools.models import Replica, TokenEntitlement, TokenPool
from apps.tenancy.models import ApiKey, Tenant


def gateway_change_marker() -> tuple[Any, ...]:
    """A value that moves whenever anything the snapshot holds changes: one statement of scalar subqueries.

    Counts catch deletions, max ids catch inserts, timestamps catch edits; a replica toggled off
    while another is toggled on would keep the counts, so the enabled ids are summed as well. One raw statement
    (polled twice a second by every gateway process): the six ORM aggregates it replaces cost ~5 ms of Python
    each poll, held against the server's requests (the interpreter's lock).
    """
    with connection.cursor() as cursor:
        cursor.execute(_marker_sql())
        return tuple(cursor.fetchone())


def _marker_sql() -> str:
    quote = connection.ops.quote_name
    parts = []
    for model, expressions in (
        (ApiKey, ("COUNT(*)", "MAX(id)", "COUNT(revoked_at)", "MAX(revoked_at)", "MAX(expires_at)")),
        (TokenEntitlement, ("COUNT(*)", "MAX(id)", "MAX(updated_at)", "MAX(state_changed_at)")),
        (TokenPool, ("COUNT(*)", "MAX(id)", "MAX(updated_at)")),
        (Replica, ("COUNT(*)", "MAX(id)", "SUM(CASE WHEN enabled THEN 1 ELSE 0 END)",
                   "SUM(CASE WHEN enabled THEN id ELSE 0 END)")),
        (Tenant, ("COUNT(*)", "MAX(updated_at)")),
    ):
        table = quote(model._meta.db_table)
        parts += [f"(SELECT {expression} FROM {table})" for expression in expressions]
    return "SELECT " + ", ".join(parts)


def gateway_active_keys() -> list[ApiKey]:
    """Unrevoked keys with tenant, entitlement and pool loaded (expiry is judged per request)."""
    return list(
        ApiKey.objects.filter(revoked_at__isnull=True).select_related(
            "tenant", "entitlement", "entitlement__pool", "entitlement__tenant"
        )
    )


def gateway_pools() -> list[TokenPool]:
    return list(TokenPool.objects.prefetch_related("replicas", "entitlements__tenant"))


def usage_record_list(*, user: Any) -> Any:
    """Usage records of the tenants the user may see (all for superusers)."""
    from apps.gateway.models import UsageRecord
    from apps.tenancy.selectors import tenant_list

    return UsageRecord.objects.filter(tenant__in=tenant_list(user=user)).select_related("tenant")


def request_log_list(*, user: Any) -> Any:
    """Request log records of the tenants the user may see (all for superusers), oldest first."""
    from apps.gateway.models import RequestLogRecord
    from apps.tenancy.selectors import tenant_list

    return RequestLogRecord.objects.filter(tenant__in=tenant_list(user=user)).select_related("tenant")


# A replay's columns of a record, in `apps.simulator.replay.Recorded`'s order.
REPLAY_COLUMNS = ("arrived_at", "tenant_id", "pool", "entitlement", "prompt_tokens", "max_tokens",
                  "completion_tokens", "outcome", "reason", "queue_ms", "ttft_ms", "duration_ms")


def request_log_window(*, user: Any, since: Any, until: Any, pool: str | None = None) -> Any:
    """The records of the tenants the user may see that arrived in [since, until), oldest first, as tuples of
    `REPLAY_COLUMNS` (a replay reads tens of thousands: no model instances built)."""
    records = request_log_list(user=user).filter(arrived_at__gte=since, arrived_at__lt=until)
    if pool:
        records = records.filter(pool=pool)
    return records.order_by("arrived_at", "id").values_list(*REPLAY_COLUMNS)


def request_log_oldest(*, user: Any) -> Any:
    """When the oldest record the user may see arrived (None: none at all)."""
    from django.db.models import Min

    return request_log_list(user=user).aggregate(oldest=Min("arrived_at"))["oldest"]


def usage_spend_summary(*, user: Any, period: str, filters: Any = None) -> list[dict[str, Any]]:
    """Usage per tenant, entitlement, served tier (`service_tier`: the class that served the tokens, the
    entitlement's own or the lower one they spilled over or were demoted to) and UTC day or month, with its
    spend at the entitlement's pool's prices (per million tokens; null when the pool has none, or the
    entitlement is gone). `filters` narrows the records first (the usage API's filters)."""
    import datetime as dt
    from decimal import Decimal

    from django.db.models import Sum
    from django.db.models.functions import TruncDay, TruncMonth

    truncate = {"day": TruncDay, "month": TruncMonth}[period]
    records = filters if filters is not None else usage_record_list(user=user)
    rows = (records.annotate(period=truncate("minute", tzinfo=dt.UTC))
            .values("tenant__slug", "entitlement", "service_tier", "period")
            .annotate(requests=Sum("requests"), prompt_tokens=Sum("prompt_tokens"),
                      completion_tokens=Sum("completion_tokens"), rejected=Sum("rejected"))
            .order_by("period", "tenant__slug", "entitlement", "service_tier"))
    rows = list(rows)
    prices = {
        e.name: e.pool for e in TokenEntitlement.objects.filter(name__in={r["entitlement"] for r in rows})
        .select_related("pool")
    }
    million = Decimal(1_000_000)
    out = []
    for row in rows:
        pool = prices.get(row["entitlement"])
        spend = None
        if pool is not None and pool.has_prices:
            amount = (row["prompt_tokens"] * pool.price_input_per_million
                      + row["completion_tokens"] * pool.price_output_per_million) / million
            spend = {"amount": str(amount.quantize(Decimal("0.000001"))), "currency": pool.price_currency}
        out.append({
            "tenant": row["tenant__slug"], "entitlement": row["entitlement"], "service_tier": row["service_tier"],
            "period": row["period"].date().isoformat() if period == "day" else row["period"].strftime("%Y-%m"),
            "requests": row["requests"], "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"], "rejected": row["rejected"], "spend": spend,
        })
    return out
