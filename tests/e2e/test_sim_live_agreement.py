"""What the simulator shows is what the gateway does: one scenario file, two clocks.

`apps/simulator/scenarios/seed000_exp1_agreement.yaml` (two minutes of the seed's Experiment 1 on a 16-slot
pool) runs through the simulator in virtual time, and in real time through the real site (`manage.py
serve`, embedded defaults) in front of the virtual vLLM, whose instance model is the simulator's. The live
clients are the scenario's tenants (`apps.simulator.live`): the open-loop one sends at the simulator's own
arrival draws, the closed-loop ones as the simulator's clients do, and guaranteed-c's entitlement is created
when it joins and deleted when it leaves, through the REST API, as an operator would.

Per entitlement, admitted and rejected counts must agree within 10% of the simulator's (plus one request for
rounding) and p99 TTFT within 25% of the simulator's. Both sides are printed.

With queues (issue 23), `seed000_queue_agreement.yaml`: a guaranteed entitlement of 4 slots with 8 closed-loop
clients waits in its own queue, beside an open-loop spot tenant, run live on both state stores (in-process,
and Redis behind `serve --workers 2`). Counts compare what a client sees: *served* (a 200 live; admitted less
queue timeouts in the simulator, which admits a request into its queue and counts a queue timeout as `lost`)
and *refused* (every 429 live, `queue_timeout` included; rejected plus queue timeouts in the simulator), each
within 10% plus one request. p99 TTFT within 25%; p99 queue wait (the gateway's `x-tokenpools-queue-ms`, the
simulator's arrival-to-dispatch) within 25% plus 50 ms, a floor well under one decode step so that a wait the
simulator puts at zero (spot-b never queues) may be a live handful of milliseconds.

With spillover (issue 24), `seed000_spillover_agreement.yaml`: a guaranteed entitlement of 4 slots with 6
closed-loop clients spills its extra requests to spot on the pool's unreserved slots beside a barely used
reservation and an open-loop guaranteed tenant refused on its own concurrency, on both stores; besides the
counts above, the requests served per tier (the simulator's admissions by tier, the client's 200s by
`x-tokenpools-service-tier`) agree within 10% plus one.

Before the clock starts, the live workload sends two one-token requests per key (`LiveWorkload._warm_up`):
the servers' first requests are not what the runs compare.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from apps.simulator.cli import run_simulation
from apps.simulator.experiment_live import (
    OWNER,
    POOL,
    Backend,
    admin_token,
    operator_hooks,
    run_arm,
    virtual_vllm_cmd,
)
from apps.simulator.live import LiveWorkload, scenario_manifest, scenario_site_env, summarize_live
from apps.simulator.scenario import load_scenario
from tests.support.services import free_port, running_http_server, running_redis
from tests.support.site import REPO, prepare_site, serving

pytestmark = [pytest.mark.slow]

SCENARIO = REPO / "apps/simulator/scenarios/seed000_exp1_agreement.yaml"
QUEUE_SCENARIO = REPO / "apps/simulator/scenarios/seed000_queue_agreement.yaml"
SPILLOVER_SCENARIO = REPO / "apps/simulator/scenarios/seed000_spillover_agreement.yaml"
COUNT_TOLERANCE = 0.10
TTFT_TOLERANCE = 0.25
WAIT_TOLERANCE = 0.25
# Below one decode step (133.3 ms): a wait the simulator puts at zero may be a few live milliseconds.
WAIT_FLOOR_S = 0.05


def _live(config: Any, url: str, keys: dict[str, str], token: str) -> tuple[list[Any], str]:
    """The live run's records, and what the measuring process's collector did meanwhile."""
    join, leave = operator_hooks(url, token)
    workload = LiveWorkload(config.tenants, url=url, keys=keys, model=POOL, seed=config.seed,
                            horizon_s=float(config.horizon_s), on_join=join, on_leave=leave)
    records = asyncio.run(workload.run())
    return records, workload.collector.summary()


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
            records, collector = _live(config, url, site.keys, token)
    live = summarize_live(records, config.tenants, float(config.horizon_s))

    lines = [f"{'entitlement':<14} {'side':<5} {'admitted':>8} {'rejected':>8} {'ttft p50':>9} {'ttft p99':>9}  denials"]
    for name in sorted(simulated):
        for side, figures in (("sim", simulated[name]), ("live", live[name])):
            lines.append(f"{name:<14} {side:<5} {figures['admitted']:>8} {figures['rejected']:>8} "
                         f"{figures['ttft_p50_s'] or 0:>9.3f} {figures['ttft_p99_s'] or 0:>9.3f}  {figures['denials']}")
    lines += [*_slowest(records), f"  {collector}"]
    with capsys.disabled():
        print("\nsim-to-live agreement (" + SCENARIO.name + ")\n" + "\n".join(lines))

    assert sum(figures["errors"] for figures in live.values()) == 0, live
    for name, sim in simulated.items():
        got = live[name]
        for count in ("admitted", "rejected"):
            assert _close(got[count], sim[count], COUNT_TOLERANCE, floor=1), (name, count, got[count], sim[count])
        assert sim["ttft_p99_s"] is not None and got["ttft_p99_s"] is not None
        assert _close(got["ttft_p99_s"], sim["ttft_p99_s"], TTFT_TOLERANCE), (name, got["ttft_p99_s"], sim["ttft_p99_s"])


def _slowest(records: list[Any], count: int = 3) -> list[str]:
    """Each tenant's slowest first tokens live, with when they were sent (what a p99 outlier needs to be
    explained: a stall of the machine shows up across tenants at one moment, a queue on one tenant)."""
    lines = []
    for tenant in sorted({r.tenant for r in records}):
        served = sorted((r for r in records if r.tenant == tenant and r.ttft_s is not None),
                        key=lambda r: r.ttft_s, reverse=True)[:count]
        lines.append(f"  slowest {tenant}: " + ", ".join(
            f"{r.ttft_s:.3f} s sent at {r.sent_at:.2f} s (queued {r.queue_s or 0:.3f} s)" for r in served))
    return lines


def _served_refused(sim: dict[str, Any]) -> tuple[int, int]:
    """The simulator's counts as a client sees them: a queue timeout was admitted into the queue, then lost."""
    timeouts = int(sim["queue_timeouts"])
    return int(sim["admitted"]) - timeouts, int(sim["rejected"]) + timeouts


def _run_live(path: Path, store: str, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The scenario in virtual time, then live through the real site in front of the virtual vLLM on `store`
    (the Redis one behind `serve --workers 2`, ticks from `run_ticks` as beat would): both summaries."""
    scenario = load_scenario(path)
    config = scenario.config
    assert config.horizon_s is not None
    simulated = run_simulation(scenario, dict(scenario.admission)).summary()["tenants"]
    port = free_port()
    with contextlib.ExitStack() as stack:
        backend, _process = stack.enter_context(running_http_server(
            virtual_vllm_cmd(config, port, POOL), port=port, name="virtual-vllm", cwd=REPO, startup_timeout_s=60))
        redis_url = stack.enter_context(running_redis()) if store == "redis" else None
        records = run_arm("redis" if store == "redis" else "token-pools", scenario, Backend((backend,), POOL),
                          tmp_path / store, progress=False, redis_url=redis_url)
    return simulated, summarize_live(records, config.tenants, float(config.horizon_s)), _slowest(records)


def _agreement_table(simulated: dict[str, Any], live: dict[str, Any]) -> list[str]:
    lines = [f"{'entitlement':<14} {'side':<5} {'served':>6} {'refused':>7} {'q-tmo':>5} {'wait p50':>8} "
             f"{'wait p99':>8} {'ttft p50':>8} {'ttft p99':>8}  denials; served by tier"]
    for name in sorted(simulated):
        sim_served, sim_refused = _served_refused(simulated[name])
        for side, figures, served, refused in (
                ("sim", simulated[name], sim_served, sim_refused),
                ("live", live[name], live[name]["admitted"], live[name]["rejected"])):
            lines.append(f"{name:<14} {side:<5} {served:>6} {refused:>7} {figures['queue_timeouts']:>5} "
                         f"{figures['queue_wait_p50_s'] or 0:>8.3f} {figures['queue_wait_p99_s'] or 0:>8.3f} "
                         f"{figures['ttft_p50_s'] or 0:>8.3f} {figures['ttft_p99_s'] or 0:>8.3f}  "
                         f"{figures['denials']}; {figures['served_by_tier']}")
    return lines


def _assert_agreement(simulated: dict[str, Any], live: dict[str, Any], *, tiers: bool = False) -> None:
    assert sum(figures["errors"] for figures in live.values()) == 0, live
    for name, sim in simulated.items():
        got = live[name]
        sim_served, sim_refused = _served_refused(sim)
        assert _close(got["admitted"], sim_served, COUNT_TOLERANCE, floor=1), (name, "served", got["admitted"], sim_served)
        assert _close(got["rejected"], sim_refused, COUNT_TOLERANCE, floor=1), (name, "refused", got["rejected"], sim_refused)
        for figure, tolerance, floor in (("ttft_p99_s", TTFT_TOLERANCE, 0.0),
                                         ("queue_wait_p99_s", WAIT_TOLERANCE, WAIT_FLOOR_S)):
            assert sim[figure] is not None and got[figure] is not None, (name, figure)
            assert _close(got[figure], sim[figure], tolerance, floor), (name, figure, got[figure], sim[figure])
        if tiers:
            # The simulator counts admissions by tier (as `admitted`), the client the 200s by their
            # x-tokenpools-service-tier.
            for tier in set(sim["served_by_tier"]) | set(got["served_by_tier"]):
                want, have = sim["served_by_tier"].get(tier, 0), got["served_by_tier"].get(tier, 0)
                assert _close(have, want, COUNT_TOLERANCE, floor=1), (name, tier, have, want)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_the_simulator_predicts_the_live_gateway_with_queues(store: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    simulated, live, slowest = _run_live(QUEUE_SCENARIO, store, tmp_path)
    assert simulated["guaranteed-q"]["queue_wait_p99_s"] > 1.0, "the scenario must make guaranteed-q wait"
    with capsys.disabled():
        print(f"\nsim-to-live agreement ({QUEUE_SCENARIO.name}, {store} store)\n"
              + "\n".join(_agreement_table(simulated, live) + slowest))
    _assert_agreement(simulated, live)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_the_simulator_predicts_the_live_gateway_with_spillover(store: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    simulated, live, slowest = _run_live(SPILLOVER_SCENARIO, store, tmp_path)
    tiers = simulated["guaranteed-s"]["served_by_tier"]
    assert tiers.get("spot", 0) > 10 and tiers.get("guaranteed", 0) > 10, "the scenario must spill over"
    with capsys.disabled():
        print(f"\nsim-to-live agreement ({SPILLOVER_SCENARIO.name}, {store} store)\n"
              + "\n".join(_agreement_table(simulated, live) + slowest))
    _assert_agreement(simulated, live, tiers=True)
