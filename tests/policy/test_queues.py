"""The entitlement's own queue in `AdmissionLedger`: a request over its own limits waits (holding nothing),
first come first served, until it fits, its wait runs out (queue_timeout) or its client leaves."""

from __future__ import annotations

import math

import pytest

from apps.policy import AdmissionLedger, AdmissionRequest, EntitlementLimits
from apps.policy.errors import PolicyConfigError


def limits(**overrides: object) -> EntitlementLimits:
    values: dict[str, object] = {"entitlement_id": "e1", "service_class": "guaranteed", "concurrency": 2}
    values.update(overrides)
    return EntitlementLimits(**values)  # type: ignore[arg-type]


def offer(ledger: AdmissionLedger, request_id: str, now: float, n_in: int = 10, max_tokens: int = 10,
          entitlement: str = "e1"):
    return ledger.request(entitlement, AdmissionRequest(request_id, n_in, max_tokens), now)


def test_over_its_concurrency_a_request_waits_holding_nothing_and_starts_on_a_release() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    ledger.upsert_entitlement(limits(tokens_per_second=100, token_bucket_seconds=10), now=0)
    for name in ("a", "b"):
        assert offer(ledger, name, 0).decision.admitted
    level = ledger.usage("e1", 0).tokens_available
    waited = offer(ledger, "c", 0.1)
    assert waited.decision.queued and waited.decision.own_queue and waited.started == ()
    usage = ledger.usage("e1", 0.1)
    assert (usage.in_flight, ledger.queued, ledger.waiting) == (2, 1, 0)
    assert usage.tokens_available == pytest.approx(level + 10)  # refilled, nothing charged for the waiter
    # Retry-After from the state: the oldest running request started at 0, expected to take 1 s.
    assert waited.decision.retry_after_s == pytest.approx(0.9)
    ledger.check_invariants()
    assert ledger.release("a", 0.5, output_tokens=10).started == ("c",)
    assert ledger.request_state("c") == "running" and ledger.queued == 0
    ledger.check_invariants()


def test_first_come_first_served_within_the_entitlement() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    ledger.upsert_entitlement(limits(concurrency=1), now=0)
    assert offer(ledger, "a", 0).decision.admitted
    assert offer(ledger, "b", 1).decision.own_queue
    assert offer(ledger, "c", 2).decision.own_queue
    assert ledger.release("a", 3).started == ("b",)
    assert ledger.request_state("c") == "waiting"
    assert ledger.release("b", 3.5).started == ("c",)
    ledger.check_invariants()


def test_a_full_queue_refuses_at_once_and_a_long_wait_times_out() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    ledger.upsert_entitlement(limits(concurrency=1, queue_max=2, queue_max_wait_ms=500), now=0)
    assert offer(ledger, "a", 0).decision.admitted
    assert offer(ledger, "b", 0).decision.own_queue
    assert offer(ledger, "c", 0.2).decision.own_queue
    full = offer(ledger, "d", 0.2)
    assert full.decision.reason == "queue_full" and full.decision.retryable
    assert full.decision.retry_after_s == pytest.approx(0.8)
    assert ledger.next_wake(0.2) == pytest.approx(0.5)
    assert ledger.wake(0.49).expired == ()
    assert ledger.wake(0.5).expired == ("b",)
    assert ledger.wake(0.7).expired == ("c",)
    assert ledger.counters.expired == 2 and ledger.queued == 0
    assert ledger.release("a", 1.0).started == ()
    ledger.check_invariants()


def test_a_bucket_refill_wakes_the_head_at_its_refill_time() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    # 10 tokens/s, a bucket of 100: the first request takes 80, the second needs 80 more (6 s of refill).
    ledger.upsert_entitlement(limits(concurrency=None, tokens_per_second=10, token_bucket_seconds=10,
                                     queue_max_wait_ms=10_000), now=0)
    assert offer(ledger, "a", 0, n_in=40, max_tokens=40).decision.admitted
    waited = offer(ledger, "b", 0, n_in=40, max_tokens=40)
    assert waited.decision.own_queue and waited.decision.retry_after_s == pytest.approx(6.0)
    assert ledger.next_wake(0) == pytest.approx(6.0)
    assert ledger.wake(5.9).started == ()
    assert ledger.wake(6.0).started == ("b",)
    assert ledger.next_wake(6.0) == math.inf
    ledger.check_invariants()


def test_a_client_that_leaves_while_queued_leaves_nothing_behind() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    ledger.upsert_entitlement(limits(concurrency=1, tokens_per_second=100), now=0)
    assert offer(ledger, "a", 0).decision.admitted
    assert offer(ledger, "b", 0).decision.own_queue
    before = ledger.usage("e1", 0)
    assert ledger.release("b", 0.1).outcome == "cancelled"
    after = ledger.usage("e1", 0.1)
    assert (after.in_flight, after.kv_bytes_in_flight, ledger.queued) == (before.in_flight, 0.0, 0)
    assert ledger.release("a", 0.2).started == ()  # nobody left to start
    ledger.check_invariants()
    assert ledger.counters.offered == ledger.counters.completed + ledger.counters.cancelled


def test_spot_and_an_empty_queue_refuse_at_once_with_retry_after_from_the_state() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    ledger.upsert_entitlement(limits(service_class="spot", concurrency=1, burst_concurrency=1), now=0)
    assert offer(ledger, "a", 2.0).decision.admitted
    refused = offer(ledger, "b", 2.25)
    assert refused.decision.reason == "concurrency_limit_exceeded"
    assert refused.decision.retry_after_s == pytest.approx(0.75)  # a started at 2.0, expected to take 1 s


def test_a_queued_head_leaves_for_the_pools_waiting_room_by_its_priority() -> None:
    ledger = AdmissionLedger(concurrency_capacity=2, mean_slo_ms=1000)
    ledger.upsert_entitlement(limits(concurrency=1), now=0)
    ledger.upsert_entitlement(EntitlementLimits("spot", service_class="spot"), now=0)
    assert offer(ledger, "a", 0).decision.admitted
    assert offer(ledger, "s1", 0, entitlement="spot").decision.admitted
    assert offer(ledger, "b", 0).decision.own_queue
    # a's release frees its own slot: b starts in it.
    assert ledger.release("a", 0.5).started == ("b",)
    ledger.check_invariants()


def test_waits_over_ten_minutes_and_negative_queues_are_configuration_errors() -> None:
    with pytest.raises(PolicyConfigError, match="queue_max_wait_ms"):
        limits(queue_max_wait_ms=600_001)
    with pytest.raises(PolicyConfigError, match="queue_max"):
        limits(queue_max=-1)
    assert limits().own_queue_max == 8 and limits(service_class="elastic").own_queue_max == 4
    assert limits(service_class="preemptible").own_queue_max == 0


def test_past_its_expected_end_retry_after_is_the_expected_service_time_not_at_once() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    ledger.upsert_entitlement(limits(service_class="spot", concurrency=1, burst_concurrency=1), now=0)
    assert offer(ledger, "a", 0.0).decision.admitted
    # a has run 5 s against an expected 1 s: nothing in the state says when it ends
    assert offer(ledger, "b", 5.0).decision.retry_after_s == pytest.approx(1.0)
