"""Token bucket, SLO tiers, saturation and the BLIS admission policies of seed 004."""

from __future__ import annotations

import math

import pytest

from apps.policy import (
    DEFAULT_SLO_PRIORITIES,
    AdmissionStage,
    BlisRequest,
    ClusterView,
    GaieLegacy,
    InstanceSnapshot,
    PolicyConfigError,
    TenantBudgets,
    TierShed,
    TokenBucket,
    is_sheddable,
    make_admission_policy,
    pool_saturation,
    slo_priority,
)

# -- token bucket ------------------------------------------------------------------------------


def test_seed_004_sizing_example_burst_then_sustained_rate() -> None:
    """capacity 10000, refill 1000/s, 512-token requests: a burst of 19, then ~1.95 req/s."""
    bucket = TokenBucket(capacity=10_000, refill_rate=1_000)
    burst = sum(bucket.try_consume(512, now=0.0) for _ in range(25))
    assert burst == 19  # 10000 / 512 = 19.5
    # 10 requests/s offered for 100 s: 272 tokens left + 100 s * 1000 tokens/s = 100272 -> 195 requests.
    sustained = sum(bucket.try_consume(512, now=0.1 * step) for step in range(1, 1001))
    assert sustained == 195
    assert sustained / 100 == pytest.approx(1000 / 512, abs=0.01)


def test_bucket_starts_full_is_capped_and_refills_continuously() -> None:
    bucket = TokenBucket(capacity=100, refill_rate=10)
    assert bucket.level(now=5.0) == 100  # starts full
    assert bucket.try_consume(100, now=5.0)
    assert not bucket.try_consume(1, now=5.0)
    assert bucket.level(now=5.25) == pytest.approx(2.5)  # continuous, not per whole second
    assert bucket.level(now=1_000.0) == 100  # never above capacity after a long idle
    assert bucket.try_consume(100, now=1_000.0)  # current >= cost admits exactly
    assert bucket.seconds_until(30, now=1_000.0) == pytest.approx(3.0)
    assert bucket.seconds_until(101, now=1_000.0) == math.inf
    assert bucket.refund(500, now=1_000.0) == 100  # refunds are capped too


def test_bucket_does_not_refill_on_a_clock_that_goes_back() -> None:
    bucket = TokenBucket(capacity=10, refill_rate=1)
    assert bucket.try_consume(10, now=10.0)
    assert bucket.level(now=5.0) == 0
    assert bucket.level(now=11.0) == pytest.approx(1.0)


@pytest.mark.parametrize(("capacity", "rate"), [(0, 1), (-5, 1), (math.nan, 1), (10, -1), (10, math.nan)])
def test_bucket_rejects_invalid_parameters(capacity: float, rate: float) -> None:
    with pytest.raises(PolicyConfigError):
        TokenBucket(capacity, rate)


def test_bucket_rejects_negative_cost() -> None:
    with pytest.raises(ValueError, match="cost"):
        TokenBucket(10, 1).try_consume(-1, now=0)


# -- SLO tiers ---------------------------------------------------------------------------------


def test_default_slo_priorities() -> None:
    assert dict(DEFAULT_SLO_PRIORITIES) == {
        "critical": 4, "standard": 3, "batch": -1, "sheddable": -2, "background": -3
    }
    assert slo_priority("") == 3 and slo_priority(None) == 3 and slo_priority("gold") == 3
    assert slo_priority("BATCH") == -1
    assert [is_sheddable(p) for p in (4, 3, 0, -1, -3)] == [False, False, False, True, True]


def test_slo_overrides_merge_on_defaults() -> None:
    overrides = {"batch": 0, "critical": 10}
    assert slo_priority("batch", overrides) == 0
    assert not is_sheddable(slo_priority("batch", overrides))
    assert slo_priority("critical", overrides) == 10
    assert slo_priority("sheddable", overrides) == -2  # unspecified classes keep their defaults
    with pytest.raises(PolicyConfigError):
        slo_priority("batch", {"batch": 1.5})  # type: ignore[dict-item]


# -- saturation --------------------------------------------------------------------------------


def test_pool_saturation_formula() -> None:
    snapshots = [InstanceSnapshot(queue_depth=10, kv_utilization=0.4), InstanceSnapshot(0, 0.4)]
    # max(10/5, 0.4/0.8) = 2.0 and max(0, 0.5) = 0.5 -> mean 1.25
    assert pool_saturation(snapshots) == pytest.approx(1.25)
    assert pool_saturation(snapshots, qd_threshold=20, kv_threshold=1.0) == pytest.approx(0.45)


def test_no_instances_or_stale_metrics_count_as_saturated() -> None:
    assert pool_saturation([]) == 1.0
    fresh = InstanceSnapshot(0, 0.0, updated_at=9.9)
    stale = InstanceSnapshot(0, 0.0, updated_at=9.0)
    assert pool_saturation([fresh, stale], now=10.0) == pytest.approx(0.5)
    assert pool_saturation([fresh, stale], now=10.0, staleness_s=5.0) == 0.0


@pytest.mark.parametrize(("qd", "kv"), [(0, 0.8), (-1, 0.8), (5, 0), (5, 1.01), (math.nan, 0.8), (5, math.nan)])
def test_saturation_rejects_invalid_thresholds(qd: float, kv: float) -> None:
    with pytest.raises(PolicyConfigError):
        pool_saturation([InstanceSnapshot(1, 0.1)], qd_threshold=qd, kv_threshold=kv)


# -- BLIS admission policies -------------------------------------------------------------------

IDLE = ClusterView(instances=(InstanceSnapshot(0, 0.0),), now=0.0)
BUSY = ClusterView(instances=(InstanceSnapshot(queue_depth=3, kv_utilization=0.1, batch_size=4),), now=0.0)
SATURATED = ClusterView(instances=(InstanceSnapshot(queue_depth=5, kv_utilization=0.1),), now=0.0)


def test_always_admit_and_reject_all() -> None:
    request = BlisRequest(input_tokens=10, slo_class="critical")
    assert make_admission_policy("always-admit").admit(request, SATURATED).admitted
    decision = make_admission_policy("reject-all").admit(request, IDLE)
    assert not decision.admitted and decision.reason == "reject-all"


def test_token_bucket_policy_costs_input_tokens() -> None:
    policy = make_admission_policy("token-bucket", token_bucket_capacity=1000, token_bucket_refill_rate=100)
    assert policy.admit(BlisRequest(input_tokens=600), IDLE).admitted
    rejected = policy.admit(BlisRequest(input_tokens=600), IDLE)
    assert not rejected.admitted and rejected.reason == "insufficient tokens"
    assert policy.admit(BlisRequest(input_tokens=600), ClusterView(IDLE.instances, now=2.0)).admitted


def test_tier_shed_sheds_below_min_priority_only_strictly_above_threshold() -> None:
    policy = TierShed(threshold=7, min_priority=3)
    batch, standard = BlisRequest(1, "batch"), BlisRequest(1, "standard")
    at_threshold = ClusterView((InstanceSnapshot(queue_depth=3, kv_utilization=0, batch_size=4),))
    above = ClusterView((InstanceSnapshot(0, 0), InstanceSnapshot(queue_depth=4, kv_utilization=0, batch_size=4)))
    assert policy.admit(batch, at_threshold).admitted  # load 7 is not above 7
    assert not policy.admit(batch, above).admitted
    assert policy.admit(standard, above).admitted
    assert TierShed(threshold=0, min_priority=-3).admit(BlisRequest(1, "background"), above).admitted
    assert not TierShed(threshold=0, min_priority=0).admit(BlisRequest(1, "batch"), BUSY).admitted
    assert TierShed(threshold=0, min_priority=0).admit(BlisRequest(1, "batch"), IDLE).admitted


def test_gaie_legacy_sheds_only_sheddable_when_saturated() -> None:
    policy = GaieLegacy()
    assert policy.admit(BlisRequest(1, "batch"), IDLE).admitted
    assert not policy.admit(BlisRequest(1, "batch"), SATURATED).admitted  # 5/5 = 1.0 >= 1.0
    assert policy.admit(BlisRequest(1, "critical"), SATURATED).admitted
    assert policy.admit(BlisRequest(1, "standard"), ClusterView(())).admitted
    assert not policy.admit(BlisRequest(1, "background"), ClusterView(())).admitted  # empty = saturated
    promoted = GaieLegacy(slo_priorities={"batch": 0})
    assert promoted.admit(BlisRequest(1, "batch"), SATURATED).admitted


def test_gaie_legacy_treats_stale_instances_as_saturated() -> None:
    policy = GaieLegacy(staleness_s=0.2)
    stale = ClusterView((InstanceSnapshot(0, 0.0, updated_at=0.0),), now=1.0)
    assert not policy.admit(BlisRequest(1, "sheddable"), stale).admitted


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("token-bucket", {"token_bucket_capacity": 0}),
        ("token-bucket", {"token_bucket_capacity": math.nan}),
        ("token-bucket", {"token_bucket_refill_rate": -1}),
        ("gaie-legacy", {"gaie_kv_threshold": 0}),
        ("gaie-legacy", {"gaie_kv_threshold": 1.5}),
        ("gaie-legacy", {"gaie_qd_threshold": 0}),
        ("tier-shed", {"tier_shed_threshold": -1}),
        ("tier-shed", {"tier_shed_min_priority": "high"}),
        ("tier-shed", {"no_such_field": 1}),
        ("fastest-first", {}),
    ],
)
def test_invalid_policy_parameters_raise_clear_errors(name: str, params: dict[str, object]) -> None:
    with pytest.raises(PolicyConfigError):
        make_admission_policy(name, **params)


def test_tenant_budget_sheds_only_sheddable_and_stage_conserves() -> None:
    stage = AdmissionStage(make_admission_policy("always-admit"), TenantBudgets({"acme": 2}))
    outcomes = [
        stage.admit(BlisRequest(1, slo, "acme"), IDLE, tenant_usage=usage).admitted
        for slo, usage in [("batch", 1), ("batch", 2), ("critical", 5), ("standard", 9), ("background", 3)]
    ]
    assert outcomes == [True, False, True, True, False]
    assert stage.admit(BlisRequest(1, "batch", "other"), IDLE, tenant_usage=100).admitted  # no budget
    assert stage.offered == 6 == stage.admitted + stage.rejected
    assert dict(stage.shed_by_tier) == {"batch": 1, "background": 1}
