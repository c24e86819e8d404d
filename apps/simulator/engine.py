"""The discrete-event loop: a heap of (time, sequence, callback, args) in virtual seconds.

Ties at the same instant run in scheduling order (the sequence number), which keeps a run deterministic for
a seed. Periodic housekeeping (samplers, policy ticks) is scheduled as *daemon* events: a run without a horizon
ends when only daemon events are left, so two periodic tasks cannot keep each other alive. The loop doubles as the policy package's `Clock` (it has `now()`), so policy objects read virtual time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    __slots__ = ("_heap", "_sequence", "time", "events_run", "_live")

    def __init__(self, start: float = 0.0) -> None:
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...], bool]] = []
        self._sequence = 0
        self._live = 0
        self.time = float(start)
        self.events_run = 0

    def now(self) -> float:
        return self.time

    def at(self, when: float, callback: Callable[..., Any], *args: Any, daemon: bool = False) -> None:
        if when < self.time:
            # Float rounding in step arithmetic can land a hair in the past; time never goes back.
            when = self.time
        self._sequence += 1
        if not daemon:
            self._live += 1
        heapq.heappush(self._heap, (when, self._sequence, callback, args, daemon))

    def after(self, delay: float, callback: Callable[..., Any], *args: Any, daemon: bool = False) -> None:
        self.at(self.time + delay, callback, *args, daemon=daemon)

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def pending(self) -> int:
        """Events still to run that are not daemons."""
        return self._live

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Run events in time order until `until` passes (or, without `until`, until only daemon events are
        left), or `stop()` turns true."""
        heap = self._heap
        pop = heapq.heappop
        count = 0
        if until is None and stop is None:
            # The common run (to the end, no progress callback): the same loop with nothing else to check.
            while heap and self._live:
                when, _, callback, args, daemon = pop(heap)
                if not daemon:
                    self._live -= 1
                self.time = when
                callback(*args)
                count += 1
            self.events_run += count
            return
        while heap:
            if until is None:
                if self._live == 0:
                    break
            elif heap[0][0] > until:
                self.time = max(self.time, until)
                break
            when, _, callback, args, daemon = pop(heap)
            if not daemon:
                self._live -= 1
            self.time = when
            callback(*args)
            count += 1
            if stop is not None and stop():
                break
        self.events_run += count
