"""The tick services of the gateway's state: what the periodic runners call (Celery beat, the `run_ticks`
loop, the in-process ticker; `workers.ticks` holds the registry and the runners), and the process's control
state they and the gateway's background loops (`apps.gateway.background`) share.

EWMA tick (seed 000, section 3.3): the admission state machine of every pool closes its served/demand
window (`GatewayStateStore.tick`, the same window and computation as the simulator's ledger) and prices
the next admissions with the new debt and burst at once. The tokens demanded per pool over the window are
published for the autoscaling tick.

AIMD tick (seed 002): one step of every pool's dispatch-budget controller (`apps.gateway.control`).

State goes through the gateway's state store: the Redis store when `GATEWAY_STATE_BACKEND=redis` (the tick
opens its own, closed after it), else the in-process store, which only the gateway holding it can reach: that
gateway hands its `store_call` to the ticks it runs (`BackgroundLoops.tick_services`, given to the in-process
ticker at the server's start). A tick run elsewhere with the in-process store (Celery, `run_ticks`) has no
store to tick and says so (`StoreUnavailable`). The control loops' own state is a `ControlState`: Redis when
`REDIS_URL` is set, else in this process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.conf import settings
from django.utils import timezone

from apps.gateway.config import GatewayConfig
from apps.gateway.control import (
    AimdParams,
    AimdRecord,
    ControlState,
    MemoryControlState,
    aimd_tick,
    aimd_tick_shared,
)
from apps.gateway.control_redis import RedisControlState
from apps.gateway.redis_state import RedisStateStore
from apps.policy import Dynamics, EntitlementLimits, ttft_histogram_bounds

logger = logging.getLogger(__name__)

T = TypeVar("T")

STORE_CALL_TIMEOUT_S = 30.0
TICK_MODES = ("celery", "in-process", "off")

# Runs `fn(store)` against a gateway state store and returns its result (blocking, from a tick's thread).
StoreCall = Callable[[Callable[[Any], Coroutine[Any, Any, Any]]], Any]

_control: ControlState | None = None
_control_guard = threading.Lock()


def ticks_mode() -> str:
    """'celery' when a real broker is configured (beat + worker run the ticks), else 'in-process'.

    The setting `TOKENPOOLS_TICKS` forces one: 'celery', 'in-process' or 'off' ('auto' or unset: the broker
    decides)."""
    forced = getattr(settings, "TOKENPOOLS_TICKS", None)
    if forced and str(forced).strip().lower() != "auto":
        mode = str(forced).strip().lower().replace("_", "-")
        if mode not in TICK_MODES:
            raise ValueError(f"TOKENPOOLS_TICKS must be auto, celery, in-process or off, got {forced!r}")
        return mode
    broker = getattr(settings, "CELERY_BROKER_URL", "memory://") or "memory://"
    return "in-process" if broker.startswith("memory://") else "celery"


def control_state() -> ControlState:
    """The process-wide control state: Redis when REDIS_URL is configured, else in memory."""
    global _control
    with _control_guard:
        if _control is None:
            url = getattr(settings, "REDIS_URL", "")
            bounds = ttft_histogram_bounds(GatewayConfig.from_settings().ttft_target_s)
            _control = RedisControlState(url=url, bounds=bounds) if url else MemoryControlState(bounds=bounds)
        return _control


def reset_control_state(state: ControlState | None = None) -> None:
    """Replace the process-wide control state (tests; a settings change)."""
    global _control
    with _control_guard:
        if _control is not None and _control is not state:
            _control.close()
        _control = state


class StoreUnavailable(RuntimeError):
    """No gateway state store is reachable from this process (yet)."""


def with_gateway_store(fn: Callable[[Any], Coroutine[Any, Any, T]], local: StoreCall | None = None) -> T:
    """Run `fn(store)` against the gateway's state store and return its result (blocking).

    Redis: a store of the tick's own, closed after the call. In-process: `local`, the call the gateway holding
    the store handed to this tick; without one (no gateway in this process) there is nothing to tick."""
    config = GatewayConfig.from_settings()
    if config.state_backend == "redis":
        if not config.redis_url:
            raise StoreUnavailable("GATEWAY_STATE_BACKEND=redis needs GATEWAY_REDIS_URL or REDIS_URL")

        async def run() -> T:
            store = RedisStateStore(url=config.redis_url, config=config.admission_config(),
                                    dynamics_config=config.dynamics_config(), cluster=config.redis_cluster)
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(run())
    if local is None:
        raise StoreUnavailable("the in-process state store lives in the gateway's server process, and no gateway "
                               "handed this tick its store (Celery or run_ticks need GATEWAY_STATE_BACKEND=redis)")
    return local(fn)  # type: ignore[no-any-return]


def active_pool_limits() -> dict[str, list[EntitlementLimits]]:
    """Every Bound entitlement not past its expiry, by pool name (what the EWMA tick measures)."""
    from apps.gateway.snapshot import entitlement_limits
    from apps.pools.models import EntitlementState, TokenEntitlement

    now = timezone.now()
    rows = TokenEntitlement.objects.filter(state=EntitlementState.BOUND).select_related("pool").order_by("id")
    result: dict[str, list[EntitlementLimits]] = {}
    for ent in rows:
        if ent.is_past_expiry(now):
            continue
        limits = entitlement_limits(ent, kv_bytes_per_token=float(ent.pool.bytes_per_token), tenant_id=str(ent.tenant_id))
        result.setdefault(ent.pool.name, []).append(limits)
    return result


@dataclass(frozen=True, slots=True)
class EwmaResult:
    # Debt and burst of the entitlements that were not at rest (those at rest have none).
    dynamics: Mapping[str, Dynamics]
    # Tokens demanded per pool (tokens/s) over the window: the autoscaling tick's observed throughput.
    pool_demand_tps: Mapping[str, float]


def tick_ewma(store_call: StoreCall | None = None,
              pools: Mapping[str, Sequence[EntitlementLimits]] | None = None) -> EwmaResult | None:
    """Close every pool's served/demand window: debt and burst of each entitlement (seed 000, (2), (3)).
    `store_call`: the in-process store's gateway, when it runs this tick (see `with_gateway_store`); `pools`:
    the Bound entitlements by pool as that gateway's snapshot holds them (else read from the database: every
    second, that read of 10,000 entitlements alone kept an idle gateway a third of a core busy)."""
    if pools is None:
        pools = active_pool_limits()
    if not pools:
        return EwmaResult({}, {})
    try:
        by_pool = with_gateway_store(lambda store: store.tick(entitlements=pools), store_call)
    except StoreUnavailable as exc:
        logger.debug("ewma tick: %s", exc)
        return None
    # Only the entitlements that were not at rest have readings: one at rest demanded nothing, and its debt and
    # burst stay nil. Nothing here walks every entitlement of a pool.
    demand = {pool: sum(reading.demand.tokens_per_second for reading in readings.values())
              for pool, readings in by_pool.items()}
    control_state().pool_demand_set(demand)
    return EwmaResult({name: reading.dynamics for readings in by_pool.values() for name, reading in readings.items()},
                      demand)


def _pool_capacities() -> dict[str, int]:
    from apps.pools.models import TokenPool

    capacities: dict[str, int] = {}
    for pool in TokenPool.objects.prefetch_related("replicas").order_by("id"):
        enabled = sum(1 for r in pool.replicas.all() if r.enabled)
        capacities[pool.name] = enabled * pool.slots_per_replica
    return capacities


def aimd_params(config: GatewayConfig, tick_s: float) -> AimdParams:
    """The shared controller's parameters from a `GatewayConfig`: the same target, window and floor as
    the gateway's own per-process controller."""
    return AimdParams(
        target_p99_s=config.ttft_target_s,
        window_ticks=max(1, round(config.aimd_window_s / tick_s)),
        min_budget=config.budget_min,
        min_budget_fraction=config.budget_min_fraction,
    )


def _aimd_period_s(config: GatewayConfig) -> float:
    periods = getattr(settings, "TOKENPOOLS_TICK_PERIODS", None) or {}
    return float(periods.get("aimd", config.aimd_tick_s))


def tick_aimd() -> dict[str, AimdRecord]:
    """One AIMD step of every pool's shared budget from its TTFT window, published in the gateway's
    state store (with Redis every gateway process enforces it from its next dispatch on)."""
    config = GatewayConfig.from_settings()
    params = aimd_params(config, _aimd_period_s(config))
    pools = _pool_capacities()
    state = control_state()
    try:
        return with_gateway_store(lambda store: aimd_tick_shared(store=store, state=state, pools=pools, params=params))
    except StoreUnavailable:  # no store to publish in (run_ticks without Redis): the record only
        return aimd_tick(state=state, pools=pools, params=params)


def tick_request_log_drain() -> int:
    """With the Redis store, the request log's shared list (every gateway process pushes its records there once a
    second) to the database, one runner at a time (`RequestLog.drain`'s lock); returns the rows written. It runs
    where the ticks run (Celery, `run_ticks`): the batch INSERT then costs no gateway process its request path
    (the request log's periodic work in the gateway: a Redis p99 at 500/s of 7.4 ms with it, 4.3 ms with the log
    off, in one run; bench/RESULTS.md). With the in-process store there is no list: the gateway writes its
    records itself."""
    from apps.gateway.request_log import RequestLog

    async def drain(store: Any) -> int:
        log = RequestLog()
        log.attach(store.redis, store.prefix)
        try:
            return await log.drain(close_connections=True)
        finally:
            log.close()

    try:
        return with_gateway_store(drain)
    except StoreUnavailable as exc:
        logger.debug("request log drain tick: %s", exc)
        return 0


def desired_replicas_gauge() -> dict[tuple[str, ...], float]:
    """`tokenpools_pool_desired_replicas{pool}` values for `GatewayMetrics.add_gauge`: read from the
    control state, never the ORM, so it is safe inside the gateway's event loop."""
    return {(pool,): float(desired) for pool, desired in control_state().desired_replicas().items()}
