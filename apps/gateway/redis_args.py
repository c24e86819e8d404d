"""The Redis store's values as its scripts' arguments, and their replies' numbers as Python's.

Numbers go as `repr(float)` (exact: the scripts read them back to the same double), a limit that is not set as
-1; the pool's reservations as pairs, with a signature that tells the scripts when they changed.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

from apps.gateway.snapshot import PoolInfo
from apps.gateway.state import UsageKey
from apps.policy import AdmissionConfig, Dynamics, EntitlementLimits
from apps.policy.window import WindowFigures


def reply_float(value: Any) -> float:
    if value in (None, b"", ""):
        return 0.0
    return float(value)


def bucket_args(limits: EntitlementLimits) -> tuple[str, str]:
    capacity = limits.bucket_capacity
    return ("-1", "0") if capacity is None else (repr(float(capacity)), repr(float(limits.tokens_per_second or 0.0)))


def queue_args(limits: EntitlementLimits) -> str:
    """What the Redis scripts let an entitlement's queue go by (`own_fits` in machine.lua), one argument."""
    def value(x: float | None) -> str:
        return "-1" if x is None else repr(float(x))

    return " ".join((value(limits.concurrency), value(limits.burst_concurrency), value(limits.kv_bytes),
                     value(limits.burst_kv_bytes), "1" if limits.traits.may_burst else "0",
                     repr(float(limits.own_queue_wait_s))))


def reserved_args(pool: PoolInfo) -> tuple[int, list[str]]:
    """The pool's reservations as script arguments, and a signature that says when they changed (computed
    once per snapshot of the pool: every offer passes them)."""
    cached = _RESERVED.get(id(pool))
    if cached is not None and cached[0] is pool:
        return cached[1], cached[2]
    pairs: list[str] = []
    for name, concurrency, kv_bytes in pool.reserved:
        pairs += [name, f"{int(concurrency)} {float(kv_bytes)!r}"]
    signature = zlib.crc32("\x00".join(pairs).encode())
    if len(_RESERVED) > 1024:
        _RESERVED.clear()
    _RESERVED[id(pool)] = (pool, signature, pairs)
    return signature, pairs


_RESERVED: dict[int, tuple[PoolInfo, int, list[str]]] = {}


def capacity_args(pool: PoolInfo, saturation: float, config: AdmissionConfig) -> list[str]:
    return [str(max(0, pool.concurrency_capacity)), repr(float(pool.kv_capacity)), repr(float(saturation)),
            repr(float(config.wait_timeout_s)), str(config.max_evictions_per_request)]


def usage_minute(usage: UsageKey) -> str:
    """The release script's minute argument, with the served tier after it: its usage field becomes
    `tenant|entitlement|minute|tier|kind` (`apps.gateway.usage.usage_counts_parse`) with no change to the script."""
    return f"{usage.minute}|{usage.service_tier}" if usage.service_tier else str(usage.minute)


def tick_rows(raw: list[Any]) -> Iterator[tuple[str, WindowFigures, Dynamics]]:
    """TICK's reply after its status and the elapsed time: per entitlement read, its name, its window's figures
    and its debt and burst before the tick (eleven values each)."""
    for index in range(2, len(raw), 11):
        values = [reply_float(value) for value in raw[index + 1: index + 11]]
        yield (str(raw[index]), WindowFigures(values[0], values[1], values[2], values[3], int(values[4]),
                                              int(values[5]), values[6], values[7]), Dynamics(values[8], values[9]))


def usage_claims(raw: list[Any]) -> dict[str, dict[str, str]]:
    """USAGE_CLAIM's reply: per claim, its name, then its fields as name, value pairs up to an empty string."""
    claims: dict[str, dict[str, str]] = {}
    index = 0
    while index < len(raw):
        claim, fields = raw[index], {}
        index += 1
        while raw[index] != "":
            fields[raw[index]] = raw[index + 1]
            index += 2
        index += 1
        claims[claim] = fields
    return claims
