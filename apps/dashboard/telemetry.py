"""Live telemetry for the dashboards: one sample per pool per second (apps.dashboard.samples), kept in the
15-minute history (apps.dashboard.history) and published to the pool's channel group.

- `collect_pool_sample` is the only code that reads the gateway's internals (its state store,
  budget, metrics): when the gateway's API moves, only that function changes.
- `telemetry_sample_pool` builds one sample, stores it and sends it to the group;
  `publish_tick` is the 1 s periodic job (workers/ticks.py registry).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import re
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from apps.dashboard.history import SAMPLE_PERIOD_S, HistoryStore, history_store
from apps.dashboard.samples import EntitlementPoint, PoolSample

logger = logging.getLogger(__name__)

# p99 TTFT over the last ten samples (~10 s): short enough to show a breach, long enough to have points.
TTFT_WINDOW_SAMPLES = 10
# Two publishers (the ticker and the page-driven sampler) may run in one process: closer calls than this
# are dropped so that the history keeps one point per second.
MIN_PUBLISH_INTERVAL_S = 0.5
GROUP_EVENT = "pool.sample"


# --- groups --------------------------------------------------------------------------------------

_GROUP_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def pool_group(pool: str) -> str:
    """The channel group of a pool's samples (Channels allows only ASCII letters, digits, `-_.`)."""
    safe = _GROUP_UNSAFE.sub("_", pool)
    if safe != pool:
        # Two names differing only in unsafe characters must not share a group.
        safe = f"{safe[:60]}.{abs(hash(pool)) % 10**8}"
    return f"dashboard.pool.{safe}"[:99]


# --- collection from the gateway (the adapter) ----------------------------------------------------


@dataclass
class CollectorState:
    """What a sample needs from the previous ones: cumulative counters become per-sample counts and
    rates, bucket counts become a windowed p99, the budget becomes an AIMD action."""

    time: dict[str, float] = field(default_factory=dict)
    budget: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, float] = field(default_factory=dict)
    denied: dict[tuple[str, str], float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    ttft: dict[tuple[str, ...], deque[list[float]]] = field(default_factory=dict)
    waits: dict[str, deque[list[float]]] = field(default_factory=dict)


def _lower_tier_tokens(metrics: Any, entitlement: str, service_class: str) -> dict[str, float]:
    """Tokens an entitlement had served below its own class so far (`gateway_tier_tokens_total`), by class."""
    totals: dict[str, float] = {}
    for (ent, tier, _kind), value in list(metrics.tier_tokens.values.items()):
        if ent == entitlement and tier != service_class:
            totals[tier] = totals.get(tier, 0.0) + value
    return totals


def _delta(previous: dict[Any, float], key: Any, current: float, *, first: bool) -> float:
    """Growth of a cumulative counter since the previous sample. On a pool's first sample the counters
    only set the baseline (what happened before is not this second's); afterwards a key not seen yet
    started from zero, and a counter that went down restarted (a new gateway)."""
    before = previous.get(key)
    previous[key] = current
    if first:
        return 0.0
    if before is None or current < before:
        return current
    return current - before


def windowed_p99(
    state: CollectorState, labels: tuple[str, ...], bounds: Sequence[float], counts: Sequence[float] | None,
    *, window: int = TTFT_WINDOW_SAMPLES,
) -> float | None:
    """p99 over the last `window` samples from a cumulative bucket histogram (non-cumulative buckets,
    +Inf last). Keeps one copy of the counts per sample; None without observations in the window."""
    from apps.policy.aimd import histogram_quantile

    recent = _window_delta(state.ttft, labels, len(bounds) + 1, counts, window)
    return histogram_quantile(0.99, bounds, [max(0, round(c)) for c in recent])


def _window_delta(histories: dict[Any, deque[list[float]]], key: Any, width: int, series: Sequence[float] | None,
                  window: int) -> list[float]:
    """What a cumulative series gained over the last `window` samples (this sample's values kept for later)."""
    history = histories.get(key)
    if history is None:
        history = histories[key] = deque(maxlen=window + 1)
    current = [float(c) for c in series] if series is not None else [0.0] * width
    history.append(current)
    oldest = history[0] if len(history) > 1 else [0.0] * len(current)
    return [a - b for a, b in zip(current, oldest, strict=False)]


def windowed_wait(
    state: CollectorState, entitlement: str, bounds: Sequence[float], series: Sequence[float] | None,
    *, window: int = TTFT_WINDOW_SAMPLES,
) -> tuple[float | None, float | None]:
    """(p99, mean) over the last `window` samples of one series of the gateway's queue wait histogram
    (bucket counts, +Inf, sum, count); (None, None) when no wait ended in the window."""
    from apps.policy.aimd import histogram_quantile

    recent = _window_delta(state.waits, entitlement, len(bounds) + 3, series, window)
    count = round(recent[-1])
    if count <= 0:  # no wait ended in the window (or the gateway restarted): no point rather than a zero
        return None, None
    buckets = [max(0, round(c)) for c in recent[: len(bounds) + 1]]
    return histogram_quantile(0.99, bounds, buckets), max(0.0, recent[-2]) / count


async def collect_pool_sample(
    *,
    gateway: Any,
    pool: Any,
    entries: Sequence[Any],
    kv_usage: Mapping[str, float],
    state: CollectorState,
    now: float,
    store: Any = None,
) -> PoolSample:
    """Build one sample of `pool` (an `apps.gateway.snapshot.PoolInfo`) from the gateway of this process.

    `entries` are the pool's `KeyEntry`s (one or more per entitlement: limits, tenant); `kv_usage` the
    replicas' last scraped KV usage. Reads: the state store (in-flight, KV bytes, debt, burst: shared
    across processes with Redis), the pool's budget controller (the AIMD budget), the admitter (requests waiting
    now in their entitlement's queue or the pool's waiting room), the metrics (admitted and rejected counters,
    tokens, TTFT and queue wait histograms). The only function that knows those internals.
    """
    from apps.policy import priority_weight

    name = pool.name
    budget_control = getattr(gateway, "budgets", {}).get(name)
    metrics = getattr(gateway, "metrics", None)
    # Made when the gateway starts: a process that serves no requests has no waiters.
    waiting: Mapping[str, int] = getattr(getattr(gateway, "admitter", None), "waiting", None) or {}
    store = store if store is not None else _gateway_store_here(gateway)
    first = name not in state.time
    elapsed = 0.0 if first else now - state.time[name]
    state.time[name] = now

    budget = int(budget_control.budget) if budget_control is not None else int(pool.concurrency_capacity)
    before = state.budget.get(name)
    state.budget[name] = budget
    action = 0 if before is None or before == budget else (1 if budget > before else -1)

    # p99 TTFT from the gateway's histogram: the pool's over every series labelled with it; an entitlement's
    # once the gateway labels the histogram by entitlement too (until then: None, no invented point).
    ttft_names: tuple[str, ...] = tuple(metrics.ttft.label_names) if metrics is not None else ()
    bounds = tuple(metrics.ttft.buckets) if metrics is not None else ()

    def ttft_counts(**match: str) -> list[float] | None:
        if metrics is None or not set(match) <= set(ttft_names):
            return None
        positions = [(ttft_names.index(label), value) for label, value in match.items()]
        total: list[float] | None = None
        for labels, series in list(metrics.ttft.series.items()):
            if all(labels[i] == value for i, value in positions):
                counts = series[: len(bounds) + 1]
                total = list(counts) if total is None else [a + b for a, b in zip(total, counts, strict=True)]
        return total

    pool_p99 = windowed_p99(state, ("pool", name), bounds, ttft_counts(pool=name)) if "pool" in ttft_names else None

    limits_by_name: dict[str, Any] = {}
    tenant_by_name: dict[str, str] = {}
    for entry in entries:
        limits_by_name.setdefault(entry.entitlement, entry.limits)
        tenant_by_name.setdefault(entry.entitlement, entry.tenant_slug)

    points: list[EntitlementPoint] = []
    kv_total = 0.0
    for ent_name in sorted(limits_by_name):
        limits = limits_by_name[ent_name]
        service_class = str(getattr(limits.service_class, "value", limits.service_class))
        in_flight, kv_bytes, debt, burst = 0, 0.0, 0.0, 0.0
        if store is not None:
            try:
                usage = await store.entitlement_usage(limits=limits, pool=name)
                in_flight, kv_bytes, debt, burst = usage.in_flight, usage.kv_bytes_in_flight, usage.debt, usage.burst
            except Exception:  # an unreachable Redis: a sample with zeros beats no sample
                logger.warning("telemetry: state store unreachable for %s", ent_name, exc_info=True)
        kv_total += kv_bytes
        # Waiting in the state machine's queues (the admitter's count, by entitlement id).
        queued = waiting.get(limits.entitlement_id, 0)
        wait_p99, wait_mean = None, None
        admitted, served = 0.0, 0.0
        tier_served: dict[str, float] = {}
        denied: dict[str, int] = {}
        if metrics is not None:
            wait_p99, wait_mean = windowed_wait(state, ent_name, metrics.queue_wait.buckets,
                                                metrics.queue_wait.series.get((limits.entitlement_id,)))
            admitted = _delta(state.admitted, ent_name, metrics.admitted.get((ent_name, service_class)),
                              first=first)
            for (ent, _cls, reason), value in list(metrics.rejected.values.items()):
                if ent == ent_name:
                    count = _delta(state.denied, (ent, reason), value, first=first)
                    if count:
                        denied[reason] = denied.get(reason, 0) + int(count)
            tokens = metrics.tokens.get((ent_name, "prompt")) + metrics.tokens.get((ent_name, "completion"))
            served = _delta(state.tokens, ent_name, tokens, first=first)
            lower = _lower_tier_tokens(metrics, ent_name, service_class)
            tier_served = {tier: _delta(state.tokens, f"{ent_name}@{tier}", value, first=first)
                           for tier, value in lower.items()}
        p99 = None
        if "entitlement" in ttft_names:
            p99 = windowed_p99(state, ("entitlement", ent_name), bounds, ttft_counts(entitlement=ent_name))
        try:
            priority: float | None = priority_weight(service_class, limits.slo_target_ms, pool.mean_slo_ms,
                                                     max(0.0, burst), debt)
        except Exception:  # a class or SLO the formula refuses: no point rather than a broken sample
            priority = None
        points.append(EntitlementPoint(
            name=ent_name,
            tenant=tenant_by_name.get(ent_name, ""),
            service_class=service_class,
            in_flight=int(in_flight),
            queued=int(queued),
            queue_wait_p99_s=wait_p99,
            queue_wait_mean_s=wait_mean,
            p99_ttft_s=p99,
            slo_ms=float(limits.slo_target_ms),
            debt=float(debt),
            priority=priority,
            admitted=int(admitted),
            denied=denied,
            tokens_per_s=served / elapsed if elapsed > 0 else 0.0,
            baseline_tokens_per_s=float(limits.tokens_per_second or 0.0),
            kv_bytes=float(kv_bytes),
            tier_tokens_per_s={t: v / elapsed for t, v in tier_served.items()} if elapsed > 0 else {},
        ))

    kv_capacity = float(pool.kv_capacity or 0.0)
    return PoolSample(
        time=now,
        pool=name,
        slots=int(pool.concurrency_capacity),
        budget=budget,
        aimd_action=action,
        running=sum(p.in_flight for p in points),
        queued=sum(p.queued for p in points),
        p99_ttft_s=pool_p99,
        kv_usage=dict(kv_usage),
        kv_admitted=(kv_total / kv_capacity) if kv_capacity > 0 else None,
        entitlements=tuple(points),
    )


# --- the service and the tick --------------------------------------------------------------------

_collector = CollectorState()
_last_publish: dict[str, float] = {}
_server_loop: asyncio.AbstractEventLoop | None = None


def replica_kv_usage(*, pool: str) -> dict[str, float]:
    """Last scraped KV usage of the pool's enabled replicas (written by the scrape tick); blocking."""
    from apps.pools.models import Replica

    rows = Replica.objects.filter(pool__name=pool, enabled=True, kv_cache_usage__isnull=False)
    return {url.rstrip("/"): float(usage or 0.0) for url, usage in rows.values_list("url", "kv_cache_usage")}


async def _kv_usage(pool: str) -> dict[str, float]:
    from channels.db import database_sync_to_async

    try:
        return await database_sync_to_async(replica_kv_usage)(pool=pool)
    except Exception:
        logger.warning("telemetry: replica KV usage unavailable for %s", pool, exc_info=True)
        return {}


async def _snapshot(gateway: Any) -> Any:
    snapshots = gateway.snapshots
    if snapshots.current is None:
        # Nothing went through the gateway yet in this process: load its picture of pools and keys.
        await snapshots.refresh(force=True)
    return snapshots.current


def _shared_store() -> Any:
    """The Redis state store when the gateway shares its state there: a process without a running gateway
    (a Celery worker, `run_ticks`) still reads every entitlement's in-flight, KV, debt and burst."""
    from apps.gateway.config import GatewayConfig

    config = GatewayConfig.from_settings()
    if config.state_backend != "redis" or not config.redis_url:
        return None
    from apps.gateway.redis_state import RedisStateStore

    return RedisStateStore(url=config.redis_url, cluster=config.redis_cluster)


async def telemetry_sample_pool(*, pool: str, now: float | None = None, gateway: Any = None,
                                channel_layer: Any = None, history: HistoryStore | None = None,
                                state: CollectorState | None = None) -> PoolSample | None:
    """Build the pool's sample from the gateway, append it to the history and send it to the pool's group.

    Returns the sample, or None when the gateway knows no such pool.
    """
    if gateway is None:
        from apps.gateway.asgi import gateway_application

        gateway = gateway_application()
    snapshot = await _snapshot(gateway)
    info = snapshot.pools.get(pool) if snapshot is not None else None
    if info is None:
        return None
    entries = [e for e in snapshot.keys.values() if e.pool_name == pool]
    shared = _shared_store() if getattr(gateway, "store", None) is None else None
    try:
        sample = await collect_pool_sample(
            gateway=gateway, pool=info, entries=entries, kv_usage=await _kv_usage(pool),
            state=_collector if state is None else state, now=time.time() if now is None else now, store=shared,
        )
    finally:
        if shared is not None:
            await shared.close()
    await (history or history_store()).append(sample)
    if channel_layer is None:
        from channels.layers import get_channel_layer

        channel_layer = get_channel_layer()
    if channel_layer is not None:
        await channel_layer.group_send(pool_group(pool), {"type": GROUP_EVENT, "sample": sample.to_dict()})
    return sample


async def publish_pool_samples(*, now: float | None = None, gateway: Any = None) -> list[PoolSample]:
    """One sample of every pool the gateway knows (skipping pools sampled under half a second ago)."""
    if gateway is None:
        from apps.gateway.asgi import gateway_application

        gateway = gateway_application()
    snapshot = await _snapshot(gateway)
    if snapshot is None:
        return []
    published: list[PoolSample] = []
    clock = time.monotonic()
    for name in sorted(snapshot.pools):
        if clock - _last_publish.get(name, -math.inf) < MIN_PUBLISH_INTERVAL_S:
            continue
        _last_publish[name] = clock
        sample = await telemetry_sample_pool(pool=name, now=now, gateway=gateway)
        if sample is not None:
            published.append(sample)
    return published


# True while a tick samples on an event loop of its own: this process's gateway (if it has one) is not read.
_ON_A_LOOP_OF_ITS_OWN: contextvars.ContextVar[bool] = contextvars.ContextVar("telemetry_own_loop", default=False)


def _bound_loop() -> asyncio.AbstractEventLoop | None:
    """The server's event loop, where the in-process gateway state and the in-memory channel layer live:
    the one the gateway runs on (once started), else the page-driven sampler's; a loop that stopped (a
    server that went away) does not count."""
    from apps.gateway.asgi import gateway_application

    for loop in (gateway_application().loops.loop, _server_loop):
        if loop is not None and loop.is_running():
            return loop
    return None


def _gateway_store_here(gateway: Any) -> Any:
    """The gateway's state store, unless this sample runs on a loop of its own (`publish_tick` without the server's
    loop): a Redis client's connection pool binds its lock to the loop that first waits on it, and a sample taken
    on a tick's loop before the gateway had started once left every request of that server answering 503."""
    return None if _ON_A_LOOP_OF_ITS_OWN.get() else getattr(gateway, "store", None)


def publish_tick() -> int:
    """The 1 s periodic job: sample every pool and publish; returns how many samples went out.

    Ticks run in threads: with a server loop known (bound by the in-process ticker, or remembered by the
    page-driven sampler) the work is handed to it, because the in-process gateway state and the in-memory
    channel layer belong to that loop; otherwise (Celery, `run_ticks`) it runs on a loop of its own.
    """
    loop = _bound_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is not None and loop is not running:
        future = asyncio.run_coroutine_threadsafe(publish_pool_samples(), loop)
        return len(future.result(timeout=10))
    if running is not None:
        raise RuntimeError("publish_tick is blocking; await publish_pool_samples() inside an event loop")
    async def sample_alone() -> list[Any]:
        _ON_A_LOOP_OF_ITS_OWN.set(True)
        return await publish_pool_samples()

    return len(asyncio.run(sample_alone()))


# --- the page-driven sampler ----------------------------------------------------------------------

_sampler_task: asyncio.Task | None = None


async def _sample_forever(period_s: float) -> None:
    while True:
        started = time.monotonic()
        try:
            await publish_pool_samples()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("dashboard sampler failed; retrying next period")
        await asyncio.sleep(max(0.05, period_s - (time.monotonic() - started)))


def ensure_local_sampler(period_s: float = SAMPLE_PERIOD_S) -> bool:
    """Start sampling on the running loop, once per process; returns whether it started now.

    The embedded server runs no ticker of its own yet, so the first live page (or websocket) starts this
    loop; with `publish_tick` registered as well, the interval guard in `publish_pool_samples` keeps one
    sample per second. `DASHBOARD_LOCAL_SAMPLER = False` in settings turns it off (Celery publishes).
    """
    global _sampler_task, _server_loop
    from django.conf import settings

    if not settings.DASHBOARD_LOCAL_SAMPLER:
        return False
    loop = asyncio.get_running_loop()
    if _sampler_task is not None and not _sampler_task.done() and _server_loop is loop:
        return False
    _server_loop = loop
    _sampler_task = loop.create_task(_sample_forever(period_s), name="dashboard-sampler")
    return True


async def stop_local_sampler() -> None:
    global _sampler_task
    task, _sampler_task = _sampler_task, None
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def reset_collector() -> None:
    """Forget counters and publish times (tests)."""
    global _collector
    _collector = CollectorState()
    _last_publish.clear()
