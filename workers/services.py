"""The tick services: each reads what it needs, calls one app service or control loop, and returns
what it did (for logs and tests). The runners (Celery, `run_ticks`, the in-process ticker) call
them through `workers.ticks.run_tick`, which adds the no-overlap and log-and-continue rules.

State goes through the gateway's state store (`apps.gateway.state`): the Redis store when
`GATEWAY_STATE_BACKEND=redis` (one per tick run, closed after it), else the in-process store of the
gateway living in this process (reached on the server's event loop, see `bind_gateway_loop`).
The control loops' own state (AIMD cap and window, tick times, observed demand) is a
`workers.dynamics.ControlState`: Redis when `REDIS_URL` is set, else in this process. Its TTFT buckets
are the AIMD controller's (`apps.policy.ttft_histogram_bounds(GATEWAY_TTFT_TARGET_S)`), as the gateway's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from django.conf import settings
from django.utils import timezone

from apps.policy import EntitlementLimits, ttft_histogram_bounds
from workers.dynamics import (
    AimdParams,
    AimdRecord,
    ControlState,
    EwmaResult,
    MemoryControlState,
    RedisControlState,
    aimd_tick,
    aimd_tick_shared,
    ewma_tick,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

STORE_CALL_TIMEOUT_S = 30.0

_gateway_loop: asyncio.AbstractEventLoop | None = None
_control: ControlState | None = None
_control_guard = threading.Lock()


def bind_gateway_loop(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Remember the server's event loop (call from inside it): the in-process state store is only
    safe to touch from that loop, so ticks running in threads hand their work to it."""
    global _gateway_loop
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
    _gateway_loop = loop


def control_state() -> ControlState:
    """The process-wide control state: Redis when REDIS_URL is configured, else in memory."""
    global _control
    with _control_guard:
        if _control is None:
            from apps.gateway.config import GatewayConfig

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


def with_gateway_store(fn: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    """Run `fn(store)` against the gateway's state store and return its result (blocking)."""
    from apps.gateway.config import GatewayConfig

    config = GatewayConfig.from_settings()
    if config.state_backend == "redis":
        from apps.gateway.redis_state import RedisStateStore

        if not config.redis_url:
            raise StoreUnavailable("GATEWAY_STATE_BACKEND=redis needs REDIS_URL")

        async def run() -> T:
            store = RedisStateStore(url=config.redis_url)
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(run())
    import apps.gateway.asgi as gateway_asgi

    # Only a gateway this process already runs: creating one here would hold a store no one reads.
    gateway = getattr(gateway_asgi, "_gateway", None)
    store = getattr(gateway, "store", None)
    loop = _gateway_loop
    if store is None or loop is None or not loop.is_running():
        raise StoreUnavailable("the in-process gateway has not started yet")
    return asyncio.run_coroutine_threadsafe(fn(store), loop).result(timeout=STORE_CALL_TIMEOUT_S)


def _period(name: str) -> float:
    from workers.ticks import tick_specs

    return tick_specs([name])[name].period_s


def active_entitlement_limits() -> list[tuple[EntitlementLimits, str]]:
    """(limits, pool name) of every Bound entitlement not past its expiry."""
    from apps.gateway.snapshot import entitlement_limits
    from apps.pools.models import EntitlementState, TokenEntitlement

    now = timezone.now()
    rows = TokenEntitlement.objects.filter(state=EntitlementState.BOUND).select_related("pool").order_by("id")
    result: list[tuple[EntitlementLimits, str]] = []
    for ent in rows:
        if ent.is_past_expiry(now):
            continue
        result.append((entitlement_limits(ent, kv_bytes_per_token=float(ent.pool.bytes_per_token)), ent.pool.name))
    return result


# --- the ticks ------------------------------------------------------------------------------------


def tick_ewma() -> EwmaResult | None:
    """Debt and burst of every active entitlement from the served/refused counters of the interval."""
    entitlements = active_entitlement_limits()
    state = control_state()
    now = time.time()
    previous = state.swap_last_run("ewma", now)
    # Counters accumulate from the last drain, so the real interval is the right divisor; the first
    # run (or a clock step back) has none and uses the nominal period.
    elapsed = now - previous if previous is not None and now > previous else _period("ewma")
    if not entitlements:
        return EwmaResult({}, {})
    try:
        result = with_gateway_store(lambda store: ewma_tick(store=store, entitlements=entitlements, elapsed_s=elapsed))
    except StoreUnavailable as exc:
        logger.debug("ewma tick: %s", exc)
        return None
    state.pool_demand_set(result.pool_demand_tps)
    return result


def _pool_capacities() -> dict[str, int]:
    from apps.pools.models import TokenPool

    capacities: dict[str, int] = {}
    for pool in TokenPool.objects.prefetch_related("replicas").order_by("id"):
        enabled = sum(1 for r in pool.replicas.all() if r.enabled)
        capacities[pool.name] = enabled * pool.slots_per_replica
    return capacities


def aimd_params(config: Any, tick_s: float) -> AimdParams:
    """The shared controller's parameters from a `GatewayConfig`: the same target, window and floor as
    the gateway's own per-process controller."""
    return AimdParams(
        target_p99_s=config.ttft_target_s,
        window_ticks=max(1, round(config.aimd_window_s / tick_s)),
        min_budget=config.budget_min,
        min_budget_fraction=config.budget_min_fraction,
    )


def tick_aimd() -> dict[str, AimdRecord]:
    """One AIMD step of every pool's shared budget from its TTFT window, published in the gateway's
    state store (with Redis every gateway process enforces it from its next dispatch on)."""
    from apps.gateway.config import GatewayConfig

    params = aimd_params(GatewayConfig.from_settings(), _period("aimd"))
    pools = _pool_capacities()
    state = control_state()
    try:
        return with_gateway_store(lambda store: aimd_tick_shared(store=store, state=state, pools=pools, params=params))
    except StoreUnavailable:  # no gateway here (run_ticks without Redis): the record only
        return aimd_tick(state=state, pools=pools, params=params)


def claim_tick(name: str, period_s: float) -> bool:
    """True for one caller per `period_s` among every process sharing the control state: several
    gateway processes each ticking the shared AIMD controller in-process (no Celery) take turns under
    this short lock, so the pool's budget moves once a period, not once per process."""
    return control_state().claim(f"tick:{name}", period_s)


def tick_scrape() -> Any:
    """Scrape every replica (stored on the replica rows) and publish each pool's instance snapshots
    in the control state, where gateways read saturation without touching the ORM."""
    from apps.pools.scrape import DEFAULT_TIMEOUT_S, pools_scrape

    summaries = pools_scrape(timeout_s=float(getattr(settings, "TOKENPOOLS_SCRAPE_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    state = control_state()
    for summary in summaries:
        state.instances_set(summary.pool, summary.snapshots)
    return summaries


def tick_autoscale() -> Any:
    from apps.pools.autoscale import pools_autoscale

    state = control_state()
    decisions = pools_autoscale(observed_tokens_per_second=state.pool_demand())
    state.desired_replicas_set({pool: decision.desired for pool, decision in decisions.items()})
    return decisions


def desired_replicas_gauge() -> dict[tuple[str, ...], float]:
    """`tokenpools_pool_desired_replicas{pool}` values for `GatewayMetrics.add_gauge`: read from the
    control state, never the ORM, so it is safe inside the gateway's event loop."""
    return {(pool,): float(desired) for pool, desired in control_state().desired_replicas().items()}


def tick_expiry() -> int:
    from apps.pools.services import entitlements_expire

    return entitlements_expire()


def tick_usage_rollup() -> int:
    from workers.rollups import usage_rollup

    return usage_rollup()
