"""Three ways to run a scenario: the policy's ledger itself, the gateway's in-process store, and the
gateway's Redis store (a real Redis), all on one fake clock. Each step returns a plain dict observation."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import astuple, replace
from typing import Any

from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.gateway.state import GatewayStateStore, Reservation
from apps.policy import (
    AdmissionDecision,
    AdmissionLedger,
    AdmissionRequest,
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

POOL = "conformance"


def pool_info(scenario: Scenario, entitlements: tuple[EntitlementLimits, ...]) -> PoolInfo:
    reserved = tuple(
        (e.entitlement_id, e.concurrency or 0, float(e.kv_bytes or 0.0))
        for e in entitlements if e.traits.reserved and e.state is EntitlementState.BOUND
    )
    return PoolInfo(
        name=POOL, model_name="m", replica_urls=("http://backend",), concurrency_capacity=scenario.pool.slots,
        kv_capacity=scenario.pool.kv_capacity, kv_bytes_per_token=0, context_window=4096,
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

    async def stop(self) -> None:
        self.ledger.check_invariants()

    async def run(self, step: Any) -> dict[str, Any]:
        now, ledger = self.clock.now(), self.ledger
        if isinstance(step, Offer):
            result = ledger.request(step.ent, offered(step), now, quota=self.quotas.claim(step))
            return {"state": ledger.request_state(step.rid) or "rejected", "started": result.started,
                    "evicted": result.evicted, **decision_figures(result.decision),
                    "quota": standing_figures(None if result.quota is None else result.quota.standing)}
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
            return tick_figures(ledger.tick_readings(now) or {})
        if isinstance(step, Usage):
            usage = ledger.usage(step.ent, now)
            return {"in_flight": usage.in_flight, "running": usage.running, "tokens": usage.tokens_available}
        raise TypeError(step)


class StoreDriver:
    """A gateway state store: the in-process one or the Redis one."""

    def __init__(self, name: str, redis_url: str | None = None) -> None:
        self.name = name
        self.redis_url = redis_url

    def _store(self, clock: ManualClock) -> GatewayStateStore:
        if self.name == "memory":
            return MemoryStateStore(clock, config=CONFIG)
        assert self.redis_url is not None
        return RedisStateStore(url=self.redis_url, clock=clock, config=CONFIG, prefix=f"tp:conf:{uuid.uuid4().hex}:")

    async def start(self, scenario: Scenario, clock: ManualClock) -> None:
        self.clock, self.scenario = clock, scenario
        self.store = self._store(clock)
        self.pool = pool_info(scenario, scenario.entitlements)
        self.limits = {limits.entitlement_id: limits for limits in scenario.entitlements}
        self.reservations: dict[str, Reservation] = {}
        self.quotas = Quotas(scenario, clock)
        await self.store.sync_pool(pool=self.pool)

    async def stop(self) -> None:
        await self.store.close()

    async def run(self, step: Any) -> dict[str, Any]:
        store = self.store
        if isinstance(step, Offer):
            offer = await store.offer(limits=self.limits[step.ent], pool=self.pool,
                                      request=offered(step),
                                      quota=self.quotas.claim(step))
            if offer.reservation is not None:
                self.reservations[step.rid] = offer.reservation
            return {"state": offer.state, "started": offer.started, "evicted": offer.evicted,
                    **decision_figures(offer.decision), "quota": standing_figures(offer.quota)}
        if isinstance(step, Bind):
            self.limits[step.limits.entitlement_id] = step.limits
            self.quotas.bind(step.limits)
            self.pool = pool_info(self.scenario, tuple(self.limits.values()))
            await store.sync_pool(pool=self.pool)
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
            return tick_figures(await store.tick(entitlements={POOL: tuple(self.limits.values())}))
        if isinstance(step, Usage):
            usage = await store.entitlement_usage(limits=self.limits[step.ent], pool=POOL)
            return {"in_flight": usage.in_flight, "running": usage.running, "tokens": usage.tokens_available}
        raise TypeError(step)
