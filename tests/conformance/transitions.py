"""Scenarios of the transitions that are not offers (issue 25): the pool's capacity and saturation changing,
evictions chosen by entry, request leases renewed and reaped, compare-and-set conflicts between two stores,
records left by an earlier release, an entitlement removed from the pool. Run like `scenarios.SCENARIOS`:
on the ledger, the in-process store and the Redis store, every observation compared with the ledger's."""

from __future__ import annotations

from dataclasses import dataclass

from tests.conformance.scenarios import (
    At,
    Cancel,
    Complete,
    Expire,
    Offer,
    Pool,
    QuotaState,
    Scenario,
    State,
    Usage,
    ent,
    quota,
)


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


TRANSITION_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "capacity: the pool shrinks (nothing cancelled, new work waits), then grows (waiters start)",
        Pool(slots=3),
        (ent("chat", "guaranteed", concurrency=1), ent("cheap", "spot", concurrency=4),
         ent("batch", "elastic", concurrency=4, slo_target_ms=2000.0)),
        (
            Offer("s1", "cheap", expect="running"),
            Offer("s2", "cheap", expect="running"),
            Capacity(1),
            State("s1", expect="running"),
            State("s2", expect="running"),
            Usage("cheap", in_flight=2, running=2),
            Offer("b1", "batch", expect="waiting", reason="queued"),
            Offer("c1", "chat", expect="waiting", reason="queued"),
            Offer("s3", "cheap", expect="rejected", reason="pool_contended"),
            # one release leaves 1 running in a pool of 1: nobody starts
            Complete("s1", output=5, started=()),
            State("c1", expect="waiting"),
            Capacity(3),
            State("c1", expect="running"),
            State("b1", expect="running"),
            Usage("batch", in_flight=1, running=1),
            Capacity(4),
            Offer("s4", "cheap", expect="running"),
            Complete("s2", output=5),
            Complete("b1", output=5),
            Complete("c1", output=5),
            Complete("s4", output=5),
        ),
    ),
    Scenario(
        "capacity: the KV capacity shrinks under running work and grows back",
        Pool(slots=8, kv_capacity=200.0),
        (ent("kv", "spot", concurrency=4, kv_bytes_per_token=2.0),
         ent("big", "guaranteed", concurrency=2, kv_bytes_per_token=2.0)),
        (
            Offer("k1", "kv", 10, 20, expect="running"),
            Offer("k2", "kv", 10, 20, expect="running"),
            Capacity(8, kv_capacity=100.0),
            State("k1", expect="running"),
            State("k2", expect="running"),
            Offer("k3", "kv", 10, 20, expect="rejected", reason="pool_contended"),
            Offer("b1", "big", 10, 20, expect="waiting"),
            # 60 of 100 bytes still run: b1's 60 do not fit
            Complete("k1", output=5, started=()),
            State("b1", expect="waiting"),
            Capacity(8, kv_capacity=200.0),
            State("b1", expect="running"),
            Complete("k2", output=5),
            Complete("b1", output=5),
        ),
    ),
    Scenario(
        "saturation: a reserved request within its baseline is still admitted; others wait, then start when the "
        "saturation clears",
        Pool(slots=6),
        (ent("chat", "guaranteed", concurrency=2), ent("batch", "elastic", concurrency=4),
         ent("cheap", "spot", concurrency=4)),
        (
            Offer("s0", "cheap", expect="running"),
            Saturation(1.0),
            Offer("g1", "chat", expect="running", reason="admitted"),
            Offer("g2", "chat", expect="running", reason="admitted"),
            Offer("b1", "batch", expect="waiting", reason="queued"),
            Offer("s1", "cheap", expect="rejected", reason="pool_contended"),
            State("s0", expect="running"),
            Saturation(0.5),
            State("b1", expect="running"),
            Offer("s2", "cheap", expect="running"),
            Usage("chat", in_flight=2, running=2),
            Complete("g1", output=5),
            Complete("g2", output=5),
            Complete("b1", output=5),
            Complete("s0", output=5),
            Complete("s2", output=5),
        ),
    ),
    Scenario(
        "evictions by entry: the lowest-priority preemptible request goes first; KV room takes several victims",
        Pool(slots=8, kv_capacity=100.0),
        (ent("chat", "guaranteed", concurrency=2, kv_bytes_per_token=2.0),
         ent("loose", "preemptible", concurrency=4, kv_bytes_per_token=1.0, slo_target_ms=8000.0),
         ent("tight", "preemptible", concurrency=4, kv_bytes_per_token=1.0, slo_target_ms=1000.0)),
        (
            Offer("t1", "tight", 10, 20, expect="running"),
            At(0.1),
            Offer("l1", "loose", 10, 20, expect="running"),
            At(0.2),
            Offer("l2", "loose", 10, 20, expect="running"),
            Usage("loose", in_flight=2, running=2),
            # 90 of 100 KV bytes run; 60 more are needed: two victims, the looser target's, the latest first
            Offer("g1", "chat", 10, 20, expect="running", evicted=("l2", "l1"), started=("g1",)),
            State("t1", expect="running"),
            Usage("loose", in_flight=0, running=0),
            Complete("l1", output=2, expect="unknown"),
            Complete("l2", output=2, expect="unknown"),
            Offer("l3", "loose", 5, 5, expect="running"),
            # 20 more KV bytes: the lowest priority (l3, loose) first, then t1
            Offer("g2", "chat", 5, 5, expect="running"),
            State("t1", expect="gone"),
            Offer("l4", "loose", 5, 5, expect="running"),
            Complete("g1", output=20, started=()),
            Complete("t1", output=20, expect="unknown"),
            Complete("g2", output=5),
            Complete("l3", output=5, expect="unknown"),
            Complete("l4", output=5),
        ),
    ),
    Scenario(
        "leases: a request whose holder stops renewing is reaped after its lease (running: its charge spent, "
        "waiters start; waiting: cancelled); one renewed is not",
        Pool(slots=2),
        (ent("chat", "guaranteed", concurrency=1, tokens_per_second=1.0), ent("cheap", "spot", concurrency=4),
         ent("batch", "elastic", concurrency=2)),
        (
            Offer("r1", "chat", 10, 20, expect="running"),
            Offer("s1", "cheap", expect="running"),
            At(1.5),
            Offer("w1", "batch", expect="waiting"),
            At(1.6),
            Leases(renew=("r1", "w1"), reaped=0),
            At(2.2),
            # s1's holder died (its lease ran out at 2.0): reaped, and w1 starts in its slot
            Leases(renew=("r1", "w1"), reaped=1),
            State("s1", expect="gone"),
            State("w1", expect="running"),
            Usage("batch", in_flight=1, running=1),
            At(3.0),
            Leases(renew=("w1",), reaped=0),
            At(4.0),
            # r1 was last renewed at 2.2: reaped at 4.2, not before; its charge stays spent
            Leases(renew=("w1",), reaped=0),
            At(4.3),
            Leases(renew=("w1",), reaped=1),
            State("r1", expect="gone"),
            Usage("chat", in_flight=0, running=0, tokens=34.3),
            Complete("r1", output=5, expect="unknown"),
            Offer("w2", "chat", 10, 20, expect="running"),
            At(7.0),
            Leases(reaped=2),
            Usage("batch", in_flight=0, running=0),
            Usage("chat", in_flight=0, running=0),
        ),
        lease_s=2.0,
    ),
    Scenario(
        "leases: a queued request whose holder died is reaped from its entitlement's queue",
        Pool(slots=4),
        (ent("chat", "guaranteed", concurrency=1, queue_max=2, queue_max_wait_ms=10_000.0),),
        (
            Offer("a", "chat", expect="running"),
            Offer("b", "chat", expect="waiting", reason="queued"),
            Offer("c", "chat", expect="waiting", reason="queued"),
            At(1.5),
            Leases(renew=("a", "c"), reaped=0),
            At(2.5),
            Leases(renew=("a", "c"), reaped=1),
            State("b", expect="gone"),
            Complete("a", output=5, started=("c",)),
            Complete("c", output=5),
        ),
        lease_s=2.0,
    ),
    Scenario(
        "compare-and-set: two offers decided on the same read; the later commit reads again (last slot, a "
        "reservation, a queue)",
        Pool(slots=3),
        (ent("chat", "guaranteed", concurrency=1, queue_max=2, queue_max_wait_ms=5000.0),
         ent("cheap", "spot", concurrency=4),
         ent("batch", "elastic", concurrency=1, queue_max=2, queue_max_wait_ms=5000.0)),
        (
            Offer("s1", "cheap", expect="running"),
            # both read one free slot beside chat's reservation: b1 takes it, s2 must not run too
            Race(late=Offer("s2", "cheap", expect="rejected", reason="pool_contended"),
                 early=Offer("b1", "batch", expect="running")),
            Race(late=Offer("b3", "batch", expect="waiting", reason="queued"),
                 early=Offer("b2", "batch", expect="waiting", reason="queued")),
            Race(late=Offer("c2", "chat", expect="waiting", reason="queued"),
                 early=Offer("c1", "chat", expect="running", evicted=())),
            Usage("batch", in_flight=1, running=1),
            Usage("chat", in_flight=1, running=1),
            # an elastic entitlement borrows beyond its concurrency when the pool has room: b2 leaves its queue
            Complete("s1", output=5, started=("b2",)),
            Complete("b1", output=5, started=("b3",)),
            Complete("b2", output=5, started=()),
            Complete("b3", output=5),
            Complete("c1", output=5, started=("c2",)),
            Complete("c2", output=5),
            Usage("chat", in_flight=0, running=0),
        ),
    ),
    Scenario(
        "compare-and-set: a quota reserved on a stale read is kept once, refunded once",
        Pool(slots=1),
        (ent("chat", "guaranteed", concurrency=1, queue_max=2, queue_max_wait_ms=5000.0),
         ent("cheap", "spot", concurrency=2)),
        (
            Race(late=Offer("r2", "chat", 10, 20, expect="waiting", reason="queued"), early=Offer("r1", "chat", 10, 20,
                                                                                 expect="running")),
            QuotaState("entitlement:chat", used=0.0, reserved=60.0),
            Race(late=Offer("s2", "cheap", expect="rejected", reason="pool_contended"),
                 early=Offer("s1", "cheap", expect="rejected", reason="pool_contended")),
            Complete("r1", output=5, started=("r2",)),
            Complete("r2", output=20),
            QuotaState("entitlement:chat", used=45.0, reserved=0.0),
        ),
        quotas=(("chat", (quota("entitlement:chat", 1000.0),)),),
    ),
    Scenario(
        "records left by an earlier release: an id offered again after its release, released twice, after an "
        "eviction, an expiry and a cancellation",
        Pool(slots=1),
        (ent("chat", "elastic", concurrency=1, tokens_per_second=1.0), ent("cheap", "spot", concurrency=2),
         ent("scav", "preemptible", concurrency=2), ent("vip", "elastic", concurrency=1, slo_target_ms=100.0),
         ent("batch", "elastic", concurrency=2)),
        (
            Offer("r1", "chat", 10, 20, expect="running"),
            Complete("r1", output=5),
            Complete("r1", output=5, expect="unknown"),
            Offer("r1", "chat", 10, 20, expect="running"),
            Usage("chat", in_flight=1, running=1, tokens=60.0 - 15.0 - 30.0),
            Offer("r1", "chat", 10, 20, expect="rejected", reason="invalid_request"),  # in flight: a duplicate
            Complete("r1", output=20),
            Complete("r1", output=20, expect="unknown"),
            Usage("chat", in_flight=0, running=0, tokens=60.0 - 15.0 - 30.0),
            Offer("p1", "scav", expect="running"),
            Offer("v1", "vip", expect="running", evicted=("p1",)),
            # p1's id offered again before its (late) release came: decided as any offer (no duplicate)
            Offer("p1", "scav", expect="rejected", reason="pool_contended"),
            Complete("p1", output=3, expect="unknown"),
            Complete("p1", output=3, expect="unknown"),
            Complete("v1", output=5),
            Offer("s1", "cheap", expect="running"),
            Offer("w1", "batch", expect="waiting"),
            At(1.0),
            Expire(expect=("w1",)),
            Complete("w1", output=0, expect="unknown"),
            Offer("w1", "batch", expect="waiting"),
            Cancel("w1"),
            Cancel("w1", expect="unknown"),
            Complete("s1", output=5),
            Offer("w1", "batch", expect="running"),
            Complete("w1", output=5),
            Usage("cheap", in_flight=0, running=0),
            Usage("scav", in_flight=0, running=0),
            Usage("batch", in_flight=0, running=0),
        ),
    ),
    Scenario(
        "records left by an earlier release: a quota settled, then the same id reserves and settles again",
        Pool(slots=2),
        (ent("chat", "guaranteed", concurrency=2),),
        (
            Offer("r1", "chat", 10, 20, expect="running"),
            Complete("r1", output=5),
            QuotaState("entitlement:chat", used=15.0, reserved=0.0),
            Complete("r1", output=5, expect="unknown"),
            QuotaState("entitlement:chat", used=15.0, reserved=0.0),
            Offer("r1", "chat", 10, 20, expect="running"),
            QuotaState("entitlement:chat", used=15.0, reserved=30.0),
            Cancel("r1", expect="completed"),
            QuotaState("entitlement:chat", used=45.0, reserved=0.0),
        ),
        quotas=(("chat", (quota("entitlement:chat", 1000.0),)),),
    ),
    Scenario(
        "records left by an earlier release: an evicted request's quota hold waits for its release; its id "
        "offered again meanwhile is refused as a duplicate",
        Pool(slots=1),
        (ent("scav", "preemptible", concurrency=2), ent("vip", "elastic", concurrency=1, slo_target_ms=100.0)),
        (
            Offer("p1", "scav", 10, 20, expect="running"),
            Offer("v1", "vip", expect="running", evicted=("p1",)),
            Offer("p1", "scav", 10, 20, expect="rejected", reason="invalid_request"),
            QuotaState("entitlement:scav", used=0.0, reserved=30.0),
            Complete("p1", output=3, expect="unknown"),
            QuotaState("entitlement:scav", used=3.0, reserved=0.0),
            Complete("v1", output=5),
        ),
        quotas=(("scav", (quota("entitlement:scav", 100.0),)),),
    ),
    Scenario(
        "an entitlement removed from the pool: its running requests finish, its queue never starts, its "
        "reservation goes, its offers are refused",
        Pool(slots=3),
        (ent("gone", "guaranteed", concurrency=2, tokens_per_second=1.0, queue_max=2, queue_max_wait_ms=2000.0),
         ent("stay", "guaranteed", concurrency=1), ent("cheap", "spot", concurrency=4)),
        (
            Offer("g1", "gone", 10, 20, expect="running"),
            Offer("g2", "gone", 10, 40, expect="waiting", reason="queued"),  # its bucket has 30 of 50
            Offer("s1", "cheap", expect="rejected", reason="pool_contended"),
            Remove("gone"),
            State("g1", expect="running"),
            Offer("g3", "gone", expect="rejected", reason="entitlement_not_bound"),
            # its idle reservation is gone: spot may take the room
            Offer("s2", "cheap", expect="running"),
            At(1.0),
            # the refund refills its bucket to 51 and the pool has room: still nothing leaves its queue
            Complete("g1", output=0, started=()),
            State("g2", expect="waiting"),
            Expire(expect=()),
            State("g2", expect="waiting"),
            At(2.0),
            Expire(expect=("g2",)),
            Usage("gone", in_flight=0, running=0),
            Complete("s2", output=5),
        ),
    ),
)
