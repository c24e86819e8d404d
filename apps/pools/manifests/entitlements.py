"""Writing a manifest's entitlements at scale: what ``entitlement_create`` / ``entitlement_update`` do for each
document, in the same order and with the same outcome, with the tenants and pools looked up once, each pool
locked and loaded once (``apps.pools.binding.PoolBinding``: the binding each write runs, in memory) and the
states and history written in bulk at the end (``finish``). Each created or changed entitlement is still
saved on its own (its ``post_save`` signal sent).

The manifest was validated just before, in the same transaction (``apps.pools.manifests.apply``); the model's
checks (``full_clean``, money quotas, the owner's right) are run again here as the services run them, except
the foreign keys' and the name's existence queries, which the loaded objects answer.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from apps.pools.binding import PoolBinding, write_history
from apps.pools.manifests.reader import ENTITLEMENT_PATHS, Plan, changed_paths
from apps.pools.models import EntitlementState, EntitlementStateChange, TokenEntitlement, TokenPool
from apps.pools.services import _check_entitlement, _lock_pool
from apps.tenancy.models import Tenant
from apps.tenancy.permissions import require_owner

# What full_clean leaves out: the binding's fields, and the keys whose rows were just loaded.
_NOT_CHECKED = ["state", "state_reason", "state_changed_at", "tenant", "pool"]
CHUNK = 500  # names per `IN (...)` query: far below every database's bound on parameters


def in_chunks(names: Iterable[str]) -> Iterable[list[str]]:
    names = list(names)
    for start in range(0, len(names), CHUNK):
        yield names[start:start + CHUNK]


def existing_by_name(names: Iterable[str]) -> dict[str, TokenEntitlement]:
    """The stored entitlements of these names (with tenant and pool), locked for the transaction."""
    found: dict[str, TokenEntitlement] = {}
    for chunk in in_chunks(names):
        found.update({e.name: e for e in TokenEntitlement.objects.select_for_update().filter(name__in=chunk)})
    # The few tenants and pools they use, loaded once and shared (a join would build them once per row).
    tenants = Tenant.objects.in_bulk({e.tenant_id for e in found.values()})
    pools = TokenPool.objects.in_bulk({e.pool_id for e in found.values()})
    for ent in found.values():
        ent.tenant, ent.pool = tenants[ent.tenant_id], pools[ent.pool_id]
    return found


def _entitlement_values_of(ent: TokenEntitlement) -> dict[str, Any]:
    return {name: getattr(ent, name) for name in ENTITLEMENT_PATHS if name not in ("name", "tenant")}


def _check(ent: TokenEntitlement) -> None:
    """``services._check_entitlement`` without the queries whose answers are loaded (tenant and pool exist; the
    names were looked up in bulk)."""
    _check_entitlement(ent, exclude=_NOT_CHECKED, validate_unique=False)


class EntitlementWriter:
    """Applies entitlement plans one by one (``write``), then writes the binding's outcome (``finish``)."""

    def __init__(self, actor: Any, now: dt.datetime, plans: list[Plan]) -> None:
        self.actor = actor
        self.now = now
        slugs = {p.values["tenant_slug"] for p in plans}
        pools = {p.values["pool_name"] for p in plans}
        self.tenants: dict[str, Tenant] = {}
        self.pools: dict[str, TokenPool] = {}
        for chunk in in_chunks(slugs):
            self.tenants.update({t.slug: t for t in Tenant.objects.filter(slug__in=chunk)})
        for chunk in in_chunks(pools):
            self.pools.update({p.name: p for p in TokenPool.objects.filter(name__in=chunk)})
        self.bindings: dict[int, PoolBinding] = {}
        self.history: list[EntitlementStateChange] = []
        self._allowed: set[tuple[int, str]] = set()

    def _binding(self, pool_id: int) -> PoolBinding:
        if pool_id not in self.bindings:
            self.bindings[pool_id] = PoolBinding(_lock_pool(pool_id), self.now, self.history)
        return self.bindings[pool_id]

    def _require_owner(self, tenant: Tenant, action: str) -> None:
        if (tenant.pk, action) not in self._allowed:
            require_owner(self.actor, tenant, action)
            self._allowed.add((tenant.pk, action))

    def write(self, plan: Plan) -> tuple[str, tuple[str, ...]]:
        values = dict(plan.values)
        tenant = self.tenants[values.pop("tenant_slug")]
        values["pool"] = self.pools[values.pop("pool_name")]
        if plan.existing is None:
            self._create(plan.name, tenant, values)
            return "created", ()
        fields = changed_paths(_entitlement_values_of(plan.existing), values, ENTITLEMENT_PATHS)
        if not fields:
            return "unchanged", ()
        self._update(plan.existing, values)
        return "updated", fields

    def _create(self, name: str, tenant: Tenant, values: dict[str, Any]) -> None:
        """``entitlement_create``: written Pending, then its pool binds it."""
        self._require_owner(tenant, "create entitlements")
        ent = TokenEntitlement(**values, name=name, tenant=tenant, state=EntitlementState.PENDING,
                               state_reason="created", state_changed_at=self.now, created_at=self.now,
                               updated_at=self.now)
        _check(ent)
        binding = self._binding(ent.pool.pk)  # lock before inserting: the insert changes what the pool must hold
        ent.save()
        self.history.append(EntitlementStateChange(entitlement=ent, from_state="", to_state=ent.state,
                                                   reason="created", at=self.now))
        binding.added(ent, "")

    def _update(self, existing: TokenEntitlement, values: dict[str, Any]) -> None:
        """``entitlement_update``: the fields saved, then the pool (both pools, when it moves) binds again."""
        self._require_owner(existing.tenant, "change entitlements")
        old = self._binding(existing.pool_id)
        ent = old.get(existing.pk) or existing
        ent.tenant = existing.tenant  # loaded with the manifest: no query for the checks below
        for name, value in values.items():
            setattr(ent, name, value)
        ent.updated_at = self.now
        _check(ent)
        new = self._binding(ent.pool.pk)
        ent.save(update_fields=[*values, "updated_at"])  # the state is the binding's, written by `finish`
        trigger = f"entitlement {ent.name} updated"
        if new is old:
            old.changed(ent, trigger)
            return
        stored = old.stored[ent.pk]  # as the database holds it until `finish`
        for binding in sorted((old, new), key=lambda b: b.pool.pk):  # as the service evaluates them: by pool id
            if binding is old:
                old.removed(ent, trigger)
            else:
                new.added(ent, trigger)
        new.stored[ent.pk] = stored

    def finish(self) -> None:
        """Write every binding's changed states, then the history rows in the order the writes made them."""
        for binding in self.bindings.values():
            binding.flush()
        write_history(self.history)
