"""Priority (1), debt (2) and burst (3): the seed's numbers and the documented refinements."""

from __future__ import annotations

import math

import pytest

from apps.policy import (
    Dynamics,
    PolicyConfigError,
    ResourceVector,
    ServiceClass,
    burst_delta,
    debt_update,
    priority_weight,
    service_gap,
    update_dynamics,
)
from apps.policy.classes import CLASS_TRAITS, SloTier, default_slo_tier, effective_slo_tier
from apps.policy.slo import known_slo_tier, merged_priorities, relaxed_slo_tier

EXPERIMENT_2_MEAN_SLO_MS = 15_250.0


def test_class_table_matches_seed_table_1() -> None:
    weights = {cls.value: traits.base_weight for cls, traits in CLASS_TRAITS.items()}
    assert weights == {"dedicated": 1000, "guaranteed": 1000, "elastic": 100, "spot": 1, "preemptible": 0.1}
    assert ServiceClass.DEDICATED.traits.may_burst and not ServiceClass.GUARANTEED.traits.may_burst
    assert ServiceClass.GUARANTEED.traits.reserved and ServiceClass.DEDICATED.traits.reserved
    assert not ServiceClass.ELASTIC.traits.reserved
    assert ServiceClass.PREEMPTIBLE.traits.evictable and not ServiceClass.SPOT.traits.evictable
    assert not ServiceClass.SPOT.traits.accrues_debt and not ServiceClass.PREEMPTIBLE.traits.accrues_debt
    assert ServiceClass.ELASTIC.traits.accrues_debt
    assert [c.value for c in ServiceClass if c.traits.binds_capacity] == ["dedicated", "guaranteed", "elastic"]
    # Seed 002's DRR shares of the dispatch budget.
    assert {cls.value: traits.drr_weight for cls, traits in CLASS_TRAITS.items()} == {
        "dedicated": 8, "guaranteed": 8, "elastic": 4, "spot": 1, "preemptible": 1}


def test_default_slo_tiers_and_overrides() -> None:
    assert [default_slo_tier(c).value for c in ServiceClass] == [
        "critical", "critical", "standard", "sheddable", "background"
    ]
    assert effective_slo_tier("spot") == "sheddable"
    assert effective_slo_tier("spot", entitlement_tier="batch") == "batch"
    # A request's objective relaxes the granted tier, never raises it.
    assert relaxed_slo_tier("batch", SloTier.CRITICAL) == "batch"
    assert relaxed_slo_tier("standard", "sheddable") == "sheddable"
    assert relaxed_slo_tier("standard", "standard") == "standard"
    assert relaxed_slo_tier("sheddable", "no-such-tier") == "sheddable"
    # A configured table decides the order: a custom tier below the granted one is a relaxation.
    table = merged_priorities({"overnight": -5, "vip": 9})
    assert relaxed_slo_tier("standard", "overnight", table) == "overnight"
    assert relaxed_slo_tier("standard", "vip", table) == "standard"
    assert known_slo_tier("VIP ", table) == "vip" and known_slo_tier("vip") is None


def test_experiment_2_priorities() -> None:
    copilot = priority_weight("elastic", 500, EXPERIMENT_2_MEAN_SLO_MS)
    synth = priority_weight("elastic", 30_000, EXPERIMENT_2_MEAN_SLO_MS)
    assert round(copilot, 1) == 93.8
    assert round(synth, 1) == 20.3
    assert round(copilot / synth, 1) == 4.6


def test_experiment_2_debt_raised_priority() -> None:
    synth_at_peak_debt = priority_weight("elastic", 30_000, EXPERIMENT_2_MEAN_SLO_MS, debt=0.775)
    # The paper rounds the base weight to 20.3 before multiplying: 20.3 * (1 + 4 * 0.775) = 83.2.
    assert synth_at_peak_debt == pytest.approx(20.2658 * 4.1, rel=1e-4)
    assert abs(synth_at_peak_debt - 83.2) < 0.2
    copilot_at_peak_debt = priority_weight("elastic", 500, EXPERIMENT_2_MEAN_SLO_MS, debt=0.607)
    assert round(copilot_at_peak_debt / synth_at_peak_debt, 1) == 3.9


def test_class_dominates_and_burst_lowers_priority() -> None:
    # Under normal conditions (comparable SLOs) the class dominates even a fully indebted elastic.
    guaranteed = priority_weight("guaranteed", 1_000, 1_000)
    elastic = priority_weight("elastic", 1_000, 1_000, debt=1.0)
    assert guaranteed > elastic
    assert priority_weight("elastic", 1000, 1000, burst=1.0) == pytest.approx(
        priority_weight("elastic", 1000, 1000) / 2
    )


def test_spot_and_preemptible_ignore_debt() -> None:
    assert priority_weight("spot", 1000, 1000, debt=0.9) == priority_weight("spot", 1000, 1000)
    assert priority_weight("preemptible", 1000, 1000, debt=0.9) == priority_weight("preemptible", 1000, 1000)


def test_credit_cannot_make_priority_negative() -> None:
    weight = priority_weight("elastic", 1000, 1000, debt=-5.0)
    assert weight == pytest.approx(100 / 3 * 0.1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slo_target_ms": 0},
        {"mean_slo_ms": -1},
        {"burst": -0.1},
        {"debt": math.nan},
        {"slo_target_ms": math.inf},
    ],
)
def test_priority_rejects_bad_inputs(kwargs: dict[str, float]) -> None:
    arguments = {"service_class": "elastic", "slo_target_ms": 100.0, "mean_slo_ms": 100.0, **kwargs}
    with pytest.raises(PolicyConfigError):
        priority_weight(**arguments)


def test_unknown_class_is_a_clear_error() -> None:
    with pytest.raises(PolicyConfigError, match="unknown service class 'gold'"):
        priority_weight("gold", 1, 1)


def test_service_gap_counts_only_unmet_demand() -> None:
    assert service_gap(baseline=10, demand=0, served=0) == 0.0  # idle: no debt
    assert service_gap(baseline=10, demand=20, served=5) == 0.5  # shrunk to half
    assert service_gap(baseline=10, demand=4, served=4) == 0.0  # all of a small demand served
    assert service_gap(baseline=10, demand=30, served=15) == -0.5  # bursting earns credit
    assert service_gap(baseline=0, demand=30, served=0) == 0.0


def test_debt_ewma_with_default_gamma() -> None:
    debt = 0.0
    for _ in range(3):
        debt = debt_update(debt, 1.0)
    assert debt == pytest.approx(1 - 0.7**3)
    assert debt_update(0.5, 0.0) == pytest.approx(0.35)


def test_burst_delta_skips_zero_baselines() -> None:
    baseline = ResourceVector(tokens_per_second=100, kv_bytes=0, concurrency=4)
    served = ResourceVector(tokens_per_second=150, kv_bytes=10**9, concurrency=8)
    assert burst_delta(served, baseline) == pytest.approx(0.5 + 1.0)


def test_update_dynamics_per_class() -> None:
    baseline = ResourceVector(tokens_per_second=100, concurrency=5)
    demand = ResourceVector(tokens_per_second=200, concurrency=10)
    served = ResourceVector(tokens_per_second=50, concurrency=2)
    elastic = update_dynamics(Dynamics(), "elastic", baseline, demand, served)
    assert elastic.debt == pytest.approx(0.3 * 0.5)
    spot = update_dynamics(Dynamics(debt=0.0), "spot", baseline, demand, served)
    assert spot.debt == 0.0
    # Slot-only baselines (Experiment 2) measure the gap on concurrency.
    slots_only = update_dynamics(
        Dynamics(), "elastic", ResourceVector(concurrency=5), ResourceVector(concurrency=10), ResourceVector(concurrency=2)
    )
    assert slots_only.debt == pytest.approx(0.3 * 0.6)
    bursting = update_dynamics(
        Dynamics(), "elastic", ResourceVector(concurrency=5), ResourceVector(concurrency=10), ResourceVector(concurrency=10)
    )
    assert bursting.debt == pytest.approx(0.3 * -1.0)
    assert bursting.burst == pytest.approx(0.3 * 1.0)


def test_resource_vector_rejects_negative_and_nan() -> None:
    with pytest.raises(PolicyConfigError):
        ResourceVector(tokens_per_second=-1)
    with pytest.raises(PolicyConfigError):
        ResourceVector(kv_bytes=math.nan)
