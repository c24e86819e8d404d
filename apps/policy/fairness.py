"""Deficit round robin and Jain's fairness index (seed 002, "Act 1").

DRR: each active flow, on its turn, gets its integer weight added as deficit credit and dispatches
items while the credit covers their cost (1 per request unless given). A flow whose queue empties
leaves the round and its deficit resets to zero, so an idle flow banks nothing and a single active
flow gets every dispatch (work-conserving).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from apps.policy.errors import PolicyConfigError


def _check_weight(flow: Hashable, weight: object) -> int:
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise PolicyConfigError(f"DRR weight of flow {flow!r} must be a positive integer, got {weight!r}")
    return weight


class DeficitRoundRobin:
    """`enqueue(flow, item)`, `dispatch() -> (flow, item) | None`, `len()`.

    Flows not named in `weights` get `default_weight` (or raise when it is None)."""

    __slots__ = ("_weights", "_default_weight", "_queues", "_deficits", "_active", "_credited", "_size")

    def __init__(self, weights: Mapping[Any, int] | None = None, *, default_weight: int | None = 1) -> None:
        self._weights = {flow: _check_weight(flow, weight) for flow, weight in (weights or {}).items()}
        self._default_weight = None if default_weight is None else _check_weight("<default>", default_weight)
        self._queues: dict[Hashable, deque[tuple[Any, int]]] = {}
        self._deficits: dict[Hashable, int] = {}
        # The round: active flows in turn order; the head is the flow whose turn it is.
        self._active: deque[Hashable] = deque()
        # Whether the head flow already received its quantum for the current turn.
        self._credited = False
        self._size = 0

    def weight(self, flow: Hashable) -> int:
        weight = self._weights.get(flow)
        if weight is None:
            if self._default_weight is None:
                raise PolicyConfigError(f"unknown DRR flow {flow!r}")
            return self._default_weight
        return weight

    def set_weight(self, flow: Hashable, weight: int) -> None:
        """Takes effect from the flow's next turn."""
        self._weights[flow] = _check_weight(flow, weight)

    def enqueue(self, flow: Hashable, item: Any, cost: int = 1) -> None:
        if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
            raise PolicyConfigError(f"DRR cost must be a positive integer, got {cost!r}")
        queue = self._queues.get(flow)
        if queue is None:
            self.weight(flow)  # unknown flows fail here, before any state changes
            queue = self._queues[flow] = deque()
        if not queue:
            self._active.append(flow)
            self._deficits[flow] = 0
        queue.append((item, cost))
        self._size += 1

    def dispatch(self) -> tuple[Hashable, Any] | None:
        active = self._active
        while active:
            flow = active[0]
            queue = self._queues[flow]
            if not self._credited:
                self._deficits[flow] += self.weight(flow)
                self._credited = True
            item, cost = queue[0]
            if self._deficits[flow] >= cost:
                queue.popleft()
                self._size -= 1
                if queue:
                    self._deficits[flow] -= cost
                else:
                    # Idle flows bank no credit: this is what makes DRR work-conserving.
                    self._deficits[flow] = 0
                    active.popleft()
                    self._credited = False
                return flow, item
            active.rotate(-1)
            self._credited = False
        return None

    def remove(self, flow: Hashable, item: Any) -> bool:
        """Withdraw a queued item (timeout, cancellation). O(queue length)."""
        queue = self._queues.get(flow)
        if not queue:
            return False
        for index, (queued, _) in enumerate(queue):
            if queued is item or queued == item:
                del queue[index]
                self._size -= 1
                if not queue:
                    self._deficits[flow] = 0
                    if self._active and self._active[0] == flow:
                        self._credited = False
                    self._active.remove(flow)
                return True
        return False

    def head(self, flow: Hashable) -> Any | None:
        """The next item of `flow` (None when its queue is empty)."""
        queue = self._queues.get(flow)
        return queue[0][0] if queue else None

    def pop_head(self, flow: Hashable) -> Any | None:
        """Drop and return the next item of `flow` outside its turn (e.g. it timed out)."""
        queue = self._queues.get(flow)
        if not queue:
            return None
        item = queue[0][0]
        self.remove(flow, item)
        return item

    def flows(self) -> list[Hashable]:
        return [flow for flow, queue in self._queues.items() if queue]

    def queued(self, flow: Hashable) -> int:
        queue = self._queues.get(flow)
        return len(queue) if queue else 0

    def deficit(self, flow: Hashable) -> int:
        return self._deficits.get(flow, 0)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0


def jain_fairness(values: Iterable[float]) -> float:
    """(sum x)^2 / (n * sum x^2): 1.0 when all equal, 1/n when one takes everything.

    All-zero allocations count as equal (1.0). Empty input or negative values are errors."""
    numbers = [float(value) for value in values]
    if not numbers:
        raise ValueError("jain_fairness needs at least one value")
    if any(value < 0 or value != value for value in numbers):
        raise ValueError(f"jain_fairness needs non-negative numbers, got {numbers!r}")
    squares = sum(value * value for value in numbers)
    if squares == 0:
        return 1.0
    total = sum(numbers)
    return total * total / (len(numbers) * squares)
