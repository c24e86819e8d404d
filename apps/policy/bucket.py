"""A token bucket in seconds (seed 004, "Token Bucket Mechanics"; seed 000 check 4).

Starts full, refills continuously in proportion to elapsed time, never holds more than its
capacity, admits when `level >= cost` and then subtracts the cost. `refund` returns the unused
part of a charge at completion (seed 000: charged n_in + max_tokens, refunded what was not produced).
"""

from __future__ import annotations

import math

from apps.policy.errors import require_finite, require_non_negative, require_positive


class TokenBucket:
    __slots__ = ("capacity", "refill_rate", "_level", "_updated_at")

    def __init__(self, capacity: float, refill_rate: float, *, now: float | None = None) -> None:
        self.capacity = require_positive("capacity", capacity)
        self.refill_rate = require_non_negative("refill_rate", refill_rate)
        self._level = self.capacity
        # None until the first call: the first decision sees a full bucket whatever its timestamp.
        self._updated_at = None if now is None else require_finite("now", now)

    def _refill(self, now: float) -> float:
        last = self._updated_at
        if last is None or now <= last:
            # A stale or repeated timestamp refills nothing; time never runs backwards here.
            if last is None:
                self._updated_at = now
            return self._level
        level = self._level + (now - last) * self.refill_rate
        self._level = level if level < self.capacity else self.capacity
        self._updated_at = now
        return self._level

    def level(self, now: float) -> float:
        return self._refill(now)

    def try_consume(self, cost: float, now: float) -> bool:
        if cost < 0 or cost != cost:
            raise ValueError(f"cost must be a non-negative number, got {cost!r}")
        if self._refill(now) >= cost:
            self._level -= cost
            return True
        return False

    def refund(self, amount: float, now: float) -> float:
        """Give back an unused charge (never above capacity); returns the new level."""
        if amount < 0 or amount != amount:
            raise ValueError(f"refund must be a non-negative number, got {amount!r}")
        level = self._refill(now) + amount
        self._level = level if level < self.capacity else self.capacity
        return self._level

    def seconds_until(self, cost: float, now: float) -> float:
        """How long until `cost` fits; infinite when it never can (cost above capacity, no refill)."""
        missing = cost - self._refill(now)
        if missing <= 0:
            return 0.0
        if cost > self.capacity or self.refill_rate <= 0:
            return math.inf
        return missing / self.refill_rate

    def set_rate(self, capacity: float, refill_rate: float, now: float) -> None:
        """Resize (entitlement changed): keep the level, clipped to the new capacity."""
        self._refill(now)
        self.capacity = require_positive("capacity", capacity)
        self.refill_rate = require_non_negative("refill_rate", refill_rate)
        self._level = min(self._level, self.capacity)

    def __repr__(self) -> str:
        return f"TokenBucket(capacity={self.capacity}, refill_rate={self.refill_rate}, level={self._level})"
