"""The quotas a key's requests are under, as the snapshot carries them (`apps.policy.quota.QuotaRule`).

An entitlement's own quota and its tenant's; a money quota is priced at the pool's prices per token (the
entitlement's pool for either: a tenant's money quota counts each entitlement's requests at its own
pool's prices). Each rule carries what its current window had used by the usage records at load time, so
a gateway that restarts (or a Redis that lost its data) starts from there, not from zero.
"""

from __future__ import annotations

import datetime as dt
import logging
from decimal import Decimal
from typing import Any

from django.db.models import Sum

from apps.policy.quota import QuotaRule, quota_window_of, quota_window_start

logger = logging.getLogger(__name__)
MILLION = Decimal(1_000_000)


def _weights(quota_owner: Any, pool: Any) -> tuple[float, float, str] | None:
    """Per-token weights and unit of a quota: 1 and 'tokens', or the pool's price per token in its currency
    (None when a money quota meets a pool without prices in that currency: validation keeps that out)."""
    if quota_owner.quota_tokens is not None:
        return 1.0, 1.0, "tokens"
    if not pool.has_prices or pool.price_currency != quota_owner.quota_currency:
        return None
    return (float(pool.price_input_per_million / MILLION), float(pool.price_output_per_million / MILLION),
            pool.price_currency)


def _limit(quota_owner: Any) -> float:
    return float(quota_owner.quota_tokens if quota_owner.quota_tokens is not None else quota_owner.quota_amount)


def quota_used(*, tenant_id: int, entitlement: str | None, since: dt.datetime,
               weights_by_entitlement: dict[str, tuple[float, float]]) -> float:
    """What the usage records say was used since `since`: the entitlement's (or the whole tenant's),
    weighted per entitlement (tokens: 1 and 1; money: its pool's prices)."""
    from apps.gateway.models import UsageRecord

    records = UsageRecord.objects.filter(tenant_id=tenant_id, minute__gte=since)
    if entitlement is not None:
        records = records.filter(entitlement=entitlement)
    total = 0.0
    for row in records.values("entitlement").annotate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")):
        weights = weights_by_entitlement.get(row["entitlement"], (1.0, 1.0))
        total += (row["prompt"] or 0) * weights[0] + (row["completion"] or 0) * weights[1]
    return total


class QuotaRules:
    """Builds each key's rules once per snapshot (a tenant's seed is computed once, not per key)."""

    def __init__(self, now: dt.datetime) -> None:
        self.now = now
        self._tenant_rules: dict[int, QuotaRule | None] = {}

    def _rule(self, key: str, owner: Any, pool: Any, *, tenant_id: int, entitlement: str | None,
              weights_by_entitlement: dict[str, tuple[float, float]]) -> QuotaRule | None:
        weights = _weights(owner, pool)
        if weights is None:
            logger.warning("quota %s of tenant %s skipped: pool %s has no prices in %s", key, tenant_id, pool.name,
                           owner.quota_currency)
            return None
        window_id, _reset = quota_window_of(owner.quota_window, owner.quota_timezone, self.now)
        since = quota_window_start(owner.quota_window, owner.quota_timezone, self.now)
        used = quota_used(tenant_id=tenant_id, entitlement=entitlement, since=since,
                          weights_by_entitlement=weights_by_entitlement)
        return QuotaRule(key, _limit(owner), owner.quota_window, owner.quota_timezone, weights[0], weights[1],
                         weights[2], window_id, used, owner.quota_on_exceeded or "reject")

    def for_entitlement(self, ent: Any) -> tuple[QuotaRule, ...]:
        rules: list[QuotaRule] = []
        if ent.has_quota:
            weights = _weights(ent, ent.pool)
            own = self._rule(f"entitlement:{ent.name}", ent, ent.pool, tenant_id=ent.tenant_id, entitlement=ent.name,
                             weights_by_entitlement={ent.name: weights[:2]} if weights else {})
            if own is not None:
                rules.append(own)
        tenant = ent.tenant
        if tenant.has_quota:
            if tenant.pk not in self._tenant_rules:
                self._tenant_rules[tenant.pk] = self.tenant_rule(tenant, ent.pool)
            shared = self._tenant_rules[tenant.pk]
            if shared is not None:
                # The tenant's quota in this entitlement's pool's prices (money) with the tenant-wide seed.
                weights = _weights(tenant, ent.pool)
                if weights is not None:
                    rules.append(QuotaRule(shared.key, shared.limit, shared.window, shared.timezone, weights[0],
                                           weights[1], weights[2], shared.seed_window_id, shared.seed_used,
                                           shared.on_exceeded))
        return tuple(rules)

    def tenant_rule(self, tenant: Any, pool: Any) -> QuotaRule | None:
        """The tenant's quota, priced at `pool`'s prices when it is in money (any pool, or none, for tokens)."""
        weights_by_entitlement: dict[str, tuple[float, float]] = {}
        for ent in tenant.entitlements.select_related("pool"):
            weights = _weights(tenant, ent.pool)
            if weights is not None:
                weights_by_entitlement[ent.name] = weights[:2]
        if _weights(tenant, pool) is None:
            return None
        return self._rule("tenant", tenant, pool, tenant_id=tenant.pk, entitlement=None,
                          weights_by_entitlement=weights_by_entitlement)


def quota_status(rule: QuotaRule | None, now: dt.datetime) -> dict[str, Any] | None:
    """A quota as the REST API and the pages show it: limit, used (by the usage records: what finished
    requests used, flushed every `GATEWAY_USAGE_FLUSH_S`; requests still running are not in it), remaining
    and when the window resets."""
    if rule is None:
        return None
    charge = rule.charge_at(now)
    used = charge.seed_used
    return {
        "unit": charge.unit,
        "window": rule.window,
        "timezone": rule.timezone,
        "window_id": charge.window_id,
        "limit": _round(charge.limit),
        "used": _round(used),
        "remaining": _round(max(0.0, charge.limit - used)),
        "used_percent": round(min(100.0, 100.0 * used / charge.limit), 1) if charge.limit > 0 else 100.0,
        "resets_at": dt.datetime.fromtimestamp(charge.reset_at, dt.UTC).isoformat().replace("+00:00", "Z"),
    }


def _round(value: float) -> float | int:
    # Tokens are whole; money keeps a hundredth of a cent.
    return int(value) if float(value).is_integer() else round(value, 4)


def entitlement_quota_status(ent: Any, now: dt.datetime | None = None) -> dict[str, Any] | None:
    """The entitlement's own quota (its tenant's is on the tenant)."""
    if not ent.has_quota:
        return None
    moment = now or dt.datetime.now(dt.UTC)
    own = [r for r in QuotaRules(moment).for_entitlement(ent) if r.key == f"entitlement:{ent.name}"]
    return quota_status(own[0] if own else None, moment)


def tenant_quota_status(tenant: Any, now: dt.datetime | None = None) -> dict[str, Any] | None:
    """The tenant's quota, shared by all its entitlements (a money quota at each one's pool's prices)."""
    if not tenant.has_quota:
        return None
    moment = now or dt.datetime.now(dt.UTC)
    rules = QuotaRules(moment)
    pools = [ent.pool for ent in tenant.entitlements.select_related("pool")]
    priced = next((pool for pool in pools if _weights(tenant, pool) is not None), None)
    if priced is None and tenant.quota_is_money:
        # A money quota with no entitlement in a pool priced in its currency: nothing can have been spent.
        window_id, reset = quota_window_of(tenant.quota_window, tenant.quota_timezone, moment)
        rule = QuotaRule("tenant", _limit(tenant), tenant.quota_window, tenant.quota_timezone,
                         unit=tenant.quota_currency, seed_window_id=window_id)
        return quota_status(rule, moment)
    return quota_status(rules.tenant_rule(tenant, priced), moment)
