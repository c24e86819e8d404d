"""What a running gateway runs besides requests: its background loops, its gauges, and its clean stop.

Loops (each logged and tried again next period when it fails):
- snapshot refresh: keys, entitlements and pools from the database when they change, pools synced into the
  admission state machine (capacity and reservations);
- replica health probes (and the replicas' vLLM metrics, for saturation);
- lease renewal of this process's requests in a shared store, and the reaping of dead processes' ones;
- the AIMD tick of the pools' dispatch budgets (this process's, or the pool's shared one);
- with a shared store, this process's TTFT counts flushed to the pool's window once a second;
- usage records flushed to the database, and releases the store could not take retried;
- the request log's records to the database (with a shared store, to its Redis list every second first);
- always: other processes' starts, expiries and evictions delivered to this process (shared stores).
- the store view: what the store holds, every process together, for /metrics (store_view.py).

The ticks of the control plane that need this gateway's in-process store (the debt/burst EWMA) reach it through
`store_call`, handed to the in-process ticker by `tick_services()` at the server's start: no module global
finds the running gateway or its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from apps.gateway.budget import PoolBudget, aimd_tick_all
from apps.gateway.control import ControlState, aimd_tick_shared
from apps.gateway.request_log import PUSH_S as REQUEST_LOG_PUSH_S
from apps.gateway.routing import probe_replicas
from apps.gateway.state import StateStoreUnavailable
from apps.gateway.store_view import STORE_VIEW_S, StoreView
from apps.gateway.ticks import (
    STORE_CALL_TIMEOUT_S,
    StoreUnavailable,
    aimd_params,
    control_state,
    desired_replicas_gauge,
    tick_ewma,
    ticks_mode,
)
from apps.policy import EntitlementLimits, EntitlementState

if TYPE_CHECKING:
    from apps.gateway.app import Gateway

logger = logging.getLogger(__name__)

# With a shared store, how often this process's TTFT counts go to the pool's shared window.
TTFT_FLUSH_S = 1.0
RELEASE_RETRY_S = 1.0


class BackgroundLoops:
    def __init__(self, gateway: Gateway, *, control: ControlState | None = None) -> None:
        self.gateway = gateway
        # The control loops' state (default `ticks.control_state()`): with a shared store, this process's
        # TTFT counts go to its window and the shared AIMD tick reads it.
        self.control = control
        # The event loop the gateway runs on (set at start): its in-process store is only safe to touch there.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tasks: list[asyncio.Task] = []
        # What the store holds, every process together, refreshed every STORE_VIEW_S for /metrics.
        self.view = StoreView()
        self._bound: tuple[Any, dict[str, list[EntitlementLimits]]] | None = None  # (snapshot, its Bound ones)

    def start(self) -> None:
        gateway = self.gateway
        assert gateway.store is not None and gateway.peers is not None
        self.loop = asyncio.get_running_loop()
        config = gateway.config
        # What keeps the store right runs always: other processes' notices, deferred releases, leases.
        self._spawn(gateway.peers.listen(), "gw-events")
        self._every(RELEASE_RETRY_S, self.retry_releases, "gw-releases")
        self._every(config.lease_renew_s, self.leases_tick, "gw-leases")
        self._every(STORE_VIEW_S, self.store_view, "gw-store-view")
        if not config.background:
            return  # tests drive the rest by hand (they read the database, the network, the clock)
        self._spawn(self._snapshots(), "gw-snapshot")
        self._every(config.aimd_tick_s, self.aimd_tick, "gw-aimd")
        self._every(config.health_interval_s, self.health_check, "gw-health")
        self._every(config.usage_flush_s, self.usage_flush, "gw-usage")
        log = gateway.request_log
        if log is not None and log.redis is not None:
            # To the shared list every second (what a SIGKILL can lose); the `request_log_drain` tick writes the
            # list to the database, off this event loop and, run by Celery or `run_ticks`, off this process.
            self._every(REQUEST_LOG_PUSH_S, log.push, "gw-request-log-push")
        elif log is not None:
            self._every(config.usage_flush_s, self.request_log_flush, "gw-request-log")
        if gateway.peers.budgets_shared:
            self._every(TTFT_FLUSH_S, self.ttft_flush, "gw-ttft")

    def _spawn(self, coroutine: Awaitable[Any], name: str) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coroutine, name=name))  # type: ignore[arg-type]

    def _every(self, interval_s: float, action: Callable[[], Any], name: str) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    result = action()
                    if asyncio.iscoroutine(result):
                        await result
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("gateway background task %s failed", name)

        self._spawn(loop(), name)

    def store_call(self, fn: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
        """Run `fn(store)` on this gateway's loop against its store and return the result: blocking, for a
        tick running in a thread of this process (`StoreUnavailable` until the gateway has started)."""
        loop, store = self.loop, self.gateway.store
        if store is None or loop is None or not loop.is_running():
            raise StoreUnavailable("the gateway has not started yet")
        return asyncio.run_coroutine_threadsafe(fn(store), loop).result(timeout=STORE_CALL_TIMEOUT_S)

    def tick_services(self) -> dict[str, Callable[[], Any]]:
        """The ticks of `workers.ticks` that need this gateway's store, bound to it (the in-process ticker's
        services): the debt/burst EWMA closes the window of the store this gateway admits with."""
        return {"ewma": lambda: tick_ewma(self.store_call, self.bound_limits())}

    def bound_limits(self) -> dict[str, list[EntitlementLimits]] | None:
        """The Bound entitlements of each pool, from the snapshot (None before the first one): what the EWMA tick
        closes the windows of (the snapshot is reloaded when a state changes, an expiry included)."""
        snapshot = self.gateway.snapshots.current
        if snapshot is None:
            return None
        cached = self._bound
        if cached is None or cached[0] is not snapshot:  # once per snapshot, not every second
            cached = self._bound = (snapshot, {
                name: [limits for limits in pool.entitlements if limits.state == EntitlementState.BOUND]
                for name, pool in snapshot.pools.items()})
        return cached[1]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(BaseException):
                await task
        self.tasks = []
        self.loop = None
        gateway = self.gateway
        if hasattr(gateway, "accountant"):
            with contextlib.suppress(Exception):
                await gateway.accountant.settle()  # releases on their way land or are deferred, then retried
                await gateway.accountant.retry_pending()
        with contextlib.suppress(Exception):
            await self.usage_flush()
        with contextlib.suppress(Exception):
            await self.request_log_flush()

    async def finish_requests(self, grace_s: float) -> None:
        """Let requests still in flight end (their account step releases and records them); after `grace_s`
        cancel the rest, which releases them the same way."""
        in_flight = self.gateway.in_flight
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(True for _ in in_flight.contexts()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for ctx in in_flight.contexts():
            if ctx.task is not None and not ctx.task.done():
                ctx.task.cancel("gateway shutting down")
        deadline = loop.time() + 2.0
        while any(True for _ in in_flight.contexts()) and loop.time() < deadline:
            await asyncio.sleep(0.02)

    # --- the loops --------------------------------------------------------------------------------------

    async def _snapshots(self) -> None:
        gateway = self.gateway
        while True:
            try:
                if await gateway.snapshots.refresh():
                    await gateway.sync_pools()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving the last good snapshot; the database may come back
                logger.exception("gateway snapshot refresh failed")
            await asyncio.sleep(gateway.config.snapshot_poll_s)

    async def health_check(self) -> None:
        gateway = self.gateway
        await gateway.start()
        assert gateway.client is not None
        snapshot = gateway.snapshots.current
        if snapshot is not None:
            for pool in snapshot.pools.values():
                gateway.replica_set(pool)
                gateway.budget(pool)
        await probe_replicas(gateway.client, list(gateway.replicas.values()))

    async def leases_tick(self) -> int:
        """Renew the leases of this process's requests, then release those of dead processes."""
        gateway = self.gateway
        assert gateway.peers is not None
        reaped = 0
        accountant = getattr(gateway, "accountant", None)  # made at start, with the loops
        try:
            for name in list(gateway.budgets):
                ids = gateway.in_flight.ids(name) + ([] if accountant is None else accountant.pending_ids(name))
                reaped += await gateway.peers.leases(pool=name, request_ids=ids)
            reaped += await self.quota_leases_tick()
        except StateStoreUnavailable:
            pass
        return reaped

    async def quota_leases_tick(self) -> int:
        """Renew the quota holds of this process's requests (being offered, in flight, or whose release waits
        for the store), scope by scope, and settle every hold of the scope whose lease lapsed (its process died,
        or lost it): a quota hold is reclaimed within a lease, as a slot is. Returns how many."""
        gateway = self.gateway
        assert gateway.store is not None
        snapshot = gateway.snapshots.current
        if snapshot is None:
            return 0
        holders: dict[str, list[str]] = {str(entry.tenant_id): [] for entry in snapshot.keys.values() if entry.quotas}
        for request_id, scope in list(gateway.in_flight.offering.items()):
            holders.setdefault(scope, []).append(request_id)
        for ctx in gateway.in_flight.contexts():
            if ctx.entry is not None and ctx.entry.quotas:
                holders.setdefault(str(ctx.entry.tenant_id), []).append(ctx.request_id)
        accountant = getattr(gateway, "accountant", None)
        for item in [] if accountant is None else accountant.unreleased():
            if item.reservation.quota_scope is not None:
                holders.setdefault(item.reservation.quota_scope, []).append(item.reservation.request_id)
        reaped = 0
        for scope, ids in holders.items():
            reaped += len(await gateway.store.quota_leases(scope=scope, request_ids=ids,
                                                           lease_s=gateway.config.lease_s))
        return reaped

    async def usage_flush(self) -> int:
        """This process's usage counts to the database, then (a shared store: `Peers.usage_flush`) the pools'
        counts in the store, claim by claim, each applied once; returns the number of batches written."""
        gateway = self.gateway
        written = 1 if await gateway.usage.flush() else 0
        peers, snapshot = gateway.peers, gateway.snapshots.current
        if peers is None or snapshot is None:
            return written
        return written + await peers.usage_flush(pools=list(snapshot.pools))

    async def request_log_flush(self) -> int:
        """The request log's records to the database (with Redis: through its shared list); rows written."""
        log = self.gateway.request_log
        return 0 if log is None else await log.flush()

    async def store_view(self) -> None:
        """What the store holds, every process together (apps.gateway.store_view)."""
        await self.view.refresh(self.gateway.store, self.gateway.snapshots.current)

    async def retry_releases(self) -> int:
        return await self.gateway.accountant.retry_pending()

    def control_state(self) -> ControlState:
        if self.control is None:
            self.control = control_state()
        return self.control

    async def aimd_tick(self) -> dict[str, int]:
        """Every `aimd_tick_s`. One process: its own controller per pool. A shared store: the pool's one
        controller, run here by one gateway process per period (a short lock in the control state) when
        no Celery broker runs the ticks; every process then reads the budget it published."""
        gateway = self.gateway
        demand = {name: bool(contexts) for name, contexts in gateway.in_flight.by_pool.items()}
        budgets = aimd_tick_all(list(gateway.budgets.values()), demand)  # shared: only the local windows move on
        if gateway.store is None:
            return budgets
        if gateway.peers is None or not gateway.peers.budgets_shared:
            # This process's own controllers: their budgets are checks of its state machines.
            with contextlib.suppress(StateStoreUnavailable):
                await gateway.store.pool_budgets_set(budgets=budgets)
            return budgets
        control = self.control_state()
        if ticks_mode() == "in-process" and await asyncio.to_thread(
                control.claim, "tick:aimd", 0.9 * gateway.config.aimd_tick_s):
            return await self.shared_aimd_tick()
        for budget in list(gateway.budgets.values()):
            budgets[budget.name] = await self._read_budget(budget)
        return budgets

    async def _read_budget(self, budget: PoolBudget) -> int:
        """The pool's budget as the store holds it (the shared controller's), for gauges and the dashboard."""
        assert self.gateway.store is not None
        budget.published(await self.gateway.store.pool_budget(pool=budget.name))
        return budget.budget

    async def shared_aimd_tick(self) -> dict[str, int]:
        """One step of every pool's shared AIMD controller, the pools' capacities from the snapshot (no ORM
        on the server's loop)."""
        gateway = self.gateway
        assert gateway.store is not None
        snapshot = gateway.snapshots.current or await gateway.snapshots.get()
        pools = {pool.name: max(1, pool.concurrency_capacity) for pool in snapshot.pools.values()}
        records = await aimd_tick_shared(store=gateway.store, state=self.control_state(), pools=pools,
                                         params=aimd_params(gateway.config, gateway.config.aimd_tick_s))
        for budget in list(gateway.budgets.values()):
            await self._read_budget(budget)
        return {pool: record.cap for pool, record in records.items()}

    async def ttft_flush(self) -> int:
        """Every second with a shared store: add this process's TTFT counts to each pool's shared window
        (one write per pool, not one per request) and read the published budgets; returns the count."""
        control = self.control_state()
        flushed = 0
        for budget in list(self.gateway.budgets.values()):
            counts = budget.take_ttft()
            if counts is not None:
                await asyncio.to_thread(control.ttft_add, budget.name, counts, budget.histogram.bounds)
                flushed += sum(counts)
            with contextlib.suppress(StateStoreUnavailable):
                await self._read_budget(budget)
        return flushed

    # --- gauges -------------------------------------------------------------------------------------------

    def register_gauges(self) -> None:
        gateway = self.gateway
        add = gateway.metrics.add_gauge
        budgets, replicas, in_flight = gateway.budgets, gateway.replicas, gateway.in_flight

        def waiting() -> dict[tuple[str, ...], float]:
            admitter = getattr(gateway, "admitter", None)  # made when the gateway starts
            by_pool = {} if admitter is None else admitter.waiting_by_pool
            return {(name,): float(by_pool.get(name, 0)) for name in budgets}

        add("flow_control_queue_size", "Requests of this process waiting in the pool: in their entitlements' queues "
            "or its waiting room.", ("pool",), waiting)
        add("flow_control_pool_budget", "The pool's dispatch budget (AIMD cap): this process's, or the pool's with "
            "Redis.", ("pool",), lambda: {(name,): float(b.budget) for name, b in budgets.items()})
        add("flow_control_budget_utilization", "This process's requests in flight (waiting included) over the "
            "pool's dispatch budget.", ("pool",),
            lambda: {(name,): len(in_flight.by_pool.get(name, ())) / max(1, b.budget) for name, b in budgets.items()})

        def saturations() -> dict[tuple[str, ...], float]:
            values = {(name,): r.saturation() for name, r in replicas.items()}
            return {key: value for key, value in values.items() if value is not None}

        add("flow_control_pool_saturation", "GAIE saturation of the pool from its replicas' vLLM metrics.",
            ("pool",), saturations)
        add("gateway_requests_in_flight", "Admitted requests not yet finished (this process).", ("pool",),
            lambda: {(name,): float(len(r)) for name, r in in_flight.by_pool.items()})

        def by_entitlement() -> dict[tuple[str, ...], float]:
            counts: dict[tuple[str, ...], float] = {}
            for ctx in in_flight.contexts():
                if ctx.entry is not None:
                    key = (ctx.entry.entitlement,)
                    counts[key] = counts.get(key, 0.0) + 1
            return counts

        add("gateway_entitlement_in_flight", "Admitted requests not yet finished, by entitlement (this process).",
            ("entitlement",), by_entitlement)
        add("gateway_pending_releases", "Releases not in the state store yet: on their way (the answer's end does "
            "not wait for them), or deferred while it is away (retried every second).",
            (), lambda: {(): float(len(gateway.accountant.unreleased())) if hasattr(gateway, "accountant") else 0.0})
        self.view.register_gauges(add)
        add("tokenpools_pool_desired_replicas", "Replicas the pool should run (autoscaling signal).", ("pool",),
            desired_replicas_gauge)
