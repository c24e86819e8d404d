"""What the simulator shows is what the gateway does: one scenario file, two clocks.

`apps/simulator/scenarios/seed000_exp1_agreement.yaml` (two minutes of the seed's Experiment 1 on a 16-slot
pool) runs through the simulator in virtual time, and in real time through the real site (`manage.py
serve`, embedded defaults) in front of the virtual vLLM, whose instance model is the simulator's. The live
clients are the scenario's tenants (`apps.simulator.live`): the open-loop one sends at the simulator's own
arrival draws, the closed-loop ones as the simulator's clients do, and guaranteed-c's entitlement is created
when it joins and deleted when it leaves, through the REST API, as an operator would.

Per entitlement, admitted and rejected counts must agree within 10% of the simulator's (plus one request for
rounding) and p99 TTFT within 25% of the simulator's. Both sides are printed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from apps.simulator.cli import run_simulation
from apps.simulator.experiment_live import OWNER, POOL, admin_token, operator_hooks, virtual_vllm_cmd
from apps.simulator.live import LiveWorkload, scenario_manifest, scenario_site_env, summarize_live
from apps.simulator.scenario import load_scenario
from tests.support.services import free_port, running_http_server
from tests.support.site import REPO, prepare_site, serving

pytestmark = [pytest.mark.slow]

SCENARIO = REPO / "apps/simulator/scenarios/seed000_exp1_agreement.yaml"
COUNT_TOLERANCE = 0.10
TTFT_TOLERANCE = 0.25


def _live(config: Any, url: str, keys: dict[str, str], token: str) -> list[Any]:
    join, leave = operator_hooks(url, token)
    workload = LiveWorkload(config.tenants, url=url, keys=keys, model=POOL, seed=config.seed,
                            horizon_s=float(config.horizon_s), on_join=join, on_leave=leave)
    return asyncio.run(workload.run())


def _close(live: float, sim: float, tolerance: float, floor: float = 0.0) -> bool:
    """Within `tolerance` of the simulator's figure (the prediction is the reference), plus `floor`."""
    return abs(live - sim) <= tolerance * sim + floor


def test_the_simulator_predicts_the_live_gateway(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = load_scenario(SCENARIO)
    config = scenario.config
    assert config.horizon_s is not None
    simulated = run_simulation(scenario, dict(scenario.admission)).summary()["tenants"]

    port = free_port()
    with running_http_server(virtual_vllm_cmd(config, port, POOL), port=port, name="virtual-vllm", cwd=REPO,
                             startup_timeout_s=60) as (backend, _process):
        manifest = scenario_manifest(config.tenants, pool=POOL, owner=OWNER, backend_urls=[backend],
                                     slots_per_replica=config.max_num_seqs)
        first = [t.name for t in config.tenants if t.start == 0]
        site = prepare_site(tmp_path, tenants=[OWNER], manifest=manifest, key_for=first)
        token = admin_token(site.env)
        with serving(site, env=scenario_site_env(config.tenants)) as (url, _server):
            records = _live(config, url, site.keys, token)
    live = summarize_live(records, config.tenants, float(config.horizon_s))

    lines = [f"{'entitlement':<14} {'side':<5} {'admitted':>8} {'rejected':>8} {'ttft p50':>9} {'ttft p99':>9}  denials"]
    for name in sorted(simulated):
        for side, figures in (("sim", simulated[name]), ("live", live[name])):
            lines.append(f"{name:<14} {side:<5} {figures['admitted']:>8} {figures['rejected']:>8} "
                         f"{figures['ttft_p50_s'] or 0:>9.3f} {figures['ttft_p99_s'] or 0:>9.3f}  {figures['denials']}")
    with capsys.disabled():
        print("\nsim-to-live agreement (" + SCENARIO.name + ")\n" + "\n".join(lines))

    assert sum(figures["errors"] for figures in live.values()) == 0, live
    for name, sim in simulated.items():
        got = live[name]
        for count in ("admitted", "rejected"):
            assert _close(got[count], sim[count], COUNT_TOLERANCE, floor=1), (name, count, got[count], sim[count])
        assert sim["ttft_p99_s"] is not None and got["ttft_p99_s"] is not None
        assert _close(got["ttft_p99_s"], sim["ttft_p99_s"], TTFT_TOLERANCE), (name, got["ttft_p99_s"], sim["ttft_p99_s"])
