"""The seed experiments keep their expected shape (full-length runs take well under a second each)."""

from __future__ import annotations

import pytest

from apps.simulator.experiments import exp1_report, exp2_report, run_drr, run_exp1, run_exp2


@pytest.fixture(scope="module")
def exp1():
    return run_exp1()


@pytest.fixture(scope="module")
def exp2():
    return run_exp2()


def test_exp1_token_pools_protect_guaranteed_traffic(exp1):
    metrics, runs = exp1
    assert metrics["pools_guaranteed_rejected"] == 0
    assert metrics["pools_spot_rejected"] > 0
    # Guaranteed TTFT stays bounded with token pools and is far worse without admission control.
    assert metrics["pools_guaranteed_ttft_p99_s"] < 1.2
    assert metrics["baseline_guaranteed_ttft_p99_s"] > 3 * metrics["pools_guaranteed_ttft_p99_s"]
    # The backend's waiting queue stays near empty with token pools and grows without.
    assert metrics["pools_mean_waiting"] < 0.5
    assert metrics["baseline_mean_waiting"] > 10 * metrics["pools_mean_waiting"]
    assert metrics["baseline_max_waiting"] > 10
    # Spot is squeezed while guaranteed-c is active and recovers after it leaves.
    assert metrics["pools_spot_running_phase2"] < metrics["pools_spot_running_phase1"] - 2
    assert metrics["pools_spot_running_phase3"] > metrics["pools_spot_running_phase2"] + 2
    for simulation in runs.values():
        assert simulation.summary()["conservation"]["holds"]


def test_exp1_report_puts_the_seed_beside_ours(exp1):
    text = exp1_report(exp1[0])
    assert "| quantity | seed | ours | note |" in text and "19+" in text and "Why numbers differ" in text


def test_exp2_copilot_is_never_denied_on_priority_and_synth_absorbs_it(exp2):
    metrics, runs = exp2
    copilot, synth = metrics["elastic-copilot"], metrics["elastic-synth"]
    assert copilot["low_priority_denials"] == 0
    assert synth["low_priority_denials"] > 10
    # Both accrue debt in the outage, synth more; copilot keeps more slots than synth.
    assert synth["peak_debt"] > copilot["peak_debt"] > 0
    assert copilot["running_outage"] > synth["running_outage"]
    # The SLO term alone gives the seed's priorities.
    assert metrics["priority_slo_only"]["elastic-copilot"] == pytest.approx(93.8, abs=0.1)
    assert metrics["priority_slo_only"]["elastic-synth"] == pytest.approx(20.3, abs=0.1)
    # Debt decays after recovery: 50 s later it is no longer positive.
    assert all(debt <= 0.05 for debt in metrics["debt_50s_after_recovery"].values())
    assert runs["token_pools"].summary()["conservation"]["holds"]
    assert "0 / 317 / 22" in exp2_report(metrics)


def test_drr_splits_two_to_one_and_a_lone_tenant_uses_the_whole_budget():
    metrics, runs = run_drr()
    assert metrics["share_a_contended"] == pytest.approx(2 / 3, abs=0.05)
    assert metrics["b_alone_mean_running"] == pytest.approx(32, abs=1)
    assert runs["drr"].summary()["conservation"]["holds"]


def _aimd_run(initial: int | None, static: int | None):
    from apps.simulator.cli import run_simulation
    from apps.simulator.experiments import aimd_config, aimd_point
    from apps.simulator.scenario import Scenario

    config, admission = aimd_config(initial, static, horizon_s=120.0)
    return aimd_point(run_simulation(Scenario("aimd", config), admission))


def test_static_cap_sweep_traces_a_ttft_u_curve():
    low, middle, high = (_aimd_run(None, cap)["ttft_p99_s"] for cap in (4, 128, 256))
    assert low > 2 * middle and high > 2 * middle


def test_aimd_pulls_an_oversized_budget_down_and_cuts_ttft_in_overload():
    static = _aimd_run(None, 256)
    controlled = _aimd_run(256, None)
    assert controlled["final_cap"] < 256
    assert controlled["ttft_p99_last60_s"] < static["ttft_p99_last60_s"] / 2
