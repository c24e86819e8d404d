"""The gateway's view of what its state store holds, every process together, read once a second for /metrics
(`gateway_store_in_flight`, the entitlements' debt, burst and priority, quotas): unlike a process's own gauges,
a reservation nobody will release shows here. `BackgroundLoops` (apps.gateway.background) owns one and
refreshes it every `STORE_VIEW_S`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

from apps.gateway.snapshot import EntitlementIndex
from apps.gateway.state import GatewayStateStore, StateStoreUnavailable
from apps.policy import EntitlementLimits
from apps.policy.admission import request_priority

# How often the store's own in-flight counts are read for /metrics.
STORE_VIEW_S = 1.0
# Entitlements whose debt, burst and priority one store view reads beside those with requests in flight: a
# slice that turns over (with 10,000 entitlements each idle one is read every 20 s). Reading all of them every
# second cost an idle gateway on Redis 10,000 round trips a second (more than half a core).
STORE_VIEW_IDLE_READS = 500
# Reads of the in-process store in one turn of the event loop before the view lets requests run.
STORE_VIEW_READS_PER_TURN = 50
# (owner: entitlement name or tenant slug, unit) -> (used, reserved, limit)
QuotaView = dict[tuple[str, str], tuple[float, float, float]]


class StoreView:
    def __init__(self) -> None:
        # The store's own in-flight counts (pool, entitlement) -> n.
        self.in_flight: dict[tuple[str, ...], float] = {}
        # (pool, entitlement) -> (debt, burst, priority of a request now), as last read from the store.
        self.dynamics: dict[tuple[str, ...], tuple[float, float, float]] = {}
        # (entitlement, unit) -> (used, reserved, limit) of the entitlement's own quota in the current window,
        # and (tenant slug, unit) -> the same of a tenant's shared quota: once per tenant, not per entitlement.
        self.quotas: QuotaView = {}
        self.tenant_quotas: QuotaView = {}
        self._idle_cursor: dict[str, int] = {}  # pool -> where the next slice of idle entitlements starts
        self._pool_index = EntitlementIndex()
        self._viewed_snapshot: Any = None  # the snapshot the last view read
        self._busy_keys: set[tuple[str, ...]] = set()  # those the last view found busy
        self._quota_entries: list[Any] = []  # the snapshot's keys whose quotas the view reads, one each

    async def refresh(self, store: GatewayStateStore | None, snapshot: Any) -> None:
        """Read what `store` holds now of `snapshot`'s entitlements (nothing without either). Its cost is that of
        the entitlements with requests in flight and a turning slice of the idle ones, whatever their number."""
        if store is None or snapshot is None:
            return
        self._new_snapshot_view(snapshot)
        # What this view read: applied to the published views at the end, in place (what it costs is what was
        # busy and the slice read, not every entitlement), or not at all when the store is away.
        in_flight: dict[tuple[str, ...], float] = {}
        dynamics: dict[tuple[str, ...], tuple[float, float, float]] = {}
        try:
            for pool in list(snapshot.pools.values()):
                by_id = self._pool_index.of(pool.name, pool.entitlements)
                busy = {name: count for name, count in (await store.in_flight(pool=pool)).items() if name in by_id}
                for name, count in busy.items():
                    in_flight[(pool.name, name)] = float(count)
                chosen = self.entitlements_to_read(pool, busy)
                read = await store.dynamics(pool=pool.name, entitlements=[limits.entitlement_id for limits in chosen])
                for index, limits in enumerate(chosen, 1):
                    state = read[limits.entitlement_id]
                    priority = request_priority(limits.traits, limits.slo_target_ms, pool.mean_slo_ms, state.burst,
                                                state.debt, store.config)
                    dynamics[(pool.name, limits.entitlement_id)] = (state.debt, state.burst, priority)
                    if index % STORE_VIEW_READS_PER_TURN == 0:
                        await asyncio.sleep(0)  # let requests in between
            quotas, tenant_quotas = await self._quota_view(store)
        except StateStoreUnavailable:
            return  # keep the last view: the store's own state did not change by being unreachable
        # Every entitlement of the snapshot is listed (at 0 unless the store holds requests of it): the ones busy
        # last time and not now go back to 0. Values change in place; keys only with a new snapshot (and the
        # dynamics of an entitlement read for the first time), so a scrape copying the view sees one whole view.
        view = self.in_flight
        for key in self._busy_keys - in_flight.keys():
            view[key] = 0.0
        view.update(in_flight)
        self._busy_keys = set(in_flight)
        self.dynamics.update(dynamics)
        self.quotas, self.tenant_quotas = quotas, tenant_quotas

    def _new_snapshot_view(self, snapshot: Any) -> None:
        """On a new snapshot, the views list its entitlements: every (pool, entitlement) pair at 0 in flight, and
        the last readings of those it still holds (the others' are dropped). Once per snapshot."""
        if snapshot is self._viewed_snapshot:
            return
        self._viewed_snapshot = snapshot
        held = [(pool.name, limits.entitlement_id) for pool in snapshot.pools.values() for limits in pool.entitlements]
        self.in_flight = dict.fromkeys(held, 0.0)
        self._busy_keys = set()
        self.dynamics = {key: value for key, value in self.dynamics.items()
                               if key in self.in_flight}
        # The entitlements whose quotas the view reads: one key each (a quota is the entitlement's, not the key's).
        seen: set[str] = set()
        self._quota_entries = []
        for entry in snapshot.keys.values():
            if entry.quotas and entry.entitlement not in seen:
                seen.add(entry.entitlement)
                self._quota_entries.append(entry)

    def entitlements_to_read(self, pool: Any, busy: Mapping[str, int]) -> list[EntitlementLimits]:
        """The pool's entitlements whose dynamics this view reads: all of a pool of up to `STORE_VIEW_IDLE_READS`;
        of a larger one, a turning slice of that many plus those with requests in flight (`busy`). The cost
        stays that of the slice and the busy ones, whatever the pool's size (the others keep their last
        reading)."""
        entitlements = pool.entitlements
        size = len(entitlements)
        if size <= STORE_VIEW_IDLE_READS:
            return list(entitlements)
        start = self._idle_cursor.get(pool.name, 0) % size
        self._idle_cursor[pool.name] = start + STORE_VIEW_IDLE_READS
        chosen = list(entitlements[start:start + STORE_VIEW_IDLE_READS])
        if start + STORE_VIEW_IDLE_READS > size:
            chosen += entitlements[:start + STORE_VIEW_IDLE_READS - size]
        in_slice = {limits.entitlement_id for limits in chosen}
        by_id = self._pool_index.of(pool.name, pool.entitlements)
        chosen += [by_id[name] for name in busy if name not in in_slice]
        return chosen

    async def _quota_view(self, store: GatewayStateStore) -> tuple[QuotaView, QuotaView]:
        """Each quota'd entitlement's own quota and each tenant's shared one, as the store holds them now
        (every process together). A tenant's quota is one number whichever entitlement reads it: it is kept
        once, under the tenant, so that a sum over entitlements cannot count it twice."""
        now = dt.datetime.now(dt.UTC)
        own: QuotaView = {}
        shared: QuotaView = {}
        for entry in self._quota_entries:
            charges = [rule.charge_at(now) for rule in entry.quotas]
            for standing in await store.quota_standings(scope=str(entry.tenant_id), charges=charges):
                charge = standing.charge
                if charge.key == "tenant":
                    shared[(entry.tenant_slug, charge.unit)] = (standing.used, standing.reserved, charge.limit)
                else:
                    own[(entry.entitlement, charge.unit)] = (standing.used, standing.reserved, charge.limit)
        return own, shared

    def register_gauges(self, add: Callable[..., None]) -> None:
        """The gauges read from this view: the store's debt, burst and priority, quotas and in-flight counts."""
        def dynamics(index: int) -> Callable[[], dict[tuple[str, ...], float]]:
            # A copy first (one step, under the interpreter's lock): the store view adds keys on the event loop.
            return lambda: {key: values[index] for key, values in dict(self.dynamics).items()}

        for index, (name, text) in enumerate((
                ("tokenpools_entitlement_debt", "Service debt (seed 000, (2)) as the state store holds it."),
                ("tokenpools_entitlement_burst", "Burst (seed 000, (3)) as the state store holds it."),
                ("tokenpools_entitlement_priority", "Priority weight (seed 000, (1)) a request would get now."))):
            add(name, text, ("pool", "entitlement"), dynamics(index))

        def quota(shared: bool, index: int, tokens: bool) -> Callable[[], dict[tuple[str, ...], float]]:
            def collect() -> dict[tuple[str, ...], float]:
                view = self.tenant_quotas if shared else self.quotas
                return {(owner,) if tokens else (owner, unit): values[index]
                        for (owner, unit), values in view.items() if (unit == "tokens") == tokens}
            return collect

        for shared, (family, label, whose) in enumerate((
                ("tokenpools_entitlement_quota", "entitlement", "the entitlement's own quota"),
                ("tokenpools_tenant_quota", "tenant", "the tenant's shared quota (once per tenant)"))):
            for index, what in enumerate(("used", "reserved", "limit")):
                text = {"used": "used by finished requests", "reserved": "reserved by requests running now",
                        "limit": "the limit"}[what]
                add(f"{family}_{what}_tokens", f"{whose.capitalize()} in the current window, {text} (the state "
                    "store, every process).", (label,), quota(bool(shared), index, tokens=True))
                add(f"{family}_{what}_amount", f"{whose.capitalize()} in money in the current window, {text}, in "
                    "its currency.", (label, "currency"), quota(bool(shared), index, tokens=False))
        add("gateway_store_in_flight", "Requests the state store holds in flight (every process together), "
            "as last read.", ("pool", "entitlement"), lambda: dict(self.in_flight))
