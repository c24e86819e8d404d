"""Serving at a lower tier (issue 24): the spillover class's validation, an entitlement's tiers, and the
ledger's spillover and quota demotion (the conformance scenarios hold both stores to the same)."""

from __future__ import annotations

import pytest

from apps.policy import AdmissionLedger, AdmissionRequest, EntitlementLimits, PolicyConfigError
from apps.policy.quota import QuotaCharge, QuotaClaim


def _limits(name: str = "chat", service_class: str = "guaranteed", **fields: object) -> EntitlementLimits:
    fields.setdefault("queue_max", 0)
    return EntitlementLimits(entitlement_id=name, service_class=service_class, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("own", "spillover"), [("guaranteed", "guaranteed"), ("elastic", "elastic"),
                                                 ("elastic", "dedicated"), ("spot", "preemptible"),
                                                 ("guaranteed", "gold")])
def test_a_spillover_class_must_be_lower_and_known(own: str, spillover: str) -> None:
    with pytest.raises(PolicyConfigError):
        _limits(service_class=own, spillover_class=spillover)


def test_a_tier_has_the_lower_class_and_nothing_of_its_own() -> None:
    limits = _limits(concurrency=4, tokens_per_second=100.0, kv_bytes=1e9, slo_target_ms=250.0,
                     spillover_class="spot")
    tier = limits.tier_limits("spot")
    assert tier.entitlement_id == "chat@spot" and tier.tier_of == "chat"
    assert str(tier.service_class) == "spot" and tier.concurrency == 0 and tier.tokens_per_second is None
    assert tier.own_queue_max == 0 and tier.slo_target_ms == 250.0
    assert limits.tier_limits("spot") is tier  # built once per limits


def test_over_its_concurrency_a_request_spills_over_and_a_full_pool_sends_it_to_its_queue() -> None:
    ledger = AdmissionLedger(concurrency_capacity=3)
    chat = _limits(concurrency=1, queue_max=4, queue_max_wait_ms=1000.0, spillover_class="spot")
    ledger.upsert_entitlement(chat, 0.0)
    served = [ledger.request("chat", AdmissionRequest(f"r{i}", 10, 10), 0.0).decision for i in range(4)]
    assert [d.admitted for d in served] == [True, True, True, False]
    assert [d.served_class for d in served[:3]] == ["", "spot", "spot"]
    assert served[3].own_queue  # no idle room for the tier: the entitlement's own queue
    assert ledger.usage("chat", 0.0).in_flight == 1 and ledger.usage("chat@spot", 0.0).in_flight == 2
    # the tier's entitlement is no entitlement of the pool: no debt, not in the mean SLO
    assert set(ledger.tick(5.0)) == {"chat"}


def test_a_tier_takes_its_own_idle_reservation_never_another() -> None:
    ledger = AdmissionLedger(concurrency_capacity=4)
    rated = _limits("rated", tokens_per_second=1.0, token_bucket_seconds=20.0, concurrency=2,
                    spillover_class="spot")
    other = _limits("other", concurrency=2)
    for limits in (rated, other):
        ledger.upsert_entitlement(limits, 0.0)
    first = ledger.request("rated", AdmissionRequest("a", 10, 10), 0.0).decision
    # the bucket is empty: spilled into rated's own idle slot (1 left), not other's 2
    second = ledger.request("rated", AdmissionRequest("b", 10, 10), 0.0).decision
    third = ledger.request("rated", AdmissionRequest("c", 10, 10), 0.0).decision
    assert first.admitted and first.served_class == ""
    assert second.admitted and second.served_class == "spot"
    assert not third.admitted and third.reason == "rate_limit_exceeded"


def test_a_used_up_quota_that_says_spot_demotes_and_one_that_says_reject_refuses() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    ledger.upsert_entitlement(_limits(concurrency=8), 0.0)

    def claim(rid: str, *charges: QuotaCharge) -> QuotaClaim:
        return QuotaClaim(rid, 10, 10, charges, 0.0, scope="t")

    spot = QuotaCharge("entitlement:chat", 20.0, "w", 3600.0, on_exceeded="spot")
    wall = QuotaCharge("tenant:t", 70.0, "w", 3600.0)
    results = [ledger.request("chat", AdmissionRequest(f"r{i}", 10, 10), 0.0, quota=claim(f"r{i}", spot, wall))
               for i in range(4)]
    served = [r.decision.served_class if r.decision.admitted else r.decision.reason for r in results]
    assert served == ["", "spot", "spot", "quota_exceeded"]
    # the demoted requests are charged to the tenant's quota only, and say the used-up one's standing
    assert ledger.quotas.standing(spot).reserved == 20.0 and ledger.quotas.standing(wall).reserved == 60.0
    assert results[1].quota is not None and results[1].quota.standing is not None
    assert results[1].quota.standing.charge.key == "entitlement:chat"
