"""The in-process store: one `apps.policy.AdmissionLedger` per pool, driven on the server's event loop.

Nothing here decides or moves state: every transition is the ledger's (the same object the simulator
drives). This adapter only keeps each ledger's pool in step with the gateway's snapshot, reads the clock,
and hands the transitions' side effects to the waiting room (started and expired waiters) and to the
gateway (evicted requests). On one asyncio loop the ledger is never entered concurrently, so no locks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from apps.gateway.snapshot import PoolInfo
from apps.gateway.state import (
    REJECTED,
    GatewayStateStore,
    Offer,
    Reservation,
    UsageKey,
    rate_view,
    reservation_for,
)
from apps.policy import (
    AdmissionConfig,
    AdmissionLedger,
    AdmissionRequest,
    Clock,
    Dynamics,
    DynamicsConfig,
    EntitlementLimits,
    EntitlementState,
    EntitlementUsage,
    MonotonicClock,
)
from apps.policy.admission import DEFAULT_ADMISSION_CONFIG
from apps.policy.ledger import OUTCOME_UNKNOWN, WAITING, ReleaseResult
from apps.policy.quota import QuotaBook, QuotaCharge, QuotaClaim, QuotaStanding
from apps.policy.quota_offer import settlement
from apps.policy.window import WindowReading


class MemoryStateStore(GatewayStateStore):
    def __init__(self, clock: Clock | None = None, *, config: AdmissionConfig = DEFAULT_ADMISSION_CONFIG,
                 dynamics_config: DynamicsConfig | None = None) -> None:
        super().__init__()
        self.clock = clock or MonotonicClock()
        self.config = config
        self.dynamics_config = dynamics_config
        self._ledgers: dict[str, AdmissionLedger] = {}
        self._synced: dict[str, PoolInfo] = {}
        # The pools' dispatch budgets, also for a pool whose ledger does not exist yet.
        self._budgets: dict[str, int | None] = {}
        # One book for every pool's ledger: a tenant's quota covers all its entitlements.
        self.quotas = QuotaBook()

    # --- the pool as the snapshot describes it --------------------------------------------------------

    def ledger(self, pool: str) -> AdmissionLedger | None:
        return self._ledgers.get(pool)

    def _ledger(self, pool: PoolInfo, now: float) -> AdmissionLedger:
        ledger = self._ledgers.get(pool.name)
        if ledger is None:
            ledger = self._ledgers[pool.name] = AdmissionLedger(
                concurrency_capacity=max(0, pool.concurrency_capacity), kv_capacity=pool.kv_capacity,
                mean_slo_ms=pool.mean_slo_ms, config=self.config, dynamics_config=self.dynamics_config, now=now,
                quotas=self.quotas,
            )
            ledger.set_budget(self._budgets.get(pool.name), now)
        if self._synced.get(pool.name) is not pool:
            self._apply(pool, ledger, now)
        return ledger

    def _apply(self, pool: PoolInfo, ledger: AdmissionLedger, now: float) -> None:
        ledger.set_mean_slo_ms(pool.mean_slo_ms)
        started = list(ledger.set_capacity(max(0, pool.concurrency_capacity), now, pool.kv_capacity))
        present = {limits.entitlement_id for limits in pool.entitlements}
        for limits in pool.entitlements:
            started += ledger.upsert_entitlement(limits, now)
        for name in list(ledger.entitlement_ids()):
            old = ledger.limits(name)
            if (name not in present and old is not None and old.state is not EntitlementState.EXPIRED
                    and not old.tier_of):  # a tier is reached through its entitlement only (apps.policy.tiers)
                # Gone from the pool (deleted, moved): its running requests finish, nothing new is admitted.
                started += ledger.upsert_entitlement(replace(old, state=EntitlementState.EXPIRED), now)
        self._synced[pool.name] = pool
        self._notify(started=started)

    async def sync_pool(self, *, pool: PoolInfo, saturation: float = 0.0) -> None:
        now = self.clock.now()
        ledger = self._ledger(pool, now)
        if saturation != ledger.saturation:
            self._notify(started=ledger.set_saturation(saturation, now))

    # --- the transitions -------------------------------------------------------------------------------

    async def offer(
        self, *, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, saturation: float = 0.0,
        quota: QuotaClaim | None = None,
    ) -> Offer:
        now = self.clock.now()
        ledger = self._ledger(pool, now)
        if saturation != ledger.saturation:
            self._notify(started=ledger.set_saturation(saturation, now))
        result = ledger.request(limits.entitlement_id, request, now, limits=limits, quota=quota)
        decision = result.decision
        usage = ledger.usage(limits.entitlement_id, now)
        view = rate_view(limits, usage.in_flight, usage.tokens_available)
        standing = None if result.quota is None else result.quota.standing
        state = ledger.request_state(request.request_id) if (decision.admitted or decision.queued) else None
        if state is None:
            return Offer(decision, None, view, REJECTED, quota=standing)
        if state == WAITING:
            self._expect(request.request_id)
        others = [started for started in result.started if started != request.request_id]
        self._notify(started=others, evicted=result.evicted)
        return Offer(decision, reservation_for(limits, pool.name, request, decision, quota), view, state,
                     result.started, result.evicted, quota=standing)

    async def release(
        self, *, reservation: Reservation, prompt_tokens: int | None = None, completion_tokens: int | None = None,
        usage: UsageKey | None = None,
    ) -> ReleaseResult:
        # Usage is counted by the process (`apps.gateway.peers.Alone`: no `usage` key comes here).
        self._forget(reservation.request_id)
        ledger = self._ledgers.get(reservation.pool)
        if ledger is None:
            self.quotas.settle(reservation.request_id, *settlement(OUTCOME_UNKNOWN, 0, 0, completion_tokens,
                                                                   prompt_tokens))
            return ReleaseResult(OUTCOME_UNKNOWN)
        result = ledger.release(reservation.request_id, self.clock.now(), output_tokens=completion_tokens,
                                prompt_tokens=prompt_tokens)
        self._notify(started=result.started)
        return result

    async def expire(self, *, pool: str) -> list[str]:
        ledger = self._ledgers.get(pool)
        if ledger is None:
            return []
        result = ledger.wake(self.clock.now())
        self._notify(started=result.started, gone=result.expired)
        return list(result.expired)

    async def tick(
        self, *, entitlements: Mapping[str, Sequence[EntitlementLimits]]
    ) -> dict[str, dict[str, WindowReading]]:
        # Each ledger knows its pool's entitlements (kept in step with the snapshot).
        now = self.clock.now()
        by_pool: dict[str, dict[str, WindowReading]] = {}
        for pool, ledger in self._ledgers.items():
            changes = ledger.tick_changes(now)
            if changes is not None:
                by_pool[pool] = changes
        return by_pool

    async def pool_budgets_set(self, *, budgets: Mapping[str, int | None]) -> list[str]:
        now = self.clock.now()
        started: list[str] = []
        for pool, budget in budgets.items():
            self._budgets[pool] = budget
            ledger = self._ledgers.get(pool)
            if ledger is not None:
                started += ledger.set_budget(budget, now)
        self._notify(started=started)
        return started

    async def pool_budget(self, *, pool: str) -> int | None:
        return self._budgets.get(pool)

    # --- reads ------------------------------------------------------------------------------------------

    async def quota_leases(self, *, scope: str, request_ids: Sequence[str], lease_s: float) -> list[str]:
        # One book for every scope: the in-process holds of every tenant are renewed and reaped together.
        now = self.clock.now()
        self.quotas.renew(request_ids, now + lease_s)
        return self.quotas.reap(now)

    async def ping(self, *, timeout_s: float) -> None:
        """In this process: it always answers."""

    async def close(self) -> None:
        """In this process: no connection to let go of (the ledgers go with the store)."""

    async def quota_standings(self, *, scope: str, charges: Sequence[QuotaCharge]) -> list[QuotaStanding]:
        return [self.quotas.standing(charge) for charge in charges]

    async def entitlement_usage(self, *, limits: EntitlementLimits, pool: str) -> EntitlementUsage:
        ledger = self._ledgers.get(pool)
        if ledger is None or ledger.limits(limits.entitlement_id) is None:
            return EntitlementUsage()
        return ledger.usage(limits.entitlement_id, self.clock.now())

    async def pool_running(self, *, pool: str) -> int:
        ledger = self._ledgers.get(pool)
        return 0 if ledger is None else ledger.running

    async def in_flight(self, *, pool: PoolInfo) -> dict[str, int]:
        ledger = self._ledgers.get(pool.name)
        if ledger is None:
            return {}
        return ledger.in_flight_counts()

    async def dynamics(self, *, pool: str, entitlements: Sequence[str]) -> dict[str, Dynamics]:
        ledger = self._ledgers.get(pool)
        records = {} if ledger is None else ledger.entitlement_records()
        return {name: records[name].dynamics if name in records else Dynamics() for name in entitlements}

    async def request_state(self, *, reservation: Reservation) -> str | None:
        ledger = self._ledgers.get(reservation.pool)
        return None if ledger is None else ledger.request_state(reservation.request_id)
