"""Three ways to run a scenario: the policy's ledger itself, the gateway's in-process store, and the
gateway's Redis store (a real Redis), all on one fake clock. Each step returns a plain dict observation."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import astuple, replace
from typing import Any

from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.peers import RedisPeers
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.gateway.state import GatewayStateStore, Reservation
from apps.policy import (
    AdmissionDecision,
    AdmissionLedger,
    AdmissionRequest,
    Dynamics,
    EntitlementLimits,
    EntitlementState,
    ManualClock,
)
from apps.policy.admission import resolved_max_tokens
from apps.policy.quota import QuotaCharge, QuotaClaim, QuotaStanding
from apps.policy.window import WindowReading
from tests.conformance.scenarios import (
    CONFIG,
    Bind,
    Budget,
    Cancel,
    Complete,
    Expire,
    NewWindow,
    Offer,
    QuotaLeases,
    QuotaState,
    Scenario,
    State,
    Tick,
    Usage,
)
from tests.conformance.steps import Busy, Capacity, Leases, Race, Remove, Saturation

POOL = "conformance"


def pool_info(scenario: Scenario, entitlements: tuple[EntitlementLimits, ...], slots: int | None = None,
              kv_capacity: float | None = None) -> PoolInfo:
    reserved = tuple(
        (e.entitlement_id, e.concurrency or 0, float(e.kv_bytes or 0.0))
        for e in entitlements if e.traits.reserved and e.state is EntitlementState.BOUND
    )
    return PoolInfo(
        name=POOL, model_name="m", replica_urls=("http://backend",),
        concurrency_capacity=scenario.pool.slots if slots is None else slots,
        kv_capacity=scenario.pool.kv_capacity if kv_capacity is None else kv_capacity, kv_bytes_per_token=0, context_window=4096,
        mean_slo_ms=scenario.pool.mean_slo_ms, reserved=reserved, entitlements=entitlements,
    )


def decision_figures(decision: AdmissionDecision) -> dict[str, Any]:
    return {"reason": decision.reason, "check": decision.check, "priority": decision.priority,
            "retry_after_s": decision.retry_after_s, "max_tokens": decision.max_tokens,
            "token_cost": decision.token_cost, "kv_bytes": decision.kv_bytes, "evict": decision.evict,
            "served_class": decision.served_class}


def offered(step: Offer) -> AdmissionRequest:
    return AdmissionRequest(step.rid, step.input_tokens, step.max_tokens, step.slo_ms, step.tier)


def standing_figures(standing: QuotaStanding | None) -> tuple[str, float, float] | None:
    return None if standing is None else (standing.charge.key, standing.used, standing.reserved)


class Quotas:
    """The scenario's quotas as the gateway claims them: per entitlement, in the current window."""

    SCOPE = "tenant-1"

    def __init__(self, scenario: Scenario, clock: ManualClock) -> None:
        self.clock = clock
        self.charges = dict(scenario.quotas)
        self.limits = {limits.entitlement_id: limits for limits in scenario.entitlements}
        self.lease_s = scenario.quota_lease_s

    def claim(self, step: Offer) -> QuotaClaim | None:
        charges = self.charges.get(step.ent)
        request = AdmissionRequest(step.rid, step.input_tokens, step.max_tokens)
        max_tokens = resolved_max_tokens(self.limits[step.ent], request)
        if not charges or max_tokens is None:
            return None
        return QuotaClaim(step.rid, step.input_tokens, max_tokens, charges, self.clock.now(), scope=self.SCOPE,
                          lease_s=self.lease_s)

    def bind(self, limits: EntitlementLimits) -> None:
        self.limits[limits.entitlement_id] = limits

    def roll(self, window_id: str) -> None:
        self.charges = {name: tuple(replace(c, window_id=window_id, seed_used=0.0) for c in charges)
                        for name, charges in self.charges.items()}

    def charge(self, key: str) -> QuotaCharge:
        return next(c for charges in self.charges.values() for c in charges if c.key == key)


def tick_figures(readings: Mapping[str, WindowReading]) -> dict[str, Any]:
    """Debt and burst, and the served and demanded rates they came from (the window's figures)."""
    return {
        "dynamics": {k: (r.dynamics.debt, r.dynamics.burst) for k, r in readings.items()},
        "served": {k: astuple(r.served) for k, r in readings.items()},
        "demand": {k: astuple(r.demand) for k, r in readings.items()},
    }


def busy_figures(in_flight: Mapping[str, int], dynamics: Mapping[str, Any]) -> dict[str, Any]:
    """The gauges' reads: who has requests in flight (sorted pairs), and debt and burst by entitlement."""
    return {"busy": tuple(sorted(in_flight.items())),
            "dynamics": {name: (state.debt, state.burst) for name, state in dynamics.items()}}


def raced(observed: dict[str, Any]) -> dict[str, Any]:
    """An offer of a `Race` without its quota standing: the late offer reserved its quota before the early one
    (on the stale read), so where each stood then is not the ledger's, which offers them one after the other
    (`QuotaState` steps compare where the quota stands after the race)."""
    return {key: value for key, value in observed.items() if key != "quota"}


class LeaseBook:
    """Request leases as the Redis store keeps them (apps/gateway/lua/leases.lua), for the drivers whose state
    lives in this process (the ledger, the in-process store): nothing there outlives its process, so a holder
    that stops renewing is played by releasing its lapsed requests with their usage unknown, as the Redis
    store's reap does."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.deadlines: dict[str, float] = {}

    def hold(self, request_id: str, now: float) -> None:
        self.deadlines[request_id] = now + self.lease_s

    def renew(self, request_ids: tuple[str, ...], now: float) -> None:
        for request_id in request_ids:
            if request_id in self.deadlines:
                self.deadlines[request_id] = now + self.lease_s

    def lapsed(self, now: float) -> list[str]:
        """The lapsed leases, by deadline then id (the sorted set's order); forgotten from now on."""
        due = sorted((deadline, request_id) for request_id, deadline in self.deadlines.items() if deadline <= now)
        for _, request_id in due:
            del self.deadlines[request_id]
        return [request_id for _, request_id in due]


class LedgerDriver:
    """`apps.policy.AdmissionLedger` driven directly: the definition the stores are held to."""

    name = "ledger"

    async def start(self, scenario: Scenario, clock: ManualClock) -> None:
        self.clock, self.scenario = clock, scenario
        self.ledger = AdmissionLedger(concurrency_capacity=scenario.pool.slots, kv_capacity=scenario.pool.kv_capacity,
                                      mean_slo_ms=scenario.pool.mean_slo_ms, config=CONFIG, now=clock.now())
        for limits in scenario.entitlements:
            self.ledger.upsert_entitlement(limits, clock.now())
        self.quotas = Quotas(scenario, clock)
        self.leases = LeaseBook(scenario.lease_s)

    async def stop(self) -> None:
        self.ledger.check_invariants()

    async def run(self, step: Any) -> dict[str, Any]:
        now, ledger = self.clock.now(), self.ledger
        if isinstance(step, Offer):
            result = ledger.request(step.ent, offered(step), now, quota=self.quotas.claim(step))
            # a refused duplicate of a request in flight is rejected, whatever the state of the one in flight
            decided = result.decision.admitted or result.decision.queued
            state = ledger.request_state(step.rid) if decided else None
            if state is not None:
                self.leases.hold(step.rid, now)
            return {"state": state or "rejected", "started": result.started,
                    "evicted": result.evicted, **decision_figures(result.decision),
                    "quota": standing_figures(None if result.quota is None else result.quota.standing)}
        if isinstance(step, Race):  # decided one after the other: what the late one's second read sees
            early = raced(await self.run(step.early))
            return {"late": raced(await self.run(step.late)), "early": early}
        # Who started is seen by `State` steps (a store's sync reports its starts to its waiting room only).
        if isinstance(step, Capacity):
            ledger.set_capacity(step.slots, now, step.kv_capacity)
            return {}
        if isinstance(step, Saturation):
            ledger.set_saturation(step.value, now)
            return {}
        if isinstance(step, Remove):  # as the in-process store marks an entitlement gone from the snapshot
            limits = ledger.limits(step.ent)
            assert limits is not None
            ledger.upsert_entitlement(replace(limits, state=EntitlementState.EXPIRED), now)
            return {}
        if isinstance(step, Leases):
            self.leases.renew(step.renew, now)
            reaped = [rid for rid in self.leases.lapsed(now) if ledger.request_state(rid) is not None]
            for rid in reaped:
                ledger.release(rid, now)
            return {"reaped": len(reaped)}
        if isinstance(step, Bind):
            ledger.upsert_entitlement(step.limits, now)
            self.quotas.bind(step.limits)
            return {}
        if isinstance(step, NewWindow):
            self.quotas.roll(step.window_id)
            return {}
        if isinstance(step, QuotaState):
            standing = ledger.quotas.standing(self.quotas.charge(step.key))
            return {"used": standing.used, "reserved": standing.reserved}
        if isinstance(step, QuotaLeases):
            ledger.quotas.renew(step.renew, now + step.lease_s)
            return {"reaped": tuple(ledger.quotas.reap(now))}
        if isinstance(step, Complete | Cancel):
            output = step.output if isinstance(step, Complete) else None
            prompt = step.prompt if isinstance(step, Complete) else None
            released = ledger.release(step.rid, now, output_tokens=output, prompt_tokens=prompt)
            return {"outcome": released.outcome, "started": released.started, "refund": released.refunded_tokens}
        if isinstance(step, Expire):
            expired = tuple(ledger.expire_waiting(now))
            for rid in expired:  # the gateway releases an expired waiter too (a no-op for the ledger)
                ledger.release(rid, now, output_tokens=0, prompt_tokens=0)
            return {"expired": expired}
        if isinstance(step, State):
            return {"state": ledger.request_state(step.rid) or "gone"}
        if isinstance(step, Budget):
            return {"started": ledger.set_budget(step.budget, now)}
        if isinstance(step, Tick):
            return tick_figures(ledger.tick_changes(now) or {})
        if isinstance(step, Busy):
            records = ledger.entitlement_records()
            return busy_figures(ledger.in_flight_counts(),
                                {name: records[name].dynamics if name in records else Dynamics() for name in step.ents})
        if isinstance(step, Usage):
            usage = ledger.usage(step.ent, now)
            return {"in_flight": usage.in_flight, "running": usage.running, "tokens": usage.tokens_available}
        raise TypeError(step)


class InterleavedRedisStore(RedisStateStore):
    """The Redis store with a seam between an offer's snapshot (READ's, or one kept from an earlier reply) and
    its commit: `between` (once set) runs right after the next offer has its snapshot, so another store's offer
    can change the pool before this one commits; commits that met a changed pool are counted (the
    compare-and-set failures the `Race` step must provoke)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.between: Callable[[], Awaitable[Any]] | None = None
        self.stale_commits = 0

    async def _decided_on(self, *args: Any, **kwargs: Any) -> Any:
        snapshot = await super()._decided_on(*args, **kwargs)
        between, self.between = self.between, None
        if between is not None:
            await between()
        return snapshot

    async def _call(self, name: str, keys: list[str], args: Any) -> Any:
        raw = await super()._call(name, keys, args)
        if name == "commit" and int(raw[0]) != 1:
            self.stale_commits += 1
        return raw


class StoreDriver:
    """A gateway state store: the in-process one or the Redis one."""

    def __init__(self, name: str, redis_url: str | None = None) -> None:
        self.name = name
        self.redis_url = redis_url

    def _store(self, clock: ManualClock) -> GatewayStateStore:
        if self.name == "memory":
            return MemoryStateStore(clock, config=CONFIG)
        return self._redis_store(clock, InterleavedRedisStore)

    def _redis_store(self, clock: ManualClock, kind: type[RedisStateStore] = RedisStateStore) -> RedisStateStore:
        assert self.redis_url is not None
        return kind(url=self.redis_url, clock=clock, config=CONFIG, prefix=self.prefix,
                    lease_s=self.scenario.lease_s)

    async def start(self, scenario: Scenario, clock: ManualClock) -> None:
        self.clock, self.scenario = clock, scenario
        self.prefix = f"tp:conf:{uuid.uuid4().hex}:"
        self.store = self._store(clock)
        # A second gateway process on the same Redis (`Race`), opened when a scenario needs it.
        self.other: RedisStateStore | None = None
        self.limits = {limits.entitlement_id: limits for limits in scenario.entitlements}
        self.removed: dict[str, EntitlementLimits] = {}
        self.slots, self.kv_capacity, self.saturation = scenario.pool.slots, scenario.pool.kv_capacity, 0.0
        self.pool = pool_info(scenario, scenario.entitlements)
        self.reservations: dict[str, Reservation] = {}
        self.quotas = Quotas(scenario, clock)
        # The in-process store has no leases (nothing outlives its process): its holders' lapses are played.
        self.leases = LeaseBook(scenario.lease_s) if self.name == "memory" else None
        await self.store.sync_pool(pool=self.pool)

    async def stop(self) -> None:
        await self.store.close()
        if self.other is not None:
            await self.other.close()

    async def _sync(self) -> None:
        self.pool = pool_info(self.scenario, tuple(self.limits.values()), self.slots, self.kv_capacity)
        await self.store.sync_pool(pool=self.pool, saturation=self.saturation)

    def _limits(self, name: str) -> EntitlementLimits:
        return self.limits.get(name) or self.removed[name]

    async def _offer(self, step: Offer, store: GatewayStateStore) -> dict[str, Any]:
        offer = await store.offer(limits=self._limits(step.ent), pool=self.pool, request=offered(step),
                                  saturation=self.saturation, quota=self.quotas.claim(step))
        if offer.reservation is not None:
            self.reservations[step.rid] = offer.reservation
            if self.leases is not None:
                self.leases.hold(step.rid, self.clock.now())
        return {"state": offer.state, "started": offer.started, "evicted": offer.evicted,
                **decision_figures(offer.decision), "quota": standing_figures(offer.quota)}

    async def _race(self, step: Race) -> dict[str, Any]:
        store = self.store
        if not isinstance(store, InterleavedRedisStore):  # one process: the offers come one after the other
            early = raced(await self._offer(step.early, store))
            return {"late": raced(await self._offer(step.late, store)), "early": early}
        if self.other is None:
            self.other = self._redis_store(self.clock)
            await self.other.sync_pool(pool=self.pool, saturation=self.saturation)
        other = self.other
        observed: dict[str, Any] = {}

        async def early() -> None:
            observed["early"] = await self._offer(step.early, other)

        stale = store.stale_commits
        store.between = early
        late = await self._offer(step.late, store)
        assert store.between is None and "early" in observed, "the late offer never read the pool"
        if observed["early"]["state"] != "rejected" and late["state"] != "rejected":
            assert store.stale_commits > stale, "the late offer's commit did not meet the changed pool"
        return {"late": raced(late), "early": raced(observed["early"])}

    async def _reap(self, step: Leases) -> dict[str, Any]:
        store, now = self.store, self.clock.now()
        if self.leases is None:  # as the gateway's lease tick drives them (`apps.gateway.peers.RedisPeers`)
            assert isinstance(store, RedisStateStore)
            return {"reaped": await RedisPeers(store).leases(pool=POOL, request_ids=step.renew)}
        self.leases.renew(step.renew, now)
        reaped = 0
        for rid in self.leases.lapsed(now):
            reservation = self.reservations[rid]
            if await store.request_state(reservation=reservation) is not None:
                await store.release(reservation=reservation)
                reaped += 1
        return {"reaped": reaped}

    async def run(self, step: Any) -> dict[str, Any]:
        store = self.store
        if isinstance(step, Offer):
            return await self._offer(step, store)
        if isinstance(step, Race):
            return await self._race(step)
        if isinstance(step, Capacity):
            self.slots = step.slots
            if step.kv_capacity is not None:
                self.kv_capacity = step.kv_capacity
            await self._sync()
            return {}
        if isinstance(step, Saturation):
            self.saturation = step.value
            await self._sync()
            return {}
        if isinstance(step, Remove):
            self.removed[step.ent] = replace(self.limits.pop(step.ent), state=EntitlementState.EXPIRED)
            await self._sync()
            return {}
        if isinstance(step, Leases):
            return await self._reap(step)
        if isinstance(step, Bind):
            self.limits[step.limits.entitlement_id] = step.limits
            self.quotas.bind(step.limits)
            await self._sync()
            return {}
        if isinstance(step, NewWindow):
            self.quotas.roll(step.window_id)
            return {}
        if isinstance(step, QuotaState):
            [standing] = await store.quota_standings(scope=Quotas.SCOPE, charges=[self.quotas.charge(step.key)])
            return {"used": standing.used, "reserved": standing.reserved}
        if isinstance(step, QuotaLeases):
            reaped = await store.quota_leases(scope=Quotas.SCOPE, request_ids=step.renew, lease_s=step.lease_s)
            return {"reaped": tuple(reaped)}
        if isinstance(step, Complete | Cancel):
            reservation = self.reservations[step.rid]
            if isinstance(step, Complete):
                released = await store.release(reservation=reservation, prompt_tokens=step.prompt,
                                               completion_tokens=step.output)
            else:
                released = await store.release(reservation=reservation)
            return {"outcome": released.outcome, "started": released.started, "refund": released.refunded_tokens}
        if isinstance(step, Expire):
            expired = tuple(await store.expire(pool=POOL))
            for rid in expired:  # as the gateway does: a waiter that expired is released with nothing used
                await store.release(reservation=self.reservations[rid], prompt_tokens=0, completion_tokens=0)
            return {"expired": expired}
        if isinstance(step, State):
            return {"state": await store.request_state(reservation=self.reservations[step.rid]) or "gone"}
        if isinstance(step, Budget):
            return {"started": tuple(await store.pool_budgets_set(budgets={POOL: step.budget}))}
        if isinstance(step, Tick):
            return tick_figures((await store.tick(entitlements={POOL: tuple(self.limits.values())})).get(POOL, {}))
        if isinstance(step, Busy):
            return busy_figures(await store.in_flight(pool=self.pool),
                                await store.dynamics(pool=POOL, entitlements=step.ents))
        if isinstance(step, Usage):
            usage = await store.entitlement_usage(limits=self._limits(step.ent), pool=POOL)
            return {"in_flight": usage.in_flight, "running": usage.running, "tokens": usage.tokens_available}
        raise TypeError(step)
