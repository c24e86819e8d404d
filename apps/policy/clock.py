"""Injected time: the core reads `clock.now()` (seconds) and never calls the time module itself."""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...


class MonotonicClock:
    """The live gateway's clock. The only place in the package that reads real time."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to: tests and the simulator's virtual time."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds!r} s)")
        self._now += seconds
        return self._now

    def set(self, when: float) -> float:
        if when < self._now:
            raise ValueError(f"a monotonic clock cannot go back from {self._now!r} to {when!r}")
        self._now = float(when)
        return self._now
