"""The pieces `manage.py experiment` compares live and simulated runs with: scaling a scenario to the machine,
phases, per-phase figures, capacity events as replica switches, debt decay, and the simulator-only command."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from apps.simulator.experiment import (
    Outcome,
    debt_decay_s,
    figures,
    in_flight_series,
    phases,
    scale_scenario,
)
from apps.simulator.experiment_live import enabled_replicas
from apps.simulator.scenario import load_scenario
from apps.simulator.simulation import CapacityEvent

SCENARIOS = Path(__file__).resolve().parents[2] / "apps/simulator/scenarios"
EXP1 = SCENARIOS / "seed000_exp1_token_pools.yaml"
EXP2 = SCENARIOS / "seed000_exp2_token_pools.yaml"


def test_scaling_keeps_the_load_in_slot_seconds() -> None:
    scenario = load_scenario(EXP1)
    scaled = scale_scenario(scenario, time_scale=0.25, capacity_scale=2.0)
    config, old = scaled.config, scenario.config
    assert config.horizon_s == old.horizon_s * 0.25
    assert config.decode_ms_per_token == old.decode_ms_per_token * 0.25
    assert config.max_num_seqs == old.max_num_seqs * 2
    spot = {t.name: t for t in config.tenants}["spot-b"]
    old_spot = {t.name: t for t in old.tenants}["spot-b"]
    # Requests last a quarter as long and come four times as often, twice as many: 8x the rate.
    assert spot.rate == pytest.approx(old_spot.rate * 8)
    joiner = {t.name: t for t in config.tenants}["guaranteed-c"]
    assert (joiner.start, joiner.stop, joiner.concurrency, joiner.entitlement["concurrency"]) == (7.5, 15.0, 12, 12)
    with pytest.raises(ValueError, match="positive"):
        scale_scenario(scenario, time_scale=0)


def test_phases_are_the_spans_between_joins_and_leaves() -> None:
    tenants = load_scenario(EXP1).config.tenants
    assert phases(tenants, 90.0) == [("before", 0.0, 30.0), ("during", 30.0, 60.0), ("after", 60.0, 90.0)]


def test_figures_per_phase_and_in_flight() -> None:
    tenants = load_scenario(EXP1).config.tenants
    outcomes = [Outcome("spot-b", 10.0, "ok", ttft_s=0.5, e2e_s=2.5), Outcome("spot-b", 40.0, "429", "pool_contended"),
                Outcome("spot-b", 41.0, "ok", ttft_s=1.5, e2e_s=3.0), Outcome("spot-b", 70.0, "error", "ReadTimeout")]
    per = figures(outcomes, tenants, 90.0)["spot-b"]
    assert (per["before"]["admitted"], per["during"]["rejected"], per["during"]["throttle_rate"]) == (1, 1, 0.5)
    assert per["during"]["denials"] == {"pool_contended": 1} and per["after"]["errors"] == 1
    assert per["all"]["ttft_p99_s"] is not None and per["all"]["ttft_p99_s"] >= 1.4
    series = in_flight_series(outcomes, ["spot-b"], 90.0)["spot-b"]
    assert series[10:14] == [1, 1, 1, 0] and series[41:45] == [1, 1, 1, 1] and series[45] == 0


def test_capacity_events_become_replica_switches() -> None:
    events = [CapacityEvent(30.0, "slots", (), 8), CapacityEvent(120.0, "slots", (), 16)]
    assert enabled_replicas(events, 0.0, 2, 8) == [True, True]
    assert enabled_replicas(events, 30.0, 2, 8) == [True, False]
    assert enabled_replicas(events, 119.0, 2, 8) == [True, False]
    assert enabled_replicas(events, 120.0, 2, 8) == [True, True]
    named = [CapacityEvent(5.0, "remove", (1,)), CapacityEvent(9.0, "restore", (1,))]
    assert enabled_replicas(named, 6.0, 2, 8) == [True, False] and enabled_replicas(named, 9.0, 2, 8) == [True, True]


def test_debt_decay_is_timed_from_the_recovery() -> None:
    debt = {"a": [[0.0, 0.0], [10.0, 0.8], [20.0, 0.5], [25.0, 0.05]], "b": [[0.0, 0.0], [10.0, 0.2], [22.0, 0.0]]}
    assert debt_decay_s(debt, 15.0) == 10.0
    assert debt_decay_s({"a": [[0.0, 1.0], [30.0, 1.0]]}, 15.0) is None


def test_the_command_runs_the_simulator_and_writes_the_report(tmp_path: Path) -> None:
    out = io.StringIO()
    call_command("experiment", "--scenario", str(EXP2), "--time-scale", "0.2", "--out", str(tmp_path), stdout=out)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["time_scale"] == 0.2 and report["outage_s"] == [6.0, 24.0]
    checks = {c["check"]: c["holds"] for c in report["shape"]}
    assert checks["elastic-copilot (tightest SLO): no pool_contended denials"]
    assert "sim token-pools" in report["arms"] and report["arms"]["sim token-pools"]["debt"]
    assert "| arm | the seed's claim | value | holds |" in out.getvalue()
    assert (tmp_path / "report.html").read_text().count("Plotly.newPlot") == 1


def test_bad_options_are_named() -> None:
    with pytest.raises(CommandError, match="--arms: unknown gold"):
        call_command("experiment", "--scenario", str(EXP1), "--arms", "gold")
    with pytest.raises(CommandError, match="--time-scale auto measures a real backend"):
        call_command("experiment", "--scenario", str(EXP1), "--time-scale", "auto")
    with pytest.raises(CommandError, match="--time-scale: a positive number"):
        call_command("experiment", "--scenario", str(EXP1), "--time-scale", "-1")
    with pytest.raises(CommandError, match="missing.yaml"):
        call_command("experiment", "--scenario", "missing.yaml")


def test_the_no_admission_arm_and_the_calibration_use_every_replica() -> None:
    import asyncio
    import re
    from dataclasses import replace

    import httpx

    from apps.simulator.experiment_live import calibrate_decode_ms, live_backend
    from apps.simulator.live import LiveWorkload
    from apps.simulator.workload import LengthSpec, TenantSpec

    config = replace(load_scenario(EXP1).config, max_num_seqs=4, latency_model="fixed", decode_ms_per_token=2.0,
                     prefill_ms_per_token=0.0)
    tenant = TenantSpec("closed", concurrency=2, input=LengthSpec("fixed", 8), output=LengthSpec("fixed", 4))

    def requests_seen(url: str) -> float:
        # Prompt tokens are counted when a request arrives (a success only once the engine's step has ended,
        # which can be after the client has read the last token), 8 per request here.
        text = httpx.get(url + "/metrics", timeout=10).text
        return sum(float(v) for v in re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M)) / 8

    with live_backend("virtual", config, replicas=2) as backend:
        assert len(backend.urls) == 2
        assert calibrate_decode_ms(backend, streams=2, prompt_tokens=8, output_tokens=4) > 0
        calibrated = [requests_seen(url) for url in backend.urls]
        assert calibrated == [4, 4], calibrated  # 2 rounds of 2 streams on each replica
        # No warm-up requests: the backends' own counts are compared with the records.
        workload = LiveWorkload([tenant], url=backend.urls, keys={"closed": "none"}, model=backend.model, seed=1,
                                horizon_s=1.0, warm_up_requests=0)
        records = asyncio.run(workload.run())
        after = [requests_seen(url) - before for url, before in zip(backend.urls, calibrated, strict=True)]
    assert records and all(r.status == 200 for r in records)
    assert sum(after) == len(records) and min(after) >= len(records) // 2, (after, len(records))  # taken in turn


def test_the_live_site_measures_debt_where_the_simulator_does() -> None:
    """Experiment 2's entitlements declare slots only: the simulator measures their service gap on slots, so
    the live site must too (it requires a rate, and the harness gives an unreachable one)."""
    from apps.simulator.live import scenario_site_env

    tenants = load_scenario(EXP2).config.tenants
    assert all(not t.entitlement.get("tokens_per_second") for t in tenants)
    assert scenario_site_env(tenants) == {"GATEWAY_DEBT_DIMENSION": "concurrency"}
    with_rate = [dataclasses.replace(t, entitlement={**t.entitlement, "tokens_per_second": 500}) for t in tenants]
    assert scenario_site_env(with_rate) == {}  # a declared rate: the paper's tokens/s on both sides
