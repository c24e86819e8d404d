"""The control loops' own state, and the AIMD tick of the pools' dispatch budgets.

AIMD tick (seed 002): every 5 s, the p99 of the gateway's TTFT over the last 30 s moves each
pool's budget: +1 below target x 0.8 when there is demand, multiplicative decrease above
target x 1.2 (then a cooldown), hold in between. The step itself is `apps.policy.aimd_step` (the same one the
gateway's own per-process controller takes, `PoolBudget.tick`);
what it needs between ticks (cap, cooldown, the TTFT window) lives in a `ControlState`: in-process
for the embedded server, Redis when several processes share it. With Redis there is one controller
per pool (`aimd_tick_shared`): gateway processes add their TTFT counts to the shared window (`ttft_add`,
batched once a second), the tick sets each new budget in the pool's state machine in the store, which every
gateway process's admission checks (`GatewayStateStore.pool_budgets_set`). The
embedded server without Redis keeps one controller in its own process (`apps.gateway.budget`).

`MemoryControlState` keeps it in one process; `apps.gateway.control_redis.RedisControlState` shares it through
Redis. The control state also carries what the other ticks publish for readers that must not touch the ORM
(observed demand, desired replicas, the replicas' scraped saturation inputs). The debt/burst tick keeps
no state here: its window lives in the admission state machine itself (`GatewayStateStore.tick`).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from apps.policy import AimdParams, AimdRecord, InstanceSnapshot, aimd_step, rebucket, ttft_histogram_bounds

__all__ = ["AimdParams", "AimdRecord", "ControlState", "MemoryControlState", "aimd_tick", "aimd_tick_shared"]

# --- shared control state -------------------------------------------------------------------------


# The TTFT buckets of the seeds' 2 s target: what a control state counts in unless told its target.
DEFAULT_TTFT_TARGET_S = 2.0


class ControlState(ABC):
    """State of the control loops themselves, shared by whoever runs the ticks and the gateways.

    `bounds` are the TTFT buckets: `apps.policy.ttft_histogram_bounds(target)`, the same the gateway's
    own histogram and the AIMD controller of that target use, so the shared p99 is measured at the
    band's edges rather than interpolated across them.
    """

    bounds: tuple[float, ...] = ttft_histogram_bounds(DEFAULT_TTFT_TARGET_S)

    def bucket(self, seconds: float) -> int:
        return _bucket_index(self.bounds, seconds)

    def _own(self, counts: Sequence[int], bounds: Sequence[float] | None) -> list[int]:
        """`counts` (over `bounds`, default ours, +Inf last) as counts over our bounds."""
        if bounds is None or tuple(float(b) for b in bounds) == self.bounds:
            size = len(self.bounds) + 1
            return [int(c) for c in counts[:size]] + [0] * max(0, size - len(counts))
        return rebucket(zip((*bounds, math.inf), counts, strict=False), self.bounds)

    @abstractmethod
    def ttft_observe(self, pool: str, seconds: float) -> None:
        """Count one TTFT observation into the pool's current window slice (gateways call this)."""

    @abstractmethod
    def ttft_add(self, pool: str, counts: Sequence[int], bounds: Sequence[float] | None = None) -> None:
        """Add bucket counts (over `bounds`, default this state's, + the +Inf bucket) at once: a
        gateway flushing its own per-process histogram every second instead of one write per request."""

    @abstractmethod
    def ttft_rotate(self, pool: str, window_ticks: int) -> list[int]:
        """Close the current slice and return the bucket counts of the last `window_ticks` slices."""

    @abstractmethod
    def aimd_load(self, pool: str) -> AimdRecord | None: ...

    @abstractmethod
    def aimd_save(self, pool: str, record: AimdRecord) -> None: ...

    @abstractmethod
    def claim(self, name: str, ttl_s: float) -> bool:
        """Take the lock `name` for `ttl_s` unless someone holds it (never released: it runs out)."""

    @abstractmethod
    def swap_last_run(self, tick: str, now: float) -> float | None:
        """Record `now` as the tick's last run; return the previous one (None the first time)."""

    @abstractmethod
    def pool_demand_set(self, demand_tps: Mapping[str, float]) -> None: ...

    @abstractmethod
    def pool_demand(self) -> dict[str, float]: ...

    @abstractmethod
    def desired_replicas_set(self, desired: Mapping[str, int]) -> None:
        """The autoscaling tick's result, for readers that must not touch the ORM (the gateway's gauges)."""

    @abstractmethod
    def desired_replicas(self) -> dict[str, int]: ...

    @abstractmethod
    def instances_set(self, pool: str, snapshots: Sequence[InstanceSnapshot]) -> None:
        """The scrape's per-replica saturation inputs of a pool (replacing the previous ones)."""

    @abstractmethod
    def instances(self, pool: str) -> list[InstanceSnapshot]: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _bucket_index(bounds: Sequence[float], seconds: float) -> int:
    import bisect

    if seconds != seconds or seconds < 0:
        raise ValueError(f"a latency must be a non-negative number, got {seconds!r}")
    return bisect.bisect_left(bounds, seconds)


class MemoryControlState(ControlState):
    """One process's control state (the embedded server, the standalone loop without Redis)."""

    def __init__(self, *, bounds: Sequence[float] | None = None) -> None:
        if bounds is not None:
            self.bounds = tuple(float(b) for b in bounds)
        self._lock = threading.Lock()
        self._current: dict[str, list[int]] = {}
        self._windows: dict[str, deque[list[int]]] = {}
        self._aimd: dict[str, AimdRecord] = {}
        self._last: dict[str, float] = {}
        self._demand: dict[str, float] = {}
        self._desired: dict[str, int] = {}
        self._instances: dict[str, list[InstanceSnapshot]] = {}
        self._claims: dict[str, float] = {}

    def ttft_observe(self, pool: str, seconds: float) -> None:
        index = self.bucket(seconds)
        with self._lock:
            counts = self._current.setdefault(pool, [0] * (len(self.bounds) + 1))
            counts[index] += 1

    def ttft_add(self, pool: str, counts: Sequence[int], bounds: Sequence[float] | None = None) -> None:
        own = self._own(counts, bounds)
        with self._lock:
            current = self._current.setdefault(pool, [0] * (len(self.bounds) + 1))
            for index, count in enumerate(own):
                current[index] += count

    def ttft_rotate(self, pool: str, window_ticks: int) -> list[int]:
        with self._lock:
            current = self._current.pop(pool, [0] * (len(self.bounds) + 1))
            window = self._windows.setdefault(pool, deque(maxlen=window_ticks))
            if window.maxlen != window_ticks:
                window = self._windows[pool] = deque(window, maxlen=window_ticks)
            window.appendleft(current)
            return [sum(column) for column in zip(*window, strict=True)]

    def aimd_load(self, pool: str) -> AimdRecord | None:
        with self._lock:
            return self._aimd.get(pool)

    def aimd_save(self, pool: str, record: AimdRecord) -> None:
        with self._lock:
            self._aimd[pool] = record

    def claim(self, name: str, ttl_s: float) -> bool:
        now = time.monotonic()
        with self._lock:
            if self._claims.get(name, -math.inf) > now:
                return False
            self._claims[name] = now + ttl_s
            return True

    def swap_last_run(self, tick: str, now: float) -> float | None:
        with self._lock:
            previous = self._last.get(tick)
            self._last[tick] = now
            return previous

    def pool_demand_set(self, demand_tps: Mapping[str, float]) -> None:
        with self._lock:
            self._demand = dict(demand_tps)

    def pool_demand(self) -> dict[str, float]:
        with self._lock:
            return dict(self._demand)

    def desired_replicas_set(self, desired: Mapping[str, int]) -> None:
        with self._lock:
            self._desired = dict(desired)

    def desired_replicas(self) -> dict[str, int]:
        with self._lock:
            return dict(self._desired)

    def instances_set(self, pool: str, snapshots: Sequence[InstanceSnapshot]) -> None:
        with self._lock:
            self._instances[pool] = list(snapshots)

    def instances(self, pool: str) -> list[InstanceSnapshot]:
        with self._lock:
            return list(self._instances.get(pool, ()))


# --- AIMD tick ------------------------------------------------------------------------------------


def aimd_tick(
    *,
    state: ControlState,
    pools: Mapping[str, int],
    params: AimdParams,
    in_flight: Mapping[str, int] | None = None,
) -> dict[str, AimdRecord]:
    """One AIMD step for every pool (`pools`: name -> concurrency capacity, the budget ceiling).

    Demand (the gate on increases) is anything in flight on the pool (when the caller knows it) or
    any TTFT observed in the window: a pool that answered requests lately had demand.
    """
    records: dict[str, AimdRecord] = {}
    for pool, capacity in pools.items():
        counts = state.ttft_rotate(pool, params.window_ticks)
        has_demand = bool((in_flight or {}).get(pool, 0)) or sum(counts) > 0
        record = aimd_step(state.aimd_load(pool), capacity=capacity, counts=counts, bounds=state.bounds,
                           params=params, has_demand=has_demand)
        state.aimd_save(pool, record)
        records[pool] = record
    return records


async def aimd_tick_shared(
    *,
    store: Any,
    state: ControlState,
    pools: Mapping[str, int],
    params: AimdParams,
) -> dict[str, AimdRecord]:
    """The one AIMD controller of each pool when several gateway processes share a Redis state store.

    Reads demand (requests admitted on the pool, every process together) from the gateway's state
    store, steps every pool's budget from the shared TTFT window the gateways flush into `state`, and
    publishes the new budgets in the store, where every gateway's slot script reads them on its next
    dispatch. `store` is an `apps.gateway.state.GatewayStateStore`; a store without a shared budget
    (the in-process one) is given nothing.
    """
    in_flight = {pool: await store.pool_running(pool=pool) for pool in pools}
    # The control state may be Redis behind a blocking client: off the caller's event loop.
    records = await asyncio.to_thread(aimd_tick, state=state, pools=pools, params=params, in_flight=in_flight)
    await store.pool_budgets_set(budgets={pool: record.cap for pool, record in records.items()})
    return records
