"""The AIMD budget controller as seed 002 ends up (post #4 plus the post #5 update).

Every tick, from the p99 of the gateway's own TTFT histogram:
- fewer than `min_samples` observations (or no p99): hold, there is nothing to react to;
- in cooldown (the `cooldown_ticks` ticks right after a decrease): hold, the window still holds
  samples from before the cut; increases never start a cooldown (climbing stays eager);
- p99 > target * (1 + band): decrease, multiplicatively (`factor`, mode "aimd") or by `step`
  (mode "aisd"), never below `min_cap`;
- p99 < target * (1 - band) and there is demand (in flight > 0 or anything queued): +1, never
  above `max_cap`;
- otherwise (inside the deadband, or no demand): hold.

`LatencyHistogram` gives the p99 with Prometheus-style linear interpolation inside a bucket.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from apps.policy.errors import PolicyConfigError, require_finite, require_positive

# Prometheus' default latency buckets (seconds), extended for queue-inclusive TTFT.
DEFAULT_TTFT_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

INCREASE = "increase"
DECREASE = "decrease"
HOLD_BAND = "hold_band"
HOLD_COOLDOWN = "hold_cooldown"
HOLD_NO_DEMAND = "hold_no_demand"
HOLD_FEW_SAMPLES = "hold_few_samples"
HOLD_FLOOR = "hold_floor"
HOLD_CEILING = "hold_ceiling"


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """Quantile from bucket counts (`counts[i]` observations in (bounds[i-1], bounds[i]], the last
    count is the +Inf bucket). Linear interpolation inside the bucket, from 0 for the first; a rank
    in the +Inf bucket returns the highest finite bound. None when there are no observations."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    cumulative = 0
    for index, count in enumerate(counts):
        if count and cumulative + count >= rank:
            if index >= len(bounds):
                return bounds[-1]
            lower = bounds[index - 1] if index > 0 else 0.0
            return lower + (bounds[index] - lower) * (rank - cumulative) / count
        cumulative += count
    return bounds[-1]


def ttft_histogram_bounds(
    target_p99_s: float, band: float = 0.2, base: Sequence[float] = DEFAULT_TTFT_BUCKETS_S
) -> tuple[float, ...]:
    """The bucket bounds every TTFT histogram a controller of this target reads: `base` plus the band
    edges and the target (see `AimdController.histogram_bounds`). One function, so the gateway's own
    histogram and the shared window of the control loops count into the same buckets."""
    edges = (target_p99_s * (1.0 - band), target_p99_s, target_p99_s * (1.0 + band))
    return tuple(sorted({float(b) for b in base} | {float(edge) for edge in edges if edge > 0}))


def rebucket(counts_by_le: Iterable[tuple[float, int]], bounds: Sequence[float]) -> list[int]:
    """Bucket counts keyed by their upper bound (`le`, `inf` for +Inf) re-counted into `bounds` (+Inf
    last). An observation of a bucket (lo, le] goes to the bucket of `bounds` holding `le`: exact when
    `le` is one of `bounds`, else rounded up (a p99 read from it is never under-estimated)."""
    counts = [0] * (len(bounds) + 1)
    for le, count in counts_by_le:
        counts[bisect.bisect_left(bounds, le)] += int(count)
    return counts


class LatencyHistogram:
    """Cumulative-free bucket counts over a rolling window of `window_ticks` sub-histograms."""

    def __init__(self, bounds: Sequence[float] = DEFAULT_TTFT_BUCKETS_S, window_ticks: int = 6) -> None:
        if not bounds or any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)) or bounds[0] <= 0:
            raise PolicyConfigError("histogram bounds must be positive and strictly increasing")
        if isinstance(window_ticks, bool) or not isinstance(window_ticks, int) or window_ticks < 1:
            raise PolicyConfigError(f"window_ticks must be a positive integer, got {window_ticks!r}")
        self.bounds = tuple(float(b) for b in bounds)
        self._slices: deque[list[int]] = deque([[0] * (len(self.bounds) + 1)], maxlen=window_ticks)

    def observe(self, value_s: float) -> None:
        if value_s != value_s or value_s < 0:
            raise ValueError(f"a latency must be a non-negative number, got {value_s!r}")
        self._slices[-1][bisect.bisect_left(self.bounds, value_s)] += 1

    def rotate(self) -> None:
        """Start a new slice; the oldest falls out of the window."""
        self._slices.append([0] * (len(self.bounds) + 1))

    def counts(self) -> list[int]:
        return [sum(column) for column in zip(*self._slices, strict=True)]

    @property
    def count(self) -> int:
        return sum(sum(piece) for piece in self._slices)

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.bounds, self.counts())


class AimdController:
    def __init__(
        self,
        target_p99_s: float,
        min_cap: int,
        max_cap: int,
        *,
        band: float = 0.2,
        cooldown_ticks: int = 3,
        mode: str = "aimd",
        factor: float = 0.5,
        step: int = 4,
        min_samples: int = 10,
        initial_cap: int | None = None,
    ) -> None:
        self.target_p99_s = require_positive("target_p99_s", target_p99_s)
        for name, value in (("min_cap", min_cap), ("max_cap", max_cap), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PolicyConfigError(f"{name} must be a positive integer, got {value!r}")
        if min_cap > max_cap:
            raise PolicyConfigError(f"min_cap ({min_cap}) must not exceed max_cap ({max_cap})")
        band = require_finite("band", band)
        if not 0.0 <= band < 1.0:
            raise PolicyConfigError(f"band must be in [0, 1), got {band!r}")
        factor = require_finite("factor", factor)
        if not 0.0 < factor < 1.0:
            raise PolicyConfigError(f"factor must be in (0, 1), got {factor!r}")
        for name, value in (("cooldown_ticks", cooldown_ticks), ("min_samples", min_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PolicyConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if mode not in ("aimd", "aisd"):
            raise PolicyConfigError(f"mode must be 'aimd' or 'aisd', got {mode!r}")
        cap = max_cap if initial_cap is None else initial_cap
        if isinstance(cap, bool) or not isinstance(cap, int) or not min_cap <= cap <= max_cap:
            raise PolicyConfigError(f"initial_cap must be an integer in [{min_cap}, {max_cap}], got {initial_cap!r}")
        self.min_cap, self.max_cap = min_cap, max_cap
        self.band, self.factor, self.step, self.mode = band, factor, step, mode
        self.cooldown_ticks, self.min_samples = cooldown_ticks, min_samples
        self.cap = cap
        self.cooldown_left = 0
        self.last_action = HOLD_FEW_SAMPLES

    @property
    def upper(self) -> float:
        return self.target_p99_s * (1.0 + self.band)

    @property
    def lower(self) -> float:
        return self.target_p99_s * (1.0 - self.band)

    def histogram_bounds(self, base: Sequence[float] = DEFAULT_TTFT_BUCKETS_S) -> tuple[float, ...]:
        """Bucket bounds for the latency histogram this controller reads: `base` plus the band edges and
        the target. The controller compares an interpolated p99 with `target * (1 -+ band)`; with
        Prometheus-style buckets a 2 s target's whole band (1.6..2.4 s) lies inside (1.0, 2.5], where the
        estimate is interpolation, not a measurement (TTFTs crowding just above 1 s read as a p99 near
        2.5 s, and the controller cuts to its floor). With the edges as bounds, `p99 > upper` holds exactly
        when more than 1 % of the window is above `upper`, so each decision is the one the true p99 gives."""
        return ttft_histogram_bounds(self.target_p99_s, self.band, base)

    def _decreased(self) -> int:
        if self.mode == "aimd":
            # At least one below the current cap, so a factor close to 1 still makes progress.
            return min(self.cap - 1, math.floor(self.cap * self.factor))
        return self.cap - self.step

    def tick(self, p99_s: float | None, samples: int, has_demand: bool) -> int:
        """One control step; returns the new cap (also in `.cap`, the reason in `.last_action`)."""
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.last_action = HOLD_COOLDOWN
        elif p99_s is None or p99_s != p99_s or samples < self.min_samples:
            self.last_action = HOLD_FEW_SAMPLES
        elif p99_s > self.upper:
            if self.cap <= self.min_cap:
                self.last_action = HOLD_FLOOR
            else:
                self.cap = max(self.min_cap, self._decreased())
                self.cooldown_left = self.cooldown_ticks
                self.last_action = DECREASE
        elif p99_s < self.lower:
            if not has_demand:
                self.last_action = HOLD_NO_DEMAND
            elif self.cap >= self.max_cap:
                self.last_action = HOLD_CEILING
            else:
                self.cap += 1
                self.last_action = INCREASE
        else:
            self.last_action = HOLD_BAND
        return self.cap

    def tick_histogram(self, histogram: LatencyHistogram, has_demand: bool) -> int:
        """Tick from a histogram window, then rotate it."""
        cap = self.tick(histogram.quantile(0.99), histogram.count, has_demand)
        histogram.rotate()
        return cap


def aimd_floor(capacity: int, min_budget: int = 1, min_fraction: float = 0.0) -> int:
    """The lowest budget the controller may cut a pool of `capacity` slots to (seed 002, fix #1): below some
    budget, cutting concurrency only lengthens the queue and the TTFT the controller reacts to (the death
    spiral), so the floor scales with the pool; never above the pool itself."""
    capacity = max(1, int(capacity))
    return min(max(1, min_budget, math.ceil(capacity * min_fraction)), capacity)


@dataclass(frozen=True, slots=True)
class AimdParams:
    target_p99_s: float = 2.0
    window_ticks: int = 6  # 30 s window / 5 s tick
    band: float = 0.2
    cooldown_ticks: int = 3
    min_samples: int = 10
    min_budget: int = 1
    # The floor as a share of the pool's slots (the gateway's GATEWAY_BUDGET_MIN_FRACTION): the same
    # floor whether one controller per process or one per pool tunes the budget.
    min_budget_fraction: float = 0.0


@dataclass(frozen=True, slots=True)
class AimdRecord:
    """A pool's AIMD controller between ticks, and what its last tick saw (for logs, the UI, tests)."""

    cap: int
    cooldown_left: int = 0
    last_action: str = ""
    p99_s: float | None = None
    samples: int = 0
    min_cap: int = 1
    max_cap: int = 1
    ticks: int = 0


def aimd_bounds(previous: AimdRecord | None, capacity: int, params: AimdParams) -> AimdRecord:
    """The controller of a pool of `capacity` slots before its next step: floor and ceiling from the pool, the
    cap clipped into them (a new pool starts at its ceiling); cooldown and history carried over."""
    max_cap = max(1, int(capacity))
    min_cap = aimd_floor(max_cap, params.min_budget, params.min_budget_fraction)
    if previous is None:
        return AimdRecord(cap=max_cap, min_cap=min_cap, max_cap=max_cap)
    cap = min(max(previous.cap, min_cap), max_cap)
    return replace(previous, cap=cap, min_cap=min_cap, max_cap=max_cap, cooldown_left=max(0, previous.cooldown_left))


def aimd_step(previous: AimdRecord | None, *, capacity: int, counts: Sequence[int], bounds: Sequence[float],
              params: AimdParams, has_demand: bool) -> AimdRecord:
    """One AIMD step of a pool's budget (the one step both the gateway's own controller and the pool's shared
    one take): `counts` are the TTFT window's bucket counts over `bounds` (+Inf last)."""
    start = aimd_bounds(previous, capacity, params)
    controller = AimdController(
        params.target_p99_s, start.min_cap, start.max_cap, band=params.band, cooldown_ticks=params.cooldown_ticks,
        min_samples=params.min_samples, initial_cap=start.cap,
    )
    controller.cooldown_left = start.cooldown_left
    samples = sum(counts)
    p99 = histogram_quantile(0.99, bounds, counts)
    controller.tick(None if p99 is None or math.isnan(p99) else p99, samples, has_demand)
    return AimdRecord(cap=controller.cap, cooldown_left=controller.cooldown_left, last_action=controller.last_action,
                      p99_s=p99, samples=samples, min_cap=start.min_cap, max_cap=start.max_cap,
                      ticks=(previous.ticks if previous else 0) + 1)
