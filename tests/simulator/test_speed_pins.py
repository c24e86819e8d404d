"""The simulator's speed work (issue 26, item 5) changes how fast it runs, never what it computes.

Every figure pinned here is what the simulator produced BEFORE that work (commit f487a72, the code as merged
with `manage.py replay`), on fixed seeds: `bench.sim`'s workload (token-pools admission, four entitlements,
four roofline H100 instances), two seed scenarios, and a replay of synthetic records under a manifest tight
enough that most requests queue. A change that moves any of them changes the simulator's results: it is a
behaviour change (which needs its own reason and its own new pins), not an optimisation.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import pytest

from apps.policy.admission import EntitlementLimits
from apps.simulator.cli import run_simulation
from apps.simulator.experiments import SCENARIOS
from apps.simulator.factory import build_admission
from apps.simulator.replay import Latency, PoolPicture, Recorded, replay_pool
from apps.simulator.scenario import load_scenario
from apps.simulator.simulation import Simulation
from bench.sim import bench_config


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def test_bench_sim_workload_gives_the_pre_change_summary() -> None:
    config = bench_config(4000)
    config.record_latencies = True  # the latency percentiles too (the bench itself skips them)
    simulation = Simulation(config, build_admission({"policy": "token-pools", "tick_s": 1.0}, config)).run()
    summary = simulation.summary()
    summary.pop("wall_seconds")
    assert simulation.loop.events_run == 7213
    assert {key: summary[key] for key in ("completed_requests", "rejected_requests", "simulated_seconds",
                                          "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "output_tokens")} == {
        "completed_requests": 3937, "rejected_requests": 63, "simulated_seconds": 14.0542, "ttft_p50_s": 0.0392,
        "ttft_p99_s": 0.0903, "e2e_p99_s": 3.2821, "output_tokens": 503936}
    assert summary["denials_by_reason"] == {"concurrency_limit_exceeded": 54, "pool_contended": 6, "queue_full": 3}
    assert {name: (t["admitted"], t["rejected"], t["ttft_p99_s"], t["queue_wait_p99_s"])
            for name, t in summary["tenants"].items()} == {
        "elastic-a": (1002, 3, 0.0809, 0.0185), "elastic-b": (1014, 0, 0.0896, 0.0548),
        "guaranteed": (965, 0, 0.0973, 0.0497), "spot": (956, 60, 0.0866, 0.0)}
    # Everything else in the summary (utilization, per-tenant percentiles, conservation), as one digest.
    assert _digest(summary) == "5184a8aa8b78d3013f88960e9d011b3532c7a0f68fe9a8eb3d54095b761d3bf7"


@pytest.mark.parametrize(("name", "events", "figures", "digest"), [
    ("seed000_queue_agreement", 954, (231, 22, 5.0069),
     "d457b38b1643b347af680a4c10a402f0392e5554329df693ba9af19a2b75de1b"),
    ("seed000_exp1_token_pools", 1067, (262, 75, 0.4336),
     "c81ceb66f87b36a3d4ce220f749d0a066c05348a45e9863ee134374cd549eb7c"),
])
def test_seed_scenarios_give_the_pre_change_summary(name: str, events: int, figures: tuple[Any, ...],
                                                    digest: str) -> None:
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    simulation = run_simulation(scenario, dict(scenario.admission))
    summary = simulation.summary()
    summary.pop("wall_seconds")
    assert simulation.loop.events_run == events
    assert (summary["completed_requests"], summary["rejected_requests"], summary["ttft_p99_s"]) == figures
    assert _digest(summary) == digest


def _records(count: int) -> list[Recorded]:
    """bench.replay's synthetic window (three entitlements, Poisson arrivals, lognormal lengths), in memory."""
    rng = random.Random(7)
    records, at = [], 0.0
    for _ in range(count):
        at += rng.expovariate(15.0)
        which = rng.choices(("g", "e", "s"), weights=(5, 3, 2))[0]
        prompt = max(8, round(rng.lognormvariate(5.5, 0.6)))
        completion = max(2, round(rng.lognormvariate(4.5, 0.5)))
        refused = rng.random() < 0.05
        records.append(Recorded(1000.0 + at, 1, "pool", which, prompt, 256, 0 if refused else completion,
                                "rejected" if refused else "served", "concurrency_limit_exceeded" if refused else "",
                                0.0, None if refused else 20 + prompt * 0.05, 100.0))
    return records


def test_a_queue_heavy_replay_gives_the_pre_change_figures() -> None:
    gib = 2.0**30
    per_token = 147456.0
    entitlements = {
        "g": EntitlementLimits("g", "guaranteed", tokens_per_second=12000, kv_bytes=4 * gib, concurrency=8,
                               slo_target_ms=1000, kv_bytes_per_token=per_token, tenant_id="t"),
        "e": EntitlementLimits("e", "elastic", tokens_per_second=8000, kv_bytes=4 * gib, concurrency=12,
                               slo_target_ms=2000, kv_bytes_per_token=per_token, tenant_id="t"),
        "s": EntitlementLimits("s", "spot", tokens_per_second=4000, kv_bytes=2 * gib, concurrency=8,
                               slo_target_ms=5000, kv_bytes_per_token=per_token, tenant_id="t"),
    }
    run = replay_pool(_records(3000), PoolPicture("pool", 2, 16, 40 * gib, 2000.0, entitlements),
                      Latency(0.05, 15.0, 100), start=1000.0)
    assert {name: (f["admitted"], f["rejected_by_reason"], f["waited"], f["p99_ttft_s"], f["peak_debt"])
            for name, f in run.figures.items()} == PINNED_REPLAY
    assert _digest([run.figures, run.ttft]) == PINNED_REPLAY_DIGEST


# Per entitlement: admitted, refused by reason, waited, p99 TTFT, peak debt (the pre-change code's).
PINNED_REPLAY: dict[str, Any] = {
    "g": (925, {"queue_full": 246, "queue_timeout": 380}, 1264, 1.0304, 0.1832),
    "e": (858, {}, 2, 0.0867, 0.0),
    "s": (591, {}, 0, 0.0864, 0.0),
}
PINNED_REPLAY_DIGEST = "3082e18ae0fc4d8ed651dd2c252e09d5468f72a24a8434318db18f3a3a19e2e1"
