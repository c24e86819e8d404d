"""Per-flow bounded queues over one global concurrency budget, drained by DRR (seed 002).

The blog's gateway scheduler without asyncio: `submit` enqueues (a full queue rejects at once, the
blog's 504) and dispatches while the budget has room; `release` frees a slot and dispatches the
next; `expire` drops requests that waited past the acquire timeout; `set_budget` resizes (a shrink
never cancels work in flight: dispatch simply waits until releases bring in-flight under it).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from apps.policy.errors import PolicyConfigError, require_positive
from apps.policy.fairness import DeficitRoundRobin

REASON_QUEUE_FULL = "queue_full"
REASON_UNKNOWN_FLOW = "unknown_flow"


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """A flow's DRR weight and the depth of its queue (per tier in the blog)."""

    weight: int = 1
    queue_max: int = 8

    def __post_init__(self) -> None:
        for name in ("weight", "queue_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "weight" else 0):
                raise PolicyConfigError(f"{name} must be a {'positive' if name == 'weight' else 'non-negative'} "
                                        f"integer, got {value!r}")


# The blog's final tiers: paying tenants buffer arrival bursts, free tenants get fast rejections.
TIER_PRESETS: Mapping[str, FlowConfig] = {"paying": FlowConfig(weight=2, queue_max=8),
                                          "free": FlowConfig(weight=1, queue_max=2)}


@dataclass(frozen=True, slots=True)
class Ticket:
    flow: Hashable
    item: Any
    enqueued_at: float


@dataclass(frozen=True, slots=True)
class SubmitResult:
    accepted: bool
    reason: str = ""
    dispatched: tuple[Ticket, ...] = ()


def _check_budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise PolicyConfigError(f"budget must be a non-negative integer, got {budget!r}")
    return budget


class BudgetScheduler:
    def __init__(
        self,
        budget: int,
        flows: Mapping[Hashable, FlowConfig] | None = None,
        *,
        default_flow: FlowConfig | None = FlowConfig(),
        acquire_timeout_s: float = 1.0,
    ) -> None:
        self.budget = _check_budget(budget)
        self.flows = dict(flows or {})
        self.default_flow = default_flow
        self.acquire_timeout_s = require_positive("acquire_timeout_s", acquire_timeout_s)
        self.in_flight = 0
        self._drr = DeficitRoundRobin(
            {flow: config.weight for flow, config in self.flows.items()},
            default_weight=None if default_flow is None else default_flow.weight,
        )

    def config(self, flow: Hashable) -> FlowConfig | None:
        return self.flows.get(flow, self.default_flow)

    def set_flow(self, flow: Hashable, config: FlowConfig) -> None:
        """Add a flow or change its weight and queue depth (entitlements come and go after construction).

        The new weight counts from the flow's next DRR turn. A smaller `queue_max` drops nothing already
        queued: only later submits see the shorter queue, as a budget shrink never cancels work."""
        self.flows[flow] = config
        self._drr.set_weight(flow, config.weight)

    def submit(self, flow: Hashable, item: Any, now: float) -> SubmitResult:
        config = self.config(flow)
        if config is None:
            return SubmitResult(False, REASON_UNKNOWN_FLOW)
        if self._drr.queued(flow) >= config.queue_max:
            return SubmitResult(False, REASON_QUEUE_FULL)
        self._drr.enqueue(flow, Ticket(flow, item, now))
        return SubmitResult(True, dispatched=self._dispatch())

    def release(self, now: float) -> tuple[Ticket, ...]:
        if self.in_flight <= 0:
            raise PolicyConfigError("release without a matching dispatch")
        self.in_flight -= 1
        return self._dispatch()

    def set_budget(self, budget: int, now: float) -> tuple[Ticket, ...]:
        self.budget = _check_budget(budget)
        return self._dispatch()

    def expire(self, now: float) -> list[Ticket]:
        """Drop requests that waited at least `acquire_timeout_s`: serving them late feeds the spiral."""
        expired: list[Ticket] = []
        for flow in self._drr.flows():
            while True:
                head = self._drr.head(flow)
                if head is None or now - head.enqueued_at < self.acquire_timeout_s:
                    break
                expired.append(head)
                self._drr.pop_head(flow)
        return expired

    def _dispatch(self) -> tuple[Ticket, ...]:
        dispatched: list[Ticket] = []
        while self.in_flight < self.budget:
            picked = self._drr.dispatch()
            if picked is None:
                break
            self.in_flight += 1
            dispatched.append(picked[1])
        return tuple(dispatched)

    @property
    def queued(self) -> int:
        return len(self._drr)

    def queued_for(self, flow: Hashable) -> int:
        return self._drr.queued(flow)

    @property
    def has_demand(self) -> bool:
        """The blog's AIMD demand gate: something in flight or anything queued."""
        return self.in_flight > 0 or len(self._drr) > 0
