"""The steps of `transitions.TRANSITION_SCENARIOS` that are not offers (each driver plays them its own way:
tests/conformance/drivers.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tests.conformance.scenarios import Offer


@dataclass(frozen=True)
class Capacity:
    """The snapshot's capacity of the pool changes (replicas gone or added): a shrink cancels nothing and new
    work waits for releases; a growth starts waiters."""

    slots: int
    kv_capacity: float | None = None


@dataclass(frozen=True)
class Saturation:
    """The pool's saturation signal as the snapshot has it (1.0 and above: its backends' queues are full)."""

    value: float


@dataclass(frozen=True)
class Leases:
    """The holders renew the leases of `renew` (for `Scenario.lease_s` from now); then every request whose
    lease lapsed is released as its process died: a waiting one cancelled, a running one completed with its
    usage unknown (its whole charge spent). `reaped`: how many were released."""

    renew: tuple[str, ...] = ()
    reaped: int | None = None


@dataclass(frozen=True)
class Race:
    """Two offers decided on the same read of the pool: `early` is decided and committed in between `late`'s
    read and its commit, so `late`'s commit meets a changed pool (the Redis store's compare-and-set fails)
    and `late` must be decided again on a fresh read: the outcome is `early` then `late`, one after the other."""

    late: Offer
    early: Offer


@dataclass(frozen=True)
class Remove:
    """The entitlement leaves the pool (deleted, moved): its running requests finish, its waiters in the pool's
    room may still start, nothing of it leaves its queue, and its offers are refused as not bound."""

    ent: str


@dataclass(frozen=True)
class Busy:
    """What the gauges read of the pool: the entitlements with requests in flight and how many (`busy`: the
    expected pairs, sorted), and the debt and burst of `ents` (at rest for one never ticked)."""

    busy: tuple[tuple[str, int], ...] | None = None
    ents: tuple[str, ...] = ()
