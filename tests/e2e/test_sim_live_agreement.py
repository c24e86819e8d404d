"""What the simulator shows is what the gateway does: one scenario file, two clocks.

`apps/simulator/scenarios/seed000_exp1_agreement.yaml` (two minutes of the seed's Experiment 1 on a 16-slot
pool) runs through the simulator in virtual time, and in real time through the real site (`manage.py
serve`, embedded defaults) in front of the virtual vLLM, whose instance model is the simulator's. The live
clients are the scenario's tenants (`apps.simulator.live`): the open-loop one sends at the simulator's own
arrival draws, the closed-loop ones as the simulator's clients do, and guaranteed-c's entitlement is created
when it joins and deleted when it leaves, through the REST API, as an operator would.

Per entitlement, admitted and rejected counts must agree within 10% (of the larger of the two, plus one
request for rounding) and p99 TTFT within 25% of the simulator's. Both sides are printed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.simulator.cli import run_simulation
from apps.simulator.live import LiveWorkload, live_entitlement, scenario_manifest, summarize_live
from apps.simulator.scenario import load_scenario
from apps.simulator.workload import TenantSpec
from tests.support.services import free_port, running_http_server
from tests.support.site import REPO, manage, prepare_site, serving

pytestmark = [pytest.mark.slow]

SCENARIO = REPO / "apps/simulator/scenarios/seed000_exp1_agreement.yaml"
POOL = "exp1"
OWNER = "exp"
COUNT_TOLERANCE = 0.10
TTFT_TOLERANCE = 0.25


def _virtual_vllm_cmd(config: Any, port: int) -> list[str]:
    return [sys.executable, "-m", "backends.virtual_vllm", "--port", str(port), "--served-model-name", POOL,
            "--max-num-seqs", str(config.max_num_seqs), "--latency-model", config.latency_model,
            "--prefill-ms-per-token", str(config.prefill_ms_per_token),
            "--decode-ms-per-token", str(config.decode_ms_per_token), "--block-size", str(config.block_size),
            *(["--kv-blocks", str(config.kv_blocks)] if config.kv_blocks else [])]


def _admin_token(env: dict[str, str]) -> str:
    out = manage(env, "shell", "-c", "from django.contrib.auth import get_user_model; "
                                     "from rest_framework.authtoken.models import Token; "
                                     "u = get_user_model().objects.create_superuser('ops', 'ops@example.com', 'ops-pass-123'); "
                                     "print(Token.objects.create(user=u).key)")
    return out.strip().splitlines()[-1]


def _live(config: Any, url: str, keys: dict[str, str], token: str) -> list[Any]:
    api = {"Authorization": f"Token {token}"}

    async def join(tenant: TenantSpec) -> str:
        async with httpx.AsyncClient(base_url=url, headers=api, timeout=30) as client:
            created = await client.post("/api/v1/entitlements/", json=live_entitlement(tenant, pool=POOL, owner=OWNER))
            assert created.status_code == 201, created.text
            key = await client.post("/api/v1/keys/", json={"entitlement": tenant.name, "name": "live"})
            assert key.status_code == 201, key.text
            return str(key.json()["secret"])

    async def leave(tenant: TenantSpec) -> None:
        async with httpx.AsyncClient(base_url=url, headers=api, timeout=30) as client:
            gone = await client.delete(f"/api/v1/entitlements/{tenant.name}/")
            assert gone.status_code == 204, gone.text

    workload = LiveWorkload(config.tenants, url=url, keys=keys, model=POOL, seed=config.seed,
                            horizon_s=float(config.horizon_s), on_join=join, on_leave=leave)
    return asyncio.run(workload.run())


def _close(live: float, sim: float, tolerance: float, floor: float = 0.0) -> bool:
    return abs(live - sim) <= tolerance * max(live, sim) + floor


def test_the_simulator_predicts_the_live_gateway(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = load_scenario(SCENARIO)
    config = scenario.config
    assert config.horizon_s is not None
    simulated = run_simulation(scenario, dict(scenario.admission)).summary()["tenants"]

    port = free_port()
    with running_http_server(_virtual_vllm_cmd(config, port), port=port, name="virtual-vllm", cwd=REPO,
                             startup_timeout_s=60) as (backend, _process):
        manifest = scenario_manifest(config.tenants, pool=POOL, owner=OWNER, backend_urls=[backend],
                                     slots_per_replica=config.max_num_seqs)
        first = [t.name for t in config.tenants if t.start == 0]
        site = prepare_site(tmp_path, tenants=[OWNER], manifest=manifest, key_for=first)
        token = _admin_token(site.env)
        with serving(site) as (url, _server):
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
