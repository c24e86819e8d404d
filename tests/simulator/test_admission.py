"""The simulator drives apps.policy's token-pool ledger: entitlements, capacity, queueing, eviction."""

from __future__ import annotations

import pytest

from apps.policy.errors import PolicyConfigError
from apps.simulator.admission import TokenPoolsAdmission
from apps.simulator.factory import build_admission
from apps.simulator.simulation import CapacityEvent, SimConfig, Simulation
from apps.simulator.workload import LengthSpec, TenantSpec

SHORT = {"input": LengthSpec("fixed", 16), "output": LengthSpec("fixed", 20)}


def simulate(
    tenants: list[TenantSpec], *, slots: int = 4, horizon: float = 20.0, events=(), **admission
) -> Simulation:
    config = SimConfig(latency_model="fixed", prefill_ms_per_token=1, decode_ms_per_token=50, max_num_seqs=slots,
                       tenants=tenants, horizon_s=horizon, seed=3, sample_interval_s=0.5,
                       capacity_events=list(events))  # fmt: skip
    adapter = build_admission({"policy": "token-pools", **admission}, config)
    return Simulation(config, adapter).run()


def test_guaranteed_within_its_slots_is_never_rejected_while_spot_is_throttled():
    simulation = simulate([
        TenantSpec("gold", concurrency=2, entitlement={"service_class": "guaranteed", "concurrency": 2}, **SHORT),
        TenantSpec("spot", rate=20.0, entitlement={"service_class": "spot", "concurrency": 4}, **SHORT),
    ])  # fmt: skip
    tenants = simulation.cluster.stats.tenants
    assert tenants["gold"].rejected == 0 and tenants["gold"].completed > 20
    assert tenants["spot"].rejected > 0
    # The pool never runs more than its slots.
    assert max(sum(s.running) for s in simulation.samples) <= 4
    assert simulation.summary()["conservation"]["holds"]


def test_pool_capacity_follows_capacity_events():
    simulation = simulate(
        [TenantSpec("e", rate=30.0, entitlement={"service_class": "elastic", "concurrency": 8}, **SHORT)],
        slots=4,
        events=[CapacityEvent(5.0, "slots", (0,), 2), CapacityEvent(12.0, "slots", (0,), 4)],
    )
    ledger = simulation.cluster.admission.ledger  # type: ignore[attr-defined]
    running = {s.time: sum(s.running) for s in simulation.samples}
    assert max(v for t, v in running.items() if 7 <= t < 12) <= 2
    assert max(v for t, v in running.items() if 14 <= t < 20) == 4
    assert ledger.concurrency_capacity == 4


def test_a_tenant_that_leaves_gives_its_reserved_slots_back():
    simulation = simulate([
        TenantSpec("gold", concurrency=3, stop=8.0, entitlement={"service_class": "guaranteed", "concurrency": 3}, **SHORT),
        TenantSpec("spot", rate=40.0, entitlement={"service_class": "spot", "concurrency": 4}, **SHORT),
    ])  # fmt: skip
    ledger = simulation.cluster.admission.ledger  # type: ignore[attr-defined]
    spot_running = {s.time: s.tenant_running.get("spot", 0) for s in simulation.samples}
    assert max(v for t, v in spot_running.items() if 2 <= t < 8) <= 1
    assert max(v for t, v in spot_running.items() if 12 <= t < 20) >= 3
    assert ledger.limits("gold") is None  # removed once its last request finished


def test_higher_priority_requests_wait_for_a_slot_and_expire_after_the_timeout():
    simulation = simulate(
        [
            TenantSpec("low", concurrency=4, slo_target_ms=30000, entitlement={"service_class": "elastic", "concurrency": 4}, **SHORT),
            TenantSpec("high", rate=5.0, slo_target_ms=100, entitlement={"service_class": "elastic", "concurrency": 4}, **SHORT),
        ],
        wait_timeout_s=0.2,
    )  # fmt: skip
    stats = simulation.cluster.stats
    # The tight-SLO tenant is queued ahead (never denied on priority); what waits past 0.2 s expires.
    assert stats.tenants["high"].denials.get("pool_contended", 0) == 0
    assert stats.tenants["high"].completed > 0
    assert stats.lost.get("expired", 0) > 0
    assert simulation.summary()["conservation"]["holds"]


def test_preemptible_work_is_evicted_for_a_higher_priority_request():
    simulation = simulate([
        TenantSpec("batch", concurrency=4, entitlement={"service_class": "preemptible", "concurrency": 4}, **SHORT),
        TenantSpec("gold", rate=2.0, start=2.0, entitlement={"service_class": "guaranteed", "concurrency": 4}, **SHORT),
    ])  # fmt: skip
    stats = simulation.cluster.stats
    assert stats.lost.get("evicted", 0) > 0
    assert stats.tenants["gold"].rejected == 0
    assert stats.tenants["gold"].ttft and max(stats.tenants["gold"].ttft) < 0.2
    assert all(instance.used_blocks >= 0 for instance in simulation.cluster.instances)
    assert simulation.summary()["conservation"]["holds"]


def test_debt_samples_come_from_the_ledger_tick():
    simulation = simulate(
        [TenantSpec("e", concurrency=6, entitlement={"service_class": "elastic", "concurrency": 6}, **SHORT)],
        slots=3,
    )
    adapter = simulation.cluster.admission
    assert isinstance(adapter, TokenPoolsAdmission)
    debts = [s.debt["e"] for s in adapter.debt_samples if s.time > 5]
    # Demand 6 against 3 slots: underserved, so debt is positive and settles.
    assert debts and min(debts) > 0.2


def test_a_quota_refuses_within_its_hour_and_the_next_hour_starts_afresh():
    # Virtual time starts on the hour: 36 tokens a request (16 + 20), at most 10 requests' worth an hour.
    quota = {"tokens": 360, "window": "hour"}
    simulation = simulate(
        [TenantSpec("metered", rate=1.0, entitlement={"service_class": "elastic", "concurrency": 4, "quota": quota},
                    **SHORT)],
        horizon=3600.0 + 600.0,
    )
    ledger = simulation.cluster.admission.ledger  # type: ignore[attr-defined]
    assert ledger.counters.by_reason.get("quota_exceeded", 0) > 3000  # about 1 request a second, 10 served
    assert ledger.counters.admitted == 20  # 10 in the first hour, 10 in the second
    assert ledger.quotas.holds == {}


def test_bad_entitlement_keys_and_queue_values_are_config_errors():
    with pytest.raises(PolicyConfigError, match="tenant 'gold': entitlement: .*'queue_size'"):
        TokenPoolsAdmission([TenantSpec("gold", concurrency=1, entitlement={"queue_size": 2}, **SHORT)])
    with pytest.raises(PolicyConfigError, match="queue_max_wait_ms must be a number from 0 to 600000"):
        TokenPoolsAdmission([TenantSpec("gold", concurrency=1, entitlement={"queue_max_wait_ms": 700_000}, **SHORT)])


def _gold_at_twice_its_concurrency(**entitlement: object) -> Simulation:
    # 8 closed-loop clients on an entitlement of concurrency 4 (guidellm's concurrent profile, 8 streams).
    return simulate([
        TenantSpec("gold", concurrency=8, entitlement={"service_class": "guaranteed", "concurrency": 4, **entitlement},
                   **SHORT),
    ], slots=8)  # fmt: skip


def test_over_its_own_concurrency_a_request_waits_in_its_entitlements_queue_instead_of_a_429():
    # A request takes about 1 s here: a wait of up to 3 s covers a release (the default 1 s would time some out).
    queued = _gold_at_twice_its_concurrency(queue_max_wait_ms=3000)
    gold = queued.cluster.stats.tenants["gold"]
    assert gold.rejected == 0 and gold.lost == 0 and gold.completed > 50
    assert max(gold.queue_wait) > 0.5  # it waited for a release (a request takes about 1 s)
    assert max(sum(s.running) for s in queued.samples) <= 4
    summary = queued.summary()
    assert summary["conservation"]["holds"] and summary["tenants"]["gold"]["queue_timeouts"] == 0
    refused = _gold_at_twice_its_concurrency(queue_max=0)
    assert refused.cluster.stats.tenants["gold"].denials["concurrency_limit_exceeded"] > 0


def test_a_queue_wait_shorter_than_a_request_times_out_and_says_so():
    simulation = _gold_at_twice_its_concurrency(queue_max_wait_ms=200)
    gold = simulation.summary()["tenants"]["gold"]
    assert gold["queue_timeouts"] > 0 and gold["queue_timeouts"] == gold["lost"]
    assert gold["queue_wait_p99_s"] is None or gold["queue_wait_p99_s"] <= 0.2 + 1e-6
    assert simulation.summary()["conservation"]["holds"]


def test_aimd_moves_the_dispatch_budget_of_the_same_state_machine():
    """Seed 002's controller on the token-pools machine: TTFTs far over the target cut the budget, and the pool
    then runs no more requests than the budget allows (no second queue: the machine's own room holds them)."""
    simulation = simulate(
        [TenantSpec("e", concurrency=16, entitlement={"service_class": "elastic", "concurrency": 16}, **SHORT)],
        slots=16, horizon=60.0,
        aimd={"target_p99_ttft_s": 0.05, "tick_s": 2.0, "window_s": 4.0, "cap_per_worker_min": 2,
              "cap_per_worker_max": 16, "min_samples": 5})
    adapter = simulation.cluster.admission
    assert isinstance(adapter, TokenPoolsAdmission)
    caps = [cap for _, cap, _ in adapter.budget_samples]
    assert caps[0] < 16 and min(caps) == 2 and adapter.ledger.budget == caps[-1]
    cut_at = next(t for t, cap, _ in adapter.budget_samples if cap == 2)
    later = [s for s in simulation.samples if s.time > cut_at + 1.0]
    assert later and max(sum(s.running) for s in later) <= 2
    assert simulation.summary()["conservation"]["holds"]
