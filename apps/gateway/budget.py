"""One pool's dispatch budget (seed 002): the AIMD controller over the gateway's TTFT window.

The budget is a check of the pool's one admission state machine (`AdmissionLedger.set_budget`; in Redis the
pool's `budget` key that the scripts read with its capacity): a request starts only while fewer than the
budget run, and otherwise waits in the machine's waiting room like any request the pool has no room for. This
object only tunes the number and hands it to the store; it has no queue, no timeout and no lease of its own.

In one process (the in-process store) its own controller steps the budget every `aimd_tick_s`. With a shared
store (Redis, several gateway processes) the budget is the pool's: the one shared controller
(`apps.gateway.control.aimd_tick_shared`) steps it from the TTFT counts every process flushes (`take_ttft`)
and sets it in the store; this object then only keeps the local window (for `p99`) and the budget it read.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import replace

from apps.policy import AimdParams, LatencyHistogram, aimd_step, ttft_histogram_bounds
from apps.policy.aimd import aimd_bounds


class PoolBudget:
    def __init__(
        self,
        name: str,
        capacity: int,
        *,
        ttft_target_s: float,
        min_budget: int = 1,
        min_budget_fraction: float = 0.0,
        window_ticks: int = 6,
        shared: bool = False,
    ) -> None:
        self.name = name
        self.capacity = max(1, capacity)
        self.aimd_params = AimdParams(target_p99_s=ttft_target_s, window_ticks=window_ticks, min_budget=min_budget,
                                      min_budget_fraction=min_budget_fraction)
        # This process's own controller between ticks (`apps.policy.aimd_step`, the shared controller's step).
        self.aimd = aimd_bounds(None, self.capacity, self.aimd_params)
        # Bounds at the deadband's edges: the controller's p99 is then a measurement, not interpolation.
        self.histogram = LatencyHistogram(ttft_histogram_bounds(ttft_target_s, self.aimd_params.band),
                                          window_ticks=window_ticks)
        # The budget is the pool's, stepped by the shared controller (a store shared by several processes).
        self.shared = shared
        self._budget = self.capacity
        self._pending = [0] * (len(self.histogram.bounds) + 1)  # TTFT counts not flushed yet

    def resize(self, capacity: int) -> None:
        """Pool capacity changed (replicas enabled/disabled): new AIMD bounds, the cap clipped into them."""
        capacity = max(1, capacity)
        if capacity == self.capacity:
            return
        self.capacity = capacity
        # New floor and ceiling, the cap clipped into them; a resize ends a cooldown (a new controller).
        self.aimd = replace(aimd_bounds(self.aimd, capacity, self.aimd_params), cooldown_left=0)
        self._budget = min(self._budget, capacity) if self.shared else self.aimd.cap

    @property
    def budget(self) -> int:
        return self._budget

    def published(self, budget: int | None) -> None:
        """The pool's budget as the store holds it (shared: the shared controller's); None: none set yet."""
        self._budget = self.capacity if budget is None else min(budget, self.capacity)

    def observe_ttft(self, seconds: float) -> None:
        self.histogram.observe(seconds)
        if self.shared:
            self._pending[bisect.bisect_left(self.histogram.bounds, seconds)] += 1

    def take_ttft(self) -> list[int] | None:
        """TTFT counts over `histogram.bounds` (+Inf last) observed since the last call; None if none."""
        if not any(self._pending):
            return None
        counts, self._pending = self._pending, [0] * len(self._pending)
        return counts

    def tick(self, has_demand: bool) -> int:
        """One AIMD step over the TTFT window; returns the new budget (for the store). With a shared budget the
        pool's one controller steps it elsewhere: only the local window moves on (for `p99`)."""
        if self.shared:
            self.histogram.rotate()
            return self._budget
        self.aimd = aimd_step(self.aimd, capacity=self.capacity, counts=self.histogram.counts(),
                              bounds=self.histogram.bounds, params=self.aimd_params, has_demand=has_demand)
        self.histogram.rotate()
        self._budget = self.aimd.cap
        return self._budget

    def p99(self) -> float | None:
        value = self.histogram.quantile(0.99)
        return None if value is None or math.isnan(value) else value


def aimd_tick_all(budgets: Iterable[PoolBudget], demand: dict[str, bool]) -> dict[str, int]:
    """Tick every pool's controller once; returns the new budgets by pool (for the store, logs and tests)."""
    return {budget.name: budget.tick(demand.get(budget.name, False)) for budget in budgets}
