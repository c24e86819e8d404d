"""One table of admission scenarios, run against the ledger, the in-process store and the Redis store.

A scenario is a pool, its entitlements and a list of steps on a fake clock. A step may state what it
expects (`expect`, `reason`, `started`, ...): that is checked on every driver. Every step's full
observation is also compared across drivers, so the stores must agree with the ledger on everything
they report, expected or not (floats to 1e-9).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from apps.policy import AdmissionConfig, EntitlementLimits
from apps.policy.quota import QuotaCharge

CONFIG = AdmissionConfig(wait_timeout_s=1.0, max_evictions_per_request=4)


@dataclass(frozen=True)
class Pool:
    slots: int
    kv_capacity: float = math.inf
    mean_slo_ms: float = 1000.0


@dataclass(frozen=True)
class At:
    """Move the fake clock to `t` seconds."""

    t: float


@dataclass(frozen=True)
class Offer:
    rid: str
    ent: str
    input_tokens: int = 10
    max_tokens: int | None = 20
    expect: str | None = None  # running | waiting | rejected
    reason: str | None = None
    started: tuple[str, ...] | None = None
    evicted: tuple[str, ...] | None = None
    # The client's llm-d hints (x-llm-d-slo-ttft-ms, x-llm-d-inference-objective): they may only relax.
    slo_ms: float | None = None
    tier: str | None = None
    # The class it is served as when lower than its entitlement's (spilled over, demoted); "": its own.
    served: str | None = None


@dataclass(frozen=True)
class Complete:
    """The backend answered (or the client went away mid-stream): release with the tokens produced."""

    rid: str
    output: int | None
    prompt: int | None = None
    expect: str | None = "completed"
    started: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Cancel:
    """The client went away while its request waited."""

    rid: str
    expect: str | None = "cancelled"
    started: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Bind:
    """An entitlement bound while the pool runs (a manifest applied): from now on it holds its reservation."""

    limits: EntitlementLimits


@dataclass(frozen=True)
class Expire:
    expect: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class Usage:
    ent: str
    in_flight: int | None = None
    running: int | None = None
    tokens: float | None = None


@dataclass(frozen=True)
class Budget:
    """The pool's dispatch budget (the AIMD controller's cap) set in the state machine; None removes it."""

    budget: int | None
    started: tuple[str, ...] | None = None


@dataclass(frozen=True)
class State:
    """Where one request stands in the state machine: running, waiting (the pool's room or its entitlement's
    queue), or gone."""

    rid: str
    expect: str | None = None


@dataclass(frozen=True)
class NewWindow:
    """The quotas' calendar window rolls over: every charge names `window_id` from now on."""

    window_id: str


@dataclass(frozen=True)
class QuotaState:
    """Where one quota stands (its used and reserved amounts)."""

    key: str
    used: float | None = None
    reserved: float | None = None


@dataclass(frozen=True)
class QuotaLeases:
    """The holder renews the quota leases of `renew` (for `lease_s` from now), then every hold whose lease
    lapsed is settled at its whole amount; `reaped` is what is expected to be settled."""

    renew: tuple[str, ...] = ()
    lease_s: float = 2.0
    reaped: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    pool: Pool
    entitlements: tuple[EntitlementLimits, ...]
    steps: tuple[Any, ...]
    # Entitlement -> the quotas its requests are under (one tenant's: one scope).
    quotas: tuple[tuple[str, tuple[QuotaCharge, ...]], ...] = ()
    # The lease of every quota hold (seconds; None: held until settled).
    quota_lease_s: float | None = None
    # The lease of every request the store holds (seconds; its holder renews it: `Leases` steps).
    lease_s: float = 10.0
    # A check of the whole trace (list of observations), e.g. debt rising then decaying.
    check: Callable[[list[dict[str, Any]]], None] | None = field(default=None, compare=False)


def quota(key: str, limit: float, seed: float = 0.0, on_exceeded: str = "reject", **weights: float) -> QuotaCharge:
    return QuotaCharge(key, limit, "w1", reset_at=3600.0, seed_used=seed, on_exceeded=on_exceeded, **weights)


def ent(name: str, service_class: str, **fields: Any) -> EntitlementLimits:
    """An entitlement; without a queue unless the scenario gives one (these scenarios test the checks' own
    refusals; the queue scenarios set `queue_max`)."""
    fields.setdefault("slo_target_ms", 1000.0)
    fields.setdefault("queue_max", 0)
    return EntitlementLimits(entitlement_id=name, service_class=service_class, **fields)


def _debts(trace: list[dict[str, Any]], name: str) -> list[float]:
    return [obs["dynamics"][name][0] for obs in trace if obs["step"] == "Tick"]


def _debt_rises_then_decays(trace: list[dict[str, Any]]) -> None:
    debts = _debts(trace, "batch")
    rising, falling = debts[:3], debts[3:]
    assert 0 < rising[0] < rising[1] < rising[2], debts
    assert falling[0] < rising[2] and all(b < a for a, b in zip(falling, falling[1:], strict=False)), debts
    assert falling[-1] < 0.5 * rising[2], debts


# Serving at a lower tier (issue 24, apps.policy.tiers): spillover and quota demotion.
TIER_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "spillover: over its own concurrency a request runs at once as spot on idle capacity, never on another's "
        "reservation; with no idle room it waits in its own queue",
        Pool(slots=5),
        (ent("chat", "guaranteed", concurrency=1, queue_max=2, queue_max_wait_ms=5000.0, spillover_class="spot"),
         ent("other", "guaranteed", concurrency=2)),
        (
            Offer("a", "chat", expect="running", served=""),
            Offer("b", "chat", expect="running", served="spot"),
            Offer("c", "chat", expect="running", served="spot"),
            Usage("chat", in_flight=1, running=1),
            # 3 running and other's 2 idle reserved slots: no idle room to spill into, so the own queue
            Offer("d", "chat", expect="waiting", reason="queued", served=""),
            Offer("o1", "other", expect="running"),
            Offer("o2", "other", expect="running"),
            Complete("b", output=5, started=()),
            # a release of the spot tier frees room, not the entitlement's concurrency: d waits for a
            State("d", expect="waiting"),
            Complete("a", output=5, started=("d",)),
            Offer("e", "chat", expect="running", served="spot"),
            Complete("c", output=5),
            Complete("d", output=5),
            Complete("e", output=5),
            Complete("o1", output=5),
            Complete("o2", output=5),
            Usage("chat", in_flight=0, running=0),
        ),
    ),
    Scenario(
        "spillover: to preemptible on its token bucket's refusal; a higher tier evicts the spilled request",
        Pool(slots=2),
        (ent("rated", "elastic", tokens_per_second=1.0, token_bucket_seconds=30.0, concurrency=2,
             spillover_class="preemptible"),
         ent("chat", "guaranteed", concurrency=1)),
        (
            Offer("r1", "rated", 10, 20, expect="running", served=""),
            Offer("r2", "rated", 10, 20, expect="running", served="preemptible"),
            Offer("g1", "chat", expect="running", evicted=("r2",)),
            Complete("r2", output=2, expect="unknown"),  # its eviction released it already
            Complete("r1", output=5),
            Complete("g1", output=5),
        ),
    ),
    Scenario(
        "quota demotion: a used-up quota that says spot serves as spot (charged to none of its spot quotas), "
        "a quota that says reject still refuses",
        Pool(slots=4),
        (ent("chat", "guaranteed", concurrency=4),),
        (
            Offer("r1", "chat", 10, 20, expect="running", served=""),
            Offer("r2", "chat", 10, 20, expect="running", served=""),
            QuotaState("entitlement:chat", used=0.0, reserved=60.0),
            Offer("r3", "chat", 10, 20, expect="running", served="spot"),
            QuotaState("entitlement:chat", used=0.0, reserved=60.0),
            QuotaState("tenant", used=0.0, reserved=90.0),
            Offer("r4", "chat", 10, 20, expect="running", served="spot"),
            Usage("chat", in_flight=2, running=2),
            # the tenant's quota (reject) has no room left for a fifth: refused whatever the tier
            Offer("r5", "chat", 10, 20, expect="rejected", reason="quota_exceeded"),
            Complete("r3", output=5),
            QuotaState("entitlement:chat", used=0.0, reserved=60.0),
            QuotaState("tenant", used=15.0, reserved=90.0),
            Complete("r1", output=5),
            Complete("r2", output=5),
            Complete("r4", output=5),
            QuotaState("entitlement:chat", used=30.0, reserved=0.0),
            NewWindow("w2"),
            Offer("r6", "chat", 10, 20, expect="running", served=""),
            Complete("r6", output=5),
        ),
        quotas=(("chat", (quota("entitlement:chat", 60.0, on_exceeded="spot"), quota("tenant", 130.0))),),
    ),
    Scenario(
        "quota demotion: a demoted request that finds no idle room is refused as the pool's contention",
        Pool(slots=2),
        (ent("chat", "guaranteed", concurrency=1), ent("other", "guaranteed", concurrency=1)),
        (
            Offer("r1", "chat", 10, 20, expect="running"),
            Offer("r2", "chat", 10, 20, expect="rejected", reason="pool_contended", served="spot"),
            QuotaState("entitlement:chat", used=0.0, reserved=30.0),
            Complete("r1", output=5),
            Offer("r3", "chat", 10, 20, expect="running", served="spot"),
            Complete("r3", output=5),
            QuotaState("entitlement:chat", used=15.0, reserved=0.0),
        ),
        quotas=(("chat", (quota("entitlement:chat", 40.0, on_exceeded="spot"),)),),
    ),
)


QUEUE_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "budget: AIMD shrinks the pool's dispatch budget (nothing cancelled, new work waits, even at the lowest "
        "priority) and grows it (waiters start, highest priority first)",
        Pool(slots=4),
        (ent("chat", "guaranteed", concurrency=1), ent("cheap", "spot", concurrency=4)),
        (
            Offer("s1", "cheap", expect="running"),
            Offer("s2", "cheap", expect="running"),
            Budget(2, started=()),
            Offer("s3", "cheap", expect="waiting", reason="queued"),
            Offer("c", "chat", expect="waiting", reason="queued"),
            Complete("s1", output=5, started=("c",)),
            Budget(1, started=()),
            Usage("cheap", in_flight=2, running=1),
            Offer("s4", "cheap", expect="waiting", reason="queued"),
            Complete("s2", output=5, started=()),
            Budget(4, started=("s3", "s4")),
            Offer("s5", "cheap", expect="running"),
            Offer("s6", "cheap", expect="rejected", reason="pool_contended"),  # the capacity is full: refused
            Budget(None, started=()),
            Complete("c", output=5),
            Complete("s3", output=5),
            Complete("s4", output=5),
            Complete("s5", output=5),
        ),
    ),
    Scenario(
        "budget: a waiter whose budget never comes back expires at the acquire timeout",
        Pool(slots=4),
        (ent("cheap", "spot", concurrency=4),),
        (
            Budget(1, started=()),
            Offer("s1", "cheap", expect="running"),
            Offer("s2", "cheap", expect="waiting", reason="queued"),
            At(1.0),
            Expire(expect=("s2",)),
            Complete("s1", output=5),
        ),
    ),
    Scenario(
        "queue: a wait on its own concurrency, first come first served, a full queue, started by releases",
        Pool(slots=8),
        (ent("chat", "guaranteed", concurrency=1, queue_max=2, queue_max_wait_ms=2000.0),),
        (
            Offer("a", "chat", expect="running"),
            At(0.25),
            Offer("b", "chat", expect="waiting", reason="queued"),
            Offer("c", "chat", expect="waiting", reason="queued"),
            Offer("d", "chat", expect="rejected", reason="queue_full"),
            Usage("chat", in_flight=1, running=1),
            At(0.5),
            Complete("a", output=5, started=("b",)),
            State("c", expect="waiting"),
            Complete("b", output=5, started=("c",)),
            Complete("c", output=5, started=()),
            Usage("chat", in_flight=0, running=0),
        ),
    ),
    Scenario(
        "queue: new limits let it go: a degraded entitlement's head stays, a larger concurrency starts it",
        Pool(slots=8),
        (ent("chat", "guaranteed", concurrency=1, queue_max=2, queue_max_wait_ms=5000.0),),
        (
            Offer("a", "chat", expect="running"),
            Offer("b", "chat", expect="waiting", reason="queued"),
            Bind(ent("chat", "guaranteed", concurrency=1, queue_max=2, queue_max_wait_ms=5000.0, state="degraded")),
            Complete("a", output=5, started=()),
            State("b", expect="waiting"),
            Bind(ent("chat", "guaranteed", concurrency=2, queue_max=2, queue_max_wait_ms=5000.0)),
            State("b", expect="running"),
            Offer("c", "chat", expect="running"),
            Complete("b", output=5),
            Complete("c", output=5),
        ),
    ),
    Scenario(
        "queue: a wait on its token bucket, woken at the refill time",
        Pool(slots=8),
        (ent("rated", "guaranteed", tokens_per_second=10.0, token_bucket_seconds=10.0, queue_max=4,
             queue_max_wait_ms=10_000.0),),
        (
            Offer("r1", "rated", 40, 40, expect="running"),
            Offer("r2", "rated", 40, 40, expect="waiting", reason="queued"),
            Usage("rated", in_flight=1, tokens=20.0),
            At(5.5),
            Expire(expect=()),
            State("r2", expect="waiting"),
            At(6.0),
            Expire(expect=()),
            State("r2", expect="running"),
            Usage("rated", in_flight=2, running=2, tokens=0.0),
            Complete("r1", output=40),
            Complete("r2", output=40),
        ),
    ),
    Scenario(
        "queue: a wait on its KV bytes, then its wait times out; a cancelled waiter leaves nothing",
        Pool(slots=8),
        (ent("kv", "guaranteed", concurrency=4, kv_bytes=100.0, kv_bytes_per_token=2.0, queue_max=2,
             queue_max_wait_ms=500.0),),
        (
            Offer("k1", "kv", 10, 20, expect="running"),
            Offer("k2", "kv", 10, 20, expect="waiting", reason="queued"),
            At(0.25),
            Offer("k3", "kv", 10, 20, expect="waiting", reason="queued"),
            At(0.5),
            Expire(expect=("k2",)),
            Cancel("k3"),
            Usage("kv", in_flight=1, running=1),
            Complete("k1", output=20, started=()),
            Usage("kv", in_flight=0, running=0),
        ),
    ),
    Scenario(
        "queue: in a full pool, its own release frees the head's slot; a lower class is refused meanwhile",
        Pool(slots=2),
        (ent("chat", "guaranteed", concurrency=1, queue_max=2, queue_max_wait_ms=2000.0),
         ent("filler", "elastic", concurrency=2)),
        (
            Offer("a", "chat", expect="running"),
            Offer("f1", "filler", expect="running"),
            Offer("b", "chat", expect="waiting", reason="queued"),
            Offer("f2", "filler", expect="rejected", reason="pool_contended"),
            Complete("a", output=5, started=("b",)),
            Complete("f1", output=5),
            Complete("b", output=5),
        ),
    ),
    Scenario(
        "queue: spot has none; its refusal's Retry-After is the earliest expected end of its running requests",
        Pool(slots=8),
        (ent("cheap", "spot", concurrency=1, burst_concurrency=1, queue_max=None),),
        (
            At(2.0),
            Offer("s1", "cheap", expect="running"),
            At(2.25),
            Offer("s2", "cheap", expect="rejected", reason="concurrency_limit_exceeded"),
            Complete("s1", output=5),
        ),
    ),
)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "hints: a client's tighter SLO and higher objective do not let it overtake an earlier request of its entitlement",
        Pool(slots=1),
        (ent("cheap", "spot", concurrency=4), ent("slow", "spot", concurrency=4, slo_target_ms=5000.0)),
        (
            Offer("s1", "slow", expect="running"),
            Offer("u1", "cheap", expect="waiting"),
            # x-llm-d-slo-ttft-ms: 1 and x-llm-d-inference-objective: critical from the same key
            Offer("h1", "cheap", slo_ms=1.0, tier="critical", expect="waiting"),
            Complete("s1", output=5, started=("u1",)),
            Complete("u1", output=5, started=("h1",)),
            # loosening is honoured: a looser target ranks below the running request, so a full pool refuses it
            Offer("l1", "cheap", slo_ms=5000.0, tier="batch", expect="rejected", reason="pool_contended"),
            Complete("h1", output=5),
        ),
    ),
    Scenario(
        "plain admission", Pool(slots=4),
        (ent("chat", "guaranteed", concurrency=2, tokens_per_second=10.0),),
        (
            At(1.0),
            Offer("r1", "chat", 10, 20, expect="running", reason="admitted", started=("r1",)),
            Usage("chat", in_flight=1, running=1, tokens=600.0 - 30),
            At(2.0),
            Complete("r1", output=20, started=()),
            Usage("chat", in_flight=0, running=0, tokens=580.0),
        ),
    ),
    Scenario(
        "check 1: entitlement not bound", Pool(slots=4),
        (ent("degraded", "guaranteed", concurrency=2, state="degraded"),),
        (Offer("r1", "degraded", expect="rejected", reason="entitlement_not_bound"),),
    ),
    Scenario(
        "check 2: output bound", Pool(slots=4),
        (ent("chat", "elastic", concurrency=2, context_window=100),),
        (
            Offer("r1", "chat", 90, 20, expect="rejected", reason="context_length_exceeded"),
            Offer("r2", "chat", 10, 0, expect="rejected", reason="max_tokens_invalid"),
            Offer("r3", "chat", 90, None, expect="running"),
        ),
    ),
    Scenario(
        "check 3: concurrency", Pool(slots=4),
        (ent("chat", "guaranteed", concurrency=1),),
        (
            Offer("r1", "chat", expect="running"),
            Offer("r2", "chat", expect="rejected", reason="concurrency_limit_exceeded"),
        ),
    ),
    Scenario(
        "check 4: token budget and KV bytes", Pool(slots=8),
        (
            ent("rated", "guaranteed", concurrency=4, tokens_per_second=1.0),
            ent("kv", "guaranteed", concurrency=4, kv_bytes=100.0, kv_bytes_per_token=2.0),
        ),
        (
            Offer("r1", "rated", 10, 20, expect="running"),
            Offer("r2", "rated", 10, 20, expect="running"),
            Offer("r3", "rated", 10, 20, expect="rejected", reason="rate_limit_exceeded"),
            At(30.0),
            Offer("r4", "rated", 10, 20, expect="running"),
            Offer("k1", "kv", 10, 20, expect="running"),
            Offer("k2", "kv", 10, 20, expect="rejected", reason="kv_cache_limit_exceeded"),
        ),
    ),
    Scenario(
        "check 5: pool contention", Pool(slots=1),
        (ent("chat", "guaranteed", concurrency=1), ent("cheap", "spot", concurrency=4)),
        (
            Offer("r1", "chat", expect="running"),
            Offer("r2", "cheap", expect="rejected", reason="pool_contended"),
        ),
    ),
    Scenario(
        "waiting: a higher priority starts before an earlier lower one", Pool(slots=1),
        (
            ent("cheap", "spot", concurrency=1),
            ent("relaxed", "elastic", concurrency=1, slo_target_ms=5000.0),
            ent("urgent", "elastic", concurrency=1, slo_target_ms=1000.0),
        ),
        (
            Offer("s1", "cheap", expect="running"),
            At(0.1),
            Offer("lo", "relaxed", expect="waiting", reason="queued"),
            At(0.2),
            Offer("hi", "urgent", expect="waiting", reason="queued"),
            At(0.3),
            Complete("s1", output=20, started=("hi",)),
            At(0.4),
            Complete("hi", output=20, started=("lo",)),
            Complete("lo", output=20, started=()),
        ),
    ),
    Scenario(
        # Spot work admitted before guaranteed "late" was bound fills its reservation. Each guaranteed request
        # within its own reservation may take the room there is (deferring to the other's idle reservation
        # would make both wait, and expire, until the spot work is gone): at an offer and as a waiter. Spot
        # takes none of the idle reservations meanwhile.
        "reservations are honoured while spot work fills one bound after it", Pool(slots=4),
        (ent("early", "guaranteed", concurrency=2), ent("cheap", "spot", concurrency=2)),
        (
            Offer("e1", "early", expect="running"),
            Offer("e2", "early", expect="running"),
            Offer("s1", "cheap", expect="running"),
            Offer("s2", "cheap", expect="running"),
            Bind(ent("late", "guaranteed", concurrency=2)),
            At(0.5),
            Complete("e1", output=20, started=()),
            Offer("l1", "late", expect="running", reason="admitted"),
            Offer("e3", "early", expect="waiting", reason="queued"),
            At(0.6),
            Complete("s1", output=20, started=("e3",)),
            Offer("s3", "cheap", expect="rejected", reason="pool_contended"),
            Complete("s2", output=20, started=()),
            Offer("s4", "cheap", expect="rejected", reason="pool_contended"),
            Offer("l2", "late", expect="running", reason="admitted"),
            Usage("late", in_flight=2, running=2),
            Usage("early", in_flight=2, running=2),
        ),
    ),
    Scenario(
        "a waiter expires at the acquire timeout", Pool(slots=1),
        (ent("cheap", "spot", concurrency=1), ent("batch", "elastic", concurrency=2, tokens_per_second=1.0)),
        (
            Offer("s1", "cheap", expect="running"),
            At(0.5),
            Offer("w1", "batch", expect="waiting"),
            Usage("batch", in_flight=1, running=0, tokens=60.0 - 30),
            At(1.4),
            Expire(expect=()),
            At(1.5),
            Expire(expect=("w1",)),
            Usage("batch", in_flight=0, running=0, tokens=60.0),
            Complete("s1", output=20, started=()),
        ),
    ),
    Scenario(
        "a preemptible request is evicted for a guaranteed one", Pool(slots=2),
        (
            ent("chat", "guaranteed", concurrency=1, tokens_per_second=10.0),
            ent("cheap", "spot", concurrency=4),
            ent("scavenger", "preemptible", concurrency=4, tokens_per_second=10.0),
        ),
        (
            Offer("s1", "cheap", expect="running"),
            Offer("p1", "scavenger", expect="running"),
            At(0.5),
            Offer("g1", "chat", expect="running", reason="queued", started=("g1",), evicted=("p1",)),
            # charged 30 at 0.0, refilled 5 by 0.5, the 20 tokens it was not allowed to produce refunded
            Usage("scavenger", in_flight=0, running=0, tokens=595.0),
            Complete("p1", output=3, expect="unknown"),
        ),
    ),
    Scenario(
        "unused tokens are refunded", Pool(slots=2),
        (ent("chat", "guaranteed", concurrency=2, tokens_per_second=1.0),),
        (
            Offer("r1", "chat", 10, 40, expect="running"),
            Usage("chat", tokens=10.0),
            Complete("r1", output=5),
            Usage("chat", tokens=45.0),
            Offer("r2", "chat", 10, 20, expect="running"),
            Usage("chat", tokens=15.0),
            # the backend counted a shorter prompt than the gateway did: that difference comes back too
            Complete("r2", output=5, prompt=2),
            Usage("chat", tokens=38.0),
        ),
    ),
    Scenario(
        "released after a client disconnect", Pool(slots=1),
        (ent("cheap", "spot", concurrency=2), ent("batch", "elastic", concurrency=2, tokens_per_second=1.0)),
        (
            Offer("s1", "cheap", expect="running"),
            Offer("w1", "batch", 10, 20, expect="waiting"),
            Offer("w2", "batch", 10, 20, expect="waiting"),
            At(0.2),
            Cancel("w1", started=()),
            Usage("batch", in_flight=1, tokens=30.2),
            At(0.3),
            Complete("s1", output=4, started=("w2",)),
            At(0.6),
            Complete("w2", output=7, started=()),
            Usage("batch", in_flight=0, tokens=43.6),
            Cancel("w1", expect="unknown"),
        ),
    ),
    Scenario(
        # Spot work holds the pool; the elastic entitlement's requests wait and expire, second after second
        # (unmet demand: debt rises), then it is served its whole baseline (no gap: debt decays).
        "the debt of an underserved elastic entitlement rises, then decays", Pool(slots=2),
        (ent("cheap", "spot", concurrency=2), ent("batch", "elastic", concurrency=2)),
        (
            Offer("s1", "cheap", expect="running"),
            Offer("s2", "cheap", expect="running"),
            *(step for second in (1, 2, 3) for step in (
                At(second - 1.0),
                Offer(f"b{second}a", "batch", expect="waiting"),
                Offer(f"b{second}b", "batch", expect="waiting"),
                At(float(second)),
                Expire(expect=(f"b{second}a", f"b{second}b")),
                Tick(),
            )),
            Complete("s1", output=20),
            Complete("s2", output=20),
            Offer("run1", "batch", expect="running"),
            Offer("run2", "batch", expect="running"),
            *(step for second in (4, 5, 6, 7) for step in (At(float(second)), Tick())),
        ),
        check=_debt_rises_then_decays,
    ),
    Scenario(
        "quota: reserve prompt plus max_tokens, refuse what cannot fit, settle the unused, a new window",
        Pool(slots=8),
        (ent("chat", "guaranteed", concurrency=8),),
        (
            Offer("r1", "chat", 10, 20, expect="running"),
            Offer("r2", "chat", 10, 20, expect="running"),
            QuotaState("entitlement:chat", used=5.0, reserved=60.0),
            Offer("r3", "chat", 10, 40, expect="rejected", reason="quota_exceeded"),
            Complete("r1", output=5),
            QuotaState("entitlement:chat", used=20.0, reserved=30.0),
            Offer("r4", "chat", 10, 40, expect="running"),
            # the backend reported more than was reserved: a window never counts more than its limit
            Complete("r4", output=40, prompt=30),
            QuotaState("entitlement:chat", used=70.0, reserved=30.0),
            NewWindow("w2"),
            Offer("r5", "chat", 10, 80, expect="running"),
            Complete("r2", output=20),
            QuotaState("entitlement:chat", used=0.0, reserved=90.0),
            Complete("r5", output=None),
            QuotaState("entitlement:chat", used=90.0, reserved=0.0),
        ),
        quotas=(("chat", (quota("entitlement:chat", 105.0, seed=5.0),)),),
    ),
    Scenario(
        "quota: a tenant's quota is shared; rejected, expired and cancelled requests give theirs back",
        Pool(slots=1),
        (ent("cheap", "spot", concurrency=2), ent("batch", "elastic", concurrency=2),
         ent("chat", "elastic", concurrency=1)),
        (
            Offer("s1", "cheap", 10, 20, expect="running"),
            Offer("w1", "batch", 10, 20, expect="waiting"),
            Offer("w2", "batch", 10, 20, expect="waiting"),
            # each reserves 10 x 2 + 20 x 3 = 80 of the tenant's 300 (priced: input 2, output 3 per token)
            QuotaState("tenant", used=0.0, reserved=240.0),
            # over the tenant's quota (240 + 80 > 300) though the entitlement's own has room
            Offer("c1", "chat", 10, 20, expect="rejected", reason="quota_exceeded"),
            Cancel("w2"),
            QuotaState("tenant", reserved=160.0),
            # fits the quota, then the pool says no: the reservation comes back
            Offer("b3", "cheap", 10, 20, expect="rejected", reason="pool_contended"),
            QuotaState("tenant", reserved=160.0),
            At(1.0),
            Expire(expect=("w1",)),
            QuotaState("tenant", used=0.0, reserved=80.0),
            Complete("s1", output=4),
            QuotaState("tenant", used=32.0, reserved=0.0),
            QuotaState("entitlement:chat", used=0.0, reserved=0.0),
        ),
        quotas=(
            ("cheap", (quota("tenant", 300.0, input_weight=2.0, output_weight=3.0),)),
            ("batch", (quota("tenant", 300.0, input_weight=2.0, output_weight=3.0),)),
            ("chat", (quota("entitlement:chat", 1000.0), quota("tenant", 300.0, input_weight=2.0, output_weight=3.0))),
        ),
    ),
    Scenario(
        "quota: an evicted request's quota is settled at what it produced when its release comes",
        Pool(slots=2),
        (ent("chat", "guaranteed", concurrency=1), ent("cheap", "spot", concurrency=4),
         ent("scavenger", "preemptible", concurrency=1)),
        (
            Offer("s1", "cheap", expect="running"),
            Offer("p1", "scavenger", 10, 20, expect="running"),
            Offer("g1", "chat", expect="running", evicted=("p1",)),
            QuotaState("entitlement:scavenger", used=0.0, reserved=30.0),
            Complete("p1", output=3, expect="unknown"),
            QuotaState("entitlement:scavenger", used=3.0, reserved=0.0),
            Complete("p1", output=3, expect="unknown"),
            QuotaState("entitlement:scavenger", used=3.0, reserved=0.0),
        ),
        quotas=(("scavenger", (quota("entitlement:scavenger", 100.0),)),),
    ),
    Scenario(
        "quota: a hold whose lease lapsed is settled at its whole amount; a release after it settles nothing",
        Pool(slots=8),
        (ent("chat", "guaranteed", concurrency=8),),
        (
            Offer("r1", "chat", 10, 20, expect="running"),
            Offer("r2", "chat", 10, 20, expect="running"),
            Offer("r3", "chat", 10, 20, expect="running"),
            QuotaState("entitlement:chat", used=0.0, reserved=90.0),
            At(1.5),
            QuotaLeases(renew=("r1", "gone"), reaped=()),
            Complete("r3", output=5),
            QuotaState("entitlement:chat", used=15.0, reserved=60.0),
            At(2.5),
            # r2's holder stopped renewing (its process died): its whole hold counts as spent
            QuotaLeases(reaped=("r2",)),
            QuotaState("entitlement:chat", used=45.0, reserved=30.0),
            Complete("r2", output=3),
            QuotaState("entitlement:chat", used=45.0, reserved=30.0),
            At(4.0),
            QuotaLeases(reaped=("r1",)),
            QuotaState("entitlement:chat", used=75.0, reserved=0.0),
            Complete("r1", output=1),
            QuotaState("entitlement:chat", used=75.0, reserved=0.0),
        ),
        quotas=(("chat", (quota("entitlement:chat", 1000.0),)),),
        quota_lease_s=2.0,
    ),
    *QUEUE_SCENARIOS,
    *TIER_SCENARIOS,
)
