"""READ's snapshot, as the Redis store's scripts write it (one string of 20 space-separated fields, listed in
`apps/gateway/lua/machine.lua`'s `snapshot`), read into what `apps.policy.admit` decides on; and the snapshots
a gateway process keeps from its last replies, so that an offer may decide before asking Redis anything.

An offer decided on READ's snapshot costs two calls (READ, then COMMIT with the pool's version). RELEASE also
answers with the entitlement's snapshot after it, and a refused offer keeps READ's; the next offer of that
entitlement in this process decides on it and sends COMMIT alone, with the snapshot's fingerprint: COMMIT
applies the decision only if READ would give the same fingerprint now and the bucket still holds the charge,
and otherwise answers with READ's snapshot, on which the caller decides again (two calls, as before). While
the pool's change mark the snapshot carries still stands (nothing written to the pool since), COMMIT does not
read the snapshot again: only the bucket and the duplicate flag can differ then. When the mark has moved, a
start that borrows nothing still stands if `admit` would take the same decision on the pool as it is now
(commit.lua's `still_admitted`, given `standing_args`): so offers of one process that start on one kept
snapshot need not wait for each other's replies, and a start decided on READ's snapshot is checked the same
way. The decision stands on nothing READ would have shown differently, so the machine's outcomes are unchanged
(`make conformance` runs the same scenarios either way; tests/gateway/test_redis_still_admitted.py checks every
such COMMIT against `admit`). Only a start is decided this way: a refusal or a
wait decided on a kept snapshot is decided again on READ's, since room freed meanwhile (which moves the
fingerprint but may not have reached this process) could change it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from apps.gateway.snapshot import PoolInfo
from apps.policy import AdmissionDecision, EntitlementLimits, EntitlementUsage, PoolUsage
from apps.policy.admission import budget_bound, dispatch_capacity

# The fields a fingerprint leaves out (0-based): the bucket's level (it only rises with time; COMMIT checks the
# charge against its own), the oldest start (refusals only), the duplicate flag (the request's own) and the
# pool's change mark (COMMIT's shortcut: while it stands, nothing was written since, and no field moved).
LEVEL, OLDEST, DUPLICATE, MARK = 4, 17, 19, 20
# At most this many entitlements' snapshots per process (a pool of 10,000 entitlements fits many times over).
KEPT_LIMIT = 100_000


def _float(value: str) -> float:
    return float(value) if value else 0.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What READ returned, as `admit` takes it."""

    usage: EntitlementUsage
    pool_usage: PoolUsage
    version: str
    queue_length: int
    oldest_start: float | None
    duplicate: bool


def read_snapshot(fields: list[str], limits: EntitlementLimits, pool: PoolInfo, saturation: float) -> Snapshot:
    """READ's fields read for `admit`: the pool's capacity and saturation are the caller's own."""
    level = _float(fields[4])
    usage = EntitlementUsage(
        in_flight=int(_float(fields[0])), kv_bytes_in_flight=_float(fields[1]), running=int(_float(fields[2])),
        kv_bytes_running=_float(fields[3]), tokens_available=math.inf if limits.bucket_capacity is None else level,
        debt=_float(fields[5]), burst=_float(fields[6]),
    )
    budget: int | None = int(_float(fields[18]))
    if budget is not None and budget < 0:
        budget = None
    running = int(_float(fields[7]))
    capacity = max(0, pool.concurrency_capacity)
    pool_usage = PoolUsage(
        concurrency_capacity=dispatch_capacity(capacity, budget),
        kv_capacity=pool.kv_capacity,
        running=running,
        kv_bytes_running=_float(fields[8]),
        reserved_idle_concurrency=int(_float(fields[9])),
        reserved_idle_kv=_float(fields[10]),
        saturation=saturation,
        admission_threshold=float(fields[11]) if fields[11] != "" else -math.inf,
        mean_slo_ms=pool.mean_slo_ms,
        lowest_evictable_priority=float(fields[12]) if fields[12] != "" else None,
        evictable_running=int(_float(fields[13])),
        evictable_kv_bytes=_float(fields[14]),
        budget_bound=budget_bound(budget, running, capacity),
    )
    return Snapshot(usage, pool_usage, fields[15], int(_float(fields[16])),
                    float(fields[17]) if fields[17] != "" else None, fields[19] == "1")


def standing_args(limits: EntitlementLimits, decision: AdmissionDecision, fields: list[str]) -> str:
    """COMMIT's argument for `still_admitted` (commit.lua) of a start decided on `fields`: their debt ('-' for a
    class whose priority has none) and burst and whether the class is reserved, when the start borrows nothing;
    '' otherwise (the fingerprint decides)."""
    if not decision.admitted or decision.borrowed:
        return ""
    traits = limits.traits
    return f"{fields[5] if traits.accrues_debt else '-'} {fields[6]} {'1' if traits.reserved else '0'}"


def fingerprint(fields: list[str]) -> str:
    """What COMMIT compares a kept snapshot by (machine.lua's `fingerprint`)."""
    return " ".join(value for i, value in enumerate(fields) if i not in (LEVEL, OLDEST, DUPLICATE, MARK))


class KeptSnapshots:
    """The entitlements' snapshots from this process's last replies, by pool and entitlement."""

    def __init__(self, limit: int = KEPT_LIMIT) -> None:
        self._limit = limit
        self._by_pool: dict[str, dict[str, str]] = {}
        self._count = 0

    def keep(self, pool: str, entitlement: str, text: str) -> None:
        if not text:
            return
        entries = self._by_pool.get(pool)
        if entries is None:
            entries = self._by_pool[pool] = {}
        if entitlement not in entries:
            if self._count >= self._limit:  # bounded: start again (each entry is only a shortcut)
                self._by_pool.clear()
                self._count = 0
                entries = self._by_pool[pool] = {}
            self._count += 1
        entries[entitlement] = text

    def get(self, pool: str, entitlement: str) -> list[str] | None:
        entries = self._by_pool.get(pool)
        text = None if entries is None else entries.get(entitlement)
        return None if text is None else text.split(" ")

    def forget(self, pool: str) -> None:
        """A pool synced again (its entitlements or limits changed): its snapshots are READ's again."""
        self._count -= len(self._by_pool.pop(pool, {}))
