"""The ordered admission checks (seed 000, 4.3) and the ledger that applies them."""

from __future__ import annotations

import math
import random

import pytest

from apps.policy import (
    AdmissionLedger,
    AdmissionRequest,
    EntitlementLimits,
    EntitlementUsage,
    PolicyConfigError,
    PoolUsage,
    admit,
)

POOL = PoolUsage(concurrency_capacity=16)


def limits(**overrides: object) -> EntitlementLimits:
    values: dict[str, object] = {"entitlement_id": "e1", "service_class": "elastic", "concurrency": 4}
    values.update(overrides)
    return EntitlementLimits(**values)  # type: ignore[arg-type]


def request(n_in: int = 10, max_tokens: int | None = 10, request_id: str = "r") -> AdmissionRequest:
    return AdmissionRequest(request_id=request_id, input_tokens=n_in, max_tokens=max_tokens)


# -- the pure checks ---------------------------------------------------------------------------


def test_admits_within_every_limit() -> None:
    decision = admit(limits(tokens_per_second=100), EntitlementUsage(tokens_available=6000), POOL, request())
    assert decision.admitted and decision.reason == "admitted"
    assert decision.token_cost == 20 and decision.max_tokens == 10
    assert decision.priority == pytest.approx(100 / 3)


@pytest.mark.parametrize("state", ["pending", "degraded", "expired"])
def test_check_1_entitlement_must_be_bound_and_short_circuits(state: str) -> None:
    # The request is malformed too, but check 1 comes first.
    decision = admit(limits(state=state), EntitlementUsage(), POOL, request(max_tokens=0))
    assert not decision.admitted and decision.reason == "entitlement_not_bound" and decision.check == 1
    assert decision.retryable == (state != "expired")
    assert decision.retry_after_s > 0


def test_check_2_default_max_tokens_applied_and_clipped_to_context() -> None:
    small = admit(limits(default_max_tokens=300, context_window=1000), EntitlementUsage(), POOL, request(100, None))
    assert small.admitted and small.max_tokens == 300 and small.token_cost == 400
    clipped = admit(limits(default_max_tokens=300, context_window=1000), EntitlementUsage(), POOL, request(900, None))
    assert clipped.admitted and clipped.max_tokens == 100


@pytest.mark.parametrize(
    ("n_in", "max_tokens", "reason"),
    [
        (1000, None, "context_length_exceeded"),
        (900, 101, "context_length_exceeded"),
        (10, 0, "max_tokens_invalid"),
        (10, -5, "max_tokens_invalid"),
        (-1, 10, "invalid_request"),
    ],
)
def test_check_2_rejects_overflow_and_invalid_values(n_in: int, max_tokens: int | None, reason: str) -> None:
    decision = admit(limits(context_window=1000), EntitlementUsage(), POOL, request(n_in, max_tokens))
    assert not decision.admitted and decision.reason == reason and decision.check == 2
    assert not decision.retryable


@pytest.mark.parametrize("slo", [0.0, -5.0, math.nan, math.inf])
def test_check_2_rejects_an_invalid_per_request_slo(slo: float) -> None:
    bad = AdmissionRequest("r", 10, 10, slo_target_ms=slo)
    decision = admit(limits(), EntitlementUsage(), POOL, bad)
    assert decision.reason == "invalid_request" and not decision.retryable


def test_release_with_a_bogus_token_count_does_not_crash() -> None:
    ledger = AdmissionLedger(concurrency_capacity=4)
    ledger.upsert_entitlement(limits(tokens_per_second=1, token_bucket_seconds=100), now=0)
    for index, count in enumerate((math.nan, -3, 10**9)):
        request_id = f"r{index}"
        assert ledger.request("e1", request(request_id=request_id), now=0).decision.admitted
        assert ledger.release(request_id, now=0, output_tokens=count).outcome == "completed"  # type: ignore[arg-type]
    # NaN refunds nothing, -3 refunds all 10, 10**9 is clamped to max_tokens and refunds nothing.
    assert ledger.usage("e1", now=0).tokens_available == pytest.approx(100 - 3 * 20 + 10)
    ledger.check_invariants()


def test_check_3_guaranteed_never_borrows() -> None:
    decision = admit(limits(service_class="guaranteed"), EntitlementUsage(in_flight=4, running=4), POOL, request())
    assert decision.reason == "concurrency_limit_exceeded" and decision.check == 3


def test_check_3_bursting_classes_borrow_idle_slots_up_to_their_ceiling() -> None:
    pool = PoolUsage(concurrency_capacity=16, running=4)
    usage = EntitlementUsage(in_flight=4, running=4)
    borrowed = admit(limits(burst_concurrency=6), usage, pool, request())
    assert borrowed.admitted and borrowed.borrowed
    at_ceiling = admit(limits(burst_concurrency=6), EntitlementUsage(in_flight=6, running=6), pool, request())
    assert at_ceiling.reason == "concurrency_limit_exceeded"


def test_check_3_idle_reserved_slots_are_not_borrowable() -> None:
    # 10 of 16 slots are reserved by an idle guaranteed entitlement; 6 are running.
    pool = PoolUsage(concurrency_capacity=16, running=6, reserved_idle_concurrency=10)
    decision = admit(limits(), EntitlementUsage(in_flight=4, running=4), pool, request())
    assert decision.reason == "concurrency_limit_exceeded"
    # The guaranteed owner itself, within r_e, can use its own reservation.
    owner = limits(entitlement_id="g", service_class="guaranteed", concurrency=10)
    assert admit(owner, EntitlementUsage(), pool, request()).admitted


def test_a_request_within_its_reservation_claims_it_while_others_idle_reservations_are_filled() -> None:
    # 16 slots: this guaranteed entitlement runs 5 of its 6, spot admitted before another guaranteed one was
    # bound still runs 10, so that one's 6 idle slots and this one's 1 exceed the 1 free slot.
    owner = limits(entitlement_id="g", service_class="guaranteed", concurrency=6)
    pool = PoolUsage(concurrency_capacity=16, running=15, reserved_idle_concurrency=7, admission_threshold=1.0)
    assert admit(owner, EntitlementUsage(in_flight=5, running=5), pool, request()).admitted
    # Nothing of its own idle: the others' idle reservations stay off limits, and spot is refused outright.
    full_owner = admit(owner, EntitlementUsage(in_flight=6, running=6), pool._replace(reserved_idle_concurrency=6),
                       request())
    assert full_owner.reason == "concurrency_limit_exceeded"
    assert admit(limits(service_class="spot"), EntitlementUsage(), pool, request()).reason == "pool_contended"
    # The same for KV bytes: 40 bytes of its own idle reservation, 50 free, another's 100 idle.
    kv = {"kv_bytes": 100.0, "kv_bytes_per_token": 2.0}  # a 20-token request needs 40 bytes
    kv_owner = limits(service_class="guaranteed", concurrency=None, **kv)
    kv_pool = PoolUsage(concurrency_capacity=16, kv_capacity=1000.0, kv_bytes_running=950.0, reserved_idle_kv=140.0,
                        admission_threshold=1.0)
    assert admit(kv_owner, EntitlementUsage(kv_bytes_in_flight=60.0, kv_bytes_running=60.0), kv_pool,
                 request()).admitted
    short = admit(kv_owner, EntitlementUsage(kv_bytes_in_flight=60.0, kv_bytes_running=60.0),
                  kv_pool._replace(kv_bytes_running=970.0), request())
    assert short.queued and not short.admitted  # 30 bytes free: not room enough for 40, even of its own


def test_check_4_token_bucket_with_retry_after() -> None:
    decision = admit(limits(tokens_per_second=10), EntitlementUsage(tokens_available=5), POOL, request())
    assert decision.reason == "rate_limit_exceeded" and decision.check == 4
    assert decision.retry_after_s == pytest.approx(1.5)  # (20 - 5) / 10
    never = admit(limits(tokens_per_second=0.1, token_bucket_seconds=10), EntitlementUsage(tokens_available=1),
                  POOL, request())
    assert never.reason == "rate_limit_exceeded" and not never.retryable  # cost 20 > capacity 1


def test_check_4_kv_bytes_with_borrowing() -> None:
    kv = {"kv_bytes": 100.0, "kv_bytes_per_token": 2.0}  # a 20-token request needs 40 bytes
    within = admit(limits(**kv), EntitlementUsage(kv_bytes_in_flight=60), POOL, request())
    assert within.admitted and within.kv_bytes == 40
    pool = PoolUsage(concurrency_capacity=16, kv_capacity=1000, kv_bytes_running=100)
    borrow = admit(limits(**kv), EntitlementUsage(kv_bytes_in_flight=80), pool, request())
    assert borrow.admitted and borrow.borrowed
    guaranteed = admit(limits(service_class="guaranteed", **kv), EntitlementUsage(kv_bytes_in_flight=80), pool, request())
    assert guaranteed.reason == "kv_cache_limit_exceeded"
    ceiling = admit(limits(burst_kv_bytes=110, **kv), EntitlementUsage(kv_bytes_in_flight=80), pool, request())
    assert ceiling.reason == "kv_cache_limit_exceeded" and ceiling.retryable
    too_big = admit(limits(kv_bytes=30.0, burst_kv_bytes=35.0, kv_bytes_per_token=2.0), EntitlementUsage(), pool,
                    request())
    assert too_big.reason == "kv_cache_limit_exceeded" and not too_big.retryable


def test_check_5_pool_contention_threshold() -> None:
    full = PoolUsage(concurrency_capacity=4, running=4, admission_threshold=40.0, mean_slo_ms=1000)
    low = admit(limits(slo_target_ms=2000), EntitlementUsage(), full, request())  # 100 / 5 = 20
    assert low.reason == "pool_contended" and low.check == 5 and low.retry_after_s > 0
    equal = admit(limits(slo_target_ms=1500), EntitlementUsage(), full, request())  # 100 / 4 = 25
    assert admit(limits(slo_target_ms=1500), EntitlementUsage(), PoolUsage(4, running=4, admission_threshold=25.0,
                 mean_slo_ms=1000), request()).reason == "pool_contended"  # must exceed, not equal
    assert equal.reason == "pool_contended"
    high = admit(limits(slo_target_ms=500), EntitlementUsage(), full, request())  # 100 / 2 = 50
    assert high.queued and not high.admitted and high.reason == "queued" and not high.evict
    evicting = admit(limits(slo_target_ms=500), EntitlementUsage(), PoolUsage(4, running=4, admission_threshold=1.0,
                     mean_slo_ms=1000, lowest_evictable_priority=0.03, evictable_running=1), request())
    assert evicting.queued and evicting.evict
    # Evicting cannot help when the only room it would free is another entitlement's reservation.
    reserved = admit(limits(slo_target_ms=500), EntitlementUsage(), PoolUsage(4, running=4, admission_threshold=1.0,
                     mean_slo_ms=1000, lowest_evictable_priority=0.03, evictable_running=1,
                     reserved_idle_concurrency=1), request())
    assert reserved.queued and not reserved.evict
    saturated = admit(limits(slo_target_ms=2000), EntitlementUsage(),
                      PoolUsage(16, saturation=1.0, admission_threshold=40.0, mean_slo_ms=1000), request())
    assert saturated.reason == "pool_contended"


@pytest.mark.parametrize("service_class", ["guaranteed", "dedicated"])
def test_saturation_alone_never_turns_away_a_reserved_request_within_its_baseline(service_class: str) -> None:
    saturated_pool = PoolUsage(16, running=8, saturation=1.5, admission_threshold=10_000.0, mean_slo_ms=1000)
    within = admit(limits(service_class=service_class), EntitlementUsage(in_flight=3, running=3), saturated_pool,
                   request())
    assert within.admitted and not within.borrowed
    # Beyond its baseline a dedicated request borrows like anyone else, and saturation applies again.
    if service_class == "dedicated":
        beyond = admit(limits(service_class=service_class), EntitlementUsage(in_flight=4, running=4),
                       saturated_pool, request())
        assert beyond.reason == "pool_contended"
    # A really full pool still contends, reserved or not.
    full = PoolUsage(16, running=16, admission_threshold=10_000.0, mean_slo_ms=1000)
    assert admit(limits(service_class=service_class), EntitlementUsage(in_flight=3, running=3), full,
                 request()).reason in {"pool_contended", "queued"}


def test_request_slo_hints_only_relax_priority_and_tier() -> None:
    base = admit(limits(), EntitlementUsage(), POOL, request())
    tight = admit(limits(), EntitlementUsage(), POOL,
                  AdmissionRequest("r", 10, 10, slo_target_ms=100, slo_tier="critical"))
    loose = admit(limits(), EntitlementUsage(), POOL,
                  AdmissionRequest("r", 10, 10, slo_target_ms=5000, slo_tier="batch"))
    assert tight.priority == base.priority and tight.slo_tier == base.slo_tier == "standard"
    assert loose.priority < base.priority and loose.slo_tier == "batch"
    assert admit(limits(slo_tier="batch"), EntitlementUsage(), POOL, request()).slo_tier == "batch"


@pytest.mark.parametrize(
    "bad",
    [
        {"concurrency": -1},
        {"tokens_per_second": math.nan},
        {"slo_target_ms": 0},
        {"context_window": 0},
        {"service_class": "gold"},
        {"state": "lost"},
        {"entitlement_id": ""},
        {"concurrency": 4, "burst_concurrency": 2},
    ],
)
def test_limits_validation(bad: dict[str, object]) -> None:
    with pytest.raises(PolicyConfigError):
        limits(**bad)


# -- the ledger --------------------------------------------------------------------------------


def test_ledger_charges_refunds_and_conserves() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    ledger.upsert_entitlement(limits(tokens_per_second=10, token_bucket_seconds=10, queue_max=0), now=0)  # bucket 100
    first = ledger.request("e1", request(n_in=20, max_tokens=60, request_id="a"), now=0)
    assert first.decision.admitted and first.started == ("a",)
    assert ledger.usage("e1", now=0).tokens_available == pytest.approx(20)
    rejected = ledger.request("e1", request(n_in=20, max_tokens=60, request_id="b"), now=0)
    assert rejected.decision.reason == "rate_limit_exceeded"
    assert rejected.decision.retry_after_s == pytest.approx(6.0)
    done = ledger.release("a", now=1.0, output_tokens=10)
    assert done.outcome == "completed" and done.refunded_tokens == 50
    assert ledger.usage("e1", now=1.0).tokens_available == pytest.approx(20 + 10 + 50)
    assert ledger.release("a", now=1.0).outcome == "unknown"  # duplicate callbacks are harmless
    ledger.check_invariants()
    assert ledger.counters.offered == 2 and ledger.counters.completed == 1 and ledger.counters.rejected == 1


def test_ledger_unknown_entitlement_and_duplicate_ids_are_rejected_not_crashed() -> None:
    ledger = AdmissionLedger(concurrency_capacity=2)
    assert ledger.request("nope", request(), now=0).decision.reason == "entitlement_not_bound"
    ledger.upsert_entitlement(limits(), now=0)
    assert ledger.request("e1", request(request_id="x"), now=0).decision.admitted
    assert ledger.request("e1", request(request_id="x"), now=0).decision.reason == "invalid_request"
    ledger.check_invariants()


def test_experiment_1_guaranteed_protected_spot_squeezed() -> None:
    """guaranteed-a (6) + spot-b (10) fill 16 slots; guaranteed-c (6) joins and takes slots from spot."""
    ledger = AdmissionLedger(concurrency_capacity=16, mean_slo_ms=1000)
    ledger.upsert_entitlement(limits(entitlement_id="a", service_class="guaranteed", concurrency=6), now=0)
    ledger.upsert_entitlement(limits(entitlement_id="b", service_class="spot", concurrency=10), now=0)
    for i in range(6):
        assert ledger.request("a", request(request_id=f"a{i}"), now=0).decision.admitted
    for i in range(10):
        assert ledger.request("b", request(request_id=f"b{i}"), now=0).decision.admitted
    ledger.upsert_entitlement(limits(entitlement_id="c", service_class="guaranteed", concurrency=6), now=1)
    waits = [ledger.request("c", request(request_id=f"c{i}"), now=1) for i in range(6)]
    assert all(result.decision.queued for result in waits)
    # Spot arrivals are at the threshold (the minimum admitted priority is spot's own): rejected.
    ledger.release("b0", now=2)  # the free slot goes to guaranteed-c, not spot
    assert ledger.request_state("c0") == "running"
    spot_retry = ledger.request("b", request(request_id="b-new"), now=2)
    assert spot_retry.decision.reason == "concurrency_limit_exceeded" or spot_retry.decision.reason == "pool_contended"
    for i in range(1, 10):
        ledger.release(f"b{i}", now=3)
    running_by = {"a": 0, "b": 0, "c": 0}
    for rid in ledger.in_flight_ids():
        if ledger.request_state(rid) == "running":
            running_by[rid[0]] += 1
    assert running_by == {"a": 6, "b": 0, "c": 6}
    # Guaranteed-c leaves; spot recovers its share immediately.
    for i in range(6):
        ledger.release(f"c{i}", now=4)
    ledger.upsert_entitlement(limits(entitlement_id="c", service_class="guaranteed", concurrency=6,
                                     state="expired"), now=4)
    ledger.remove_entitlement("c")
    assert all(ledger.request("b", request(request_id=f"b2-{i}"), now=5).decision.admitted for i in range(10))
    ledger.check_invariants()


def test_preemptible_work_is_evicted_lowest_priority_newest_first() -> None:
    ledger = AdmissionLedger(concurrency_capacity=3, mean_slo_ms=1000)
    ledger.upsert_entitlement(limits(entitlement_id="p", service_class="preemptible", concurrency=3), now=0)
    for i, now in enumerate((0.0, 1.0, 2.0)):
        assert ledger.request("p", request(request_id=f"p{i}"), now=now).decision.admitted
    # A dedicated entitlement binds to the full pool; its reservation cannot be borrowed from now on.
    ledger.upsert_entitlement(limits(entitlement_id="d", service_class="dedicated", concurrency=2), now=2.5)
    result = ledger.request("d", request(request_id="d0"), now=3)
    assert result.decision.queued and result.decision.evict
    assert result.evicted == ("p2",)  # newest dispatch among equal priorities
    assert result.started == ("d0",)
    assert ledger.counters.evicted == 1
    ledger.check_invariants()


def test_waiting_requests_start_in_priority_order_and_expire() -> None:
    ledger = AdmissionLedger(concurrency_capacity=1, mean_slo_ms=1000)
    ledger.upsert_entitlement(limits(entitlement_id="slow", slo_target_ms=30_000, tokens_per_second=100), now=0)
    ledger.upsert_entitlement(limits(entitlement_id="fast", slo_target_ms=100), now=0)
    ledger.upsert_entitlement(
        limits(entitlement_id="mid", slo_target_ms=1000, tokens_per_second=1, token_bucket_seconds=1000), now=0
    )
    assert ledger.request("slow", request(request_id="s"), now=0).decision.admitted
    assert ledger.request("mid", request(request_id="m"), now=0.1).decision.queued
    assert ledger.request("fast", request(request_id="f"), now=0.2).decision.queued
    assert ledger.release("s", now=0.5).started == ("f",)  # higher priority first
    level_before = ledger.usage("mid", now=2.0).tokens_available
    assert ledger.expire_waiting(now=2.0) == ["m"]
    assert level_before == pytest.approx(1000 - 20 + 1.9)
    # The whole charge comes back: the bucket is as full as if the request had never been offered.
    assert ledger.usage("mid", now=2.0).tokens_available == pytest.approx(1000)
    assert ledger.counters.expired == 1
    ledger.check_invariants()


def test_capacity_shrink_waits_for_releases() -> None:
    ledger = AdmissionLedger(concurrency_capacity=4, mean_slo_ms=1000)
    ledger.upsert_entitlement(limits(concurrency=4, queue_max=0), now=0)
    for i in range(4):
        assert ledger.request("e1", request(request_id=f"r{i}"), now=0).decision.admitted
    ledger.set_capacity(2, now=1)
    assert ledger.running == 4  # nothing cancelled
    assert ledger.request("e1", request(request_id="late"), now=1).decision.reason == "concurrency_limit_exceeded"
    ledger.release("r0", now=2)
    ledger.release("r1", now=2)
    ledger.release("r2", now=2)
    assert ledger.running == 1
    assert ledger.request("e1", request(request_id="n1"), now=3).decision.admitted
    follow = ledger.request("e1", request(request_id="n2"), now=3)
    # The pool of 2 is full of requests of the same priority: not above the threshold.
    assert follow.decision.reason == "pool_contended"
    ledger.check_invariants()


def test_tick_accrues_debt_for_an_underserved_elastic_and_not_for_spot() -> None:
    ledger = AdmissionLedger(concurrency_capacity=2, mean_slo_ms=1000)
    ledger.upsert_entitlement(limits(entitlement_id="el", concurrency=5), now=0)
    ledger.upsert_entitlement(limits(entitlement_id="sp", service_class="spot", concurrency=5), now=0)
    for i in range(2):
        ledger.request("el", request(request_id=f"e{i}"), now=0)
    for i in range(3):
        ledger.request("el", request(request_id=f"x{i}"), now=0.5)  # queued: pool is full
        ledger.request("sp", request(request_id=f"s{i}"), now=0.5)
    dynamics = ledger.tick(now=1.0)
    assert dynamics["el"].debt > 0
    assert dynamics["sp"].debt == 0
    before = ledger.pool_usage()
    assert before.admission_threshold == pytest.approx(100 / 3)
    ledger.check_invariants()


def test_tick_of_an_idle_entitlement_is_what_the_formulas_give() -> None:
    """An entitlement at rest skips the computation (the fast path of big pools); its reading must be the one
    `window_reading` computes, and one that had traffic must keep decaying (not be taken for idle)."""
    from apps.policy.window import ServiceWindow, window_reading

    ledger = AdmissionLedger(concurrency_capacity=1, mean_slo_ms=1000)
    ledger.upsert_entitlement(limits(entitlement_id="idle", concurrency=2), now=0)
    ledger.upsert_entitlement(limits(entitlement_id="busy", concurrency=3), now=0)
    ledger.request("busy", request(request_id="b1"), now=0)
    ledger.request("busy", request(request_id="b2"), now=0)  # waits: the pool is full, so busy is owed
    first = ledger.tick_readings(1.0)
    assert first is not None
    computed = window_reading(ServiceWindow(0.0).figures(), limits(entitlement_id="idle", concurrency=2),
                              first["idle"].dynamics, 1.0, expected_service_s=ledger.config.expected_service_s,
                              config=ledger.dynamics_config)
    assert first["idle"] == computed
    assert first["busy"].dynamics.debt > 0
    ledger.release("b1", now=1.2)
    ledger.release("b2", now=1.4)
    second = ledger.tick_readings(2.0)
    assert second is not None
    assert 0 < second["busy"].dynamics.debt < first["busy"].dynamics.debt  # decaying, not taken for idle
    assert second["idle"] == first["idle"]


def test_tick_changes_are_the_readings_of_the_entitlements_not_at_rest() -> None:
    """What the stores' tick returns: the full readings less those at rest (`RESTING_READING`), which it never
    builds (a pool of 10,000 entitlements with a few busy costs a few readings a second)."""
    from apps.policy.window import RESTING_READING

    def ledger_with_traffic() -> AdmissionLedger:
        ledger = AdmissionLedger(concurrency_capacity=1, mean_slo_ms=1000)
        for name in ("idle-a", "idle-b", "busy"):
            ledger.upsert_entitlement(limits(entitlement_id=name, concurrency=3), now=0)
        ledger.request("busy", request(request_id="b1"), now=0)
        ledger.request("busy", request(request_id="b2"), now=0)
        return ledger

    full, changes = ledger_with_traffic().tick_readings(1.0), ledger_with_traffic().tick_changes(1.0)
    assert full is not None and changes is not None
    assert set(changes) == {"busy"} and changes["busy"] == full["busy"]
    assert {name for name, reading in full.items() if reading is RESTING_READING} == {"idle-a", "idle-b"}
    assert ledger_with_traffic().tick_changes(0.0) is None  # a window too short to measure stays open


def test_retry_jitter_is_seeded() -> None:
    def retry_after(seed: int) -> float:
        ledger = AdmissionLedger(concurrency_capacity=1, rng=random.Random(seed), retry_jitter=0.5)
        ledger.upsert_entitlement(limits(concurrency=0, service_class="guaranteed", queue_max=0), now=0)
        return ledger.request("e1", request(), now=0).decision.retry_after_s

    assert retry_after(7) == retry_after(7)
    assert 1.0 <= retry_after(7) <= 1.5
    assert retry_after(7) != retry_after(8)


def test_ledger_rejects_invalid_capacity() -> None:
    with pytest.raises(PolicyConfigError):
        AdmissionLedger(concurrency_capacity=-1)
    with pytest.raises(PolicyConfigError):
        AdmissionLedger(concurrency_capacity=4, kv_capacity=math.nan)


def test_preemptible_may_use_idle_reservations_and_is_evicted_when_the_owner_returns() -> None:
    ledger = AdmissionLedger(concurrency_capacity=4, mean_slo_ms=1000)
    ledger.upsert_entitlement(limits(entitlement_id="g", service_class="guaranteed", concurrency=3), now=0)
    ledger.upsert_entitlement(limits(entitlement_id="p", service_class="preemptible", concurrency=4), now=0)
    ledger.upsert_entitlement(limits(entitlement_id="s", service_class="spot", concurrency=4), now=0)
    assert ledger.request("s", request(request_id="s0"), now=0).decision.admitted  # the one unreserved slot
    # Spot must not take the 3 slots reserved by the idle guaranteed entitlement.
    assert ledger.request("s", request(request_id="s1"), now=0).decision.reason == "pool_contended"
    for index in range(3):  # spot could not, but preemptible fills the idle reservation
        assert ledger.request("p", request(request_id=f"p{index}"), now=index).decision.admitted
    returning = ledger.request("g", request(request_id="g0"), now=5)
    assert returning.evicted == ("p2",) and returning.started == ("g0",)
    ledger.check_invariants()


def test_owners_reclaim_reservations_squatted_by_preemptible_work() -> None:
    ledger = AdmissionLedger(concurrency_capacity=10, mean_slo_ms=1000)
    for owner in ("g1", "g2", "g3"):  # 9 of 10 slots reserved, all idle
        ledger.upsert_entitlement(limits(entitlement_id=owner, service_class="guaranteed", concurrency=3), now=0)
    ledger.upsert_entitlement(limits(entitlement_id="p", service_class="preemptible", concurrency=10), now=0)
    ledger.upsert_entitlement(limits(entitlement_id="el", concurrency=2), now=0)
    for index in range(10):
        assert ledger.request("p", request(request_id=f"p{index}"), now=index).decision.admitted
    # The elastic entitlement is entitled to the single unreserved slot: one eviction.
    elastic = ledger.request("el", request(request_id="e0"), now=20)
    assert elastic.evicted == ("p9",) and elastic.started == ("e0",)
    # But not to a second slot: those are reservations, so it waits and evicts nobody.
    second = ledger.request("el", request(request_id="e1"), now=21)
    assert second.decision.queued and second.evicted == () and ledger.request_state("e1") == "waiting"
    for index in range(3):  # every owner gets its reservation back, one eviction per request
        result = ledger.request("g1", request(request_id=f"g1-{index}"), now=22 + index)
        assert len(result.evicted) == 1 and result.started == (f"g1-{index}",)
    ledger.check_invariants()
    assert ledger.pool_usage().evictable_running == 6


def test_lazy_heaps_stay_bounded_while_priorities_churn() -> None:
    ledger = AdmissionLedger(concurrency_capacity=100, mean_slo_ms=1000)
    ledger.upsert_entitlement(limits(entitlement_id="floor", service_class="spot"), now=0)
    ledger.upsert_entitlement(limits(entitlement_id="p", service_class="preemptible", concurrency=1), now=0)
    ledger.upsert_entitlement(limits(), now=0)
    assert ledger.request("floor", request(request_id="long"), now=0).decision.admitted  # holds the minimum
    for index in range(2_000):
        # Each request has a new priority (its own SLO target) and is released at once.
        churn = AdmissionRequest(f"c{index}", 10, 10, slo_target_ms=100.0 + index)
        assert ledger.request("e1", churn, now=index).decision.admitted
        ledger.release(churn.request_id, now=index)
        assert ledger.request("p", request(request_id=f"p{index}"), now=index).decision.admitted
        ledger.release(f"p{index}", now=index)
    assert len(ledger._priority_heap) < 200
    assert len(ledger._evictable_heap) < 200
    assert ledger.admission_threshold() == pytest.approx(1 / 3)
    ledger.check_invariants()
