"""The seed experiments as runnable reports: our numbers beside the seed's, with plots.

    python -m apps.simulator.experiments exp1|exp2|drr|aimd|all --out DIR

Each experiment runs scenario files from `apps/simulator/scenarios/` (or builds the seed-002 ones in code),
computes the quantities the seed reports, and writes `DIR/<experiment>/report.md` plus Plotly HTML/PNG.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from apps.simulator.cli import run_simulation
from apps.simulator.scenario import Scenario, load_scenario
from apps.simulator.simulation import SimConfig, Simulation, percentile
from apps.simulator.workload import LengthSpec, TenantSpec

SCENARIOS = Path(__file__).resolve().parent / "scenarios"


def run_scenario(
    name: str, *, horizon_s: float | None = None, overrides: dict[str, Any] | None = None
) -> Simulation:
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    if horizon_s is not None:
        scenario.config.horizon_s = horizon_s
    admission = dict(scenario.admission)
    admission.update(overrides or {})
    return run_simulation(scenario, admission)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _window_mean(simulation: Simulation, tenant: str, start: float, stop: float) -> float | None:
    return _mean([s.tenant_running.get(tenant, 0) for s in simulation.samples if start <= s.time < stop])


def _max_waiting(simulation: Simulation) -> int:
    return max((sum(s.waiting) + s.gateway_queue for s in simulation.samples), default=0)


def _ttft_p99(
    simulation: Simulation, tenants: Sequence[str], start: float = 0.0, stop: float = float("inf")
) -> float | None:
    values = [
        ttft for when, tenant, ttft, _ in simulation.finished if tenant in tenants and start <= when < stop
    ]
    return percentile(values, 99)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(rows: list[tuple[str, Any, Any, str]]) -> str:
    lines = ["| quantity | seed | ours | note |", "|---|---|---|---|"]
    lines += [f"| {name} | {_fmt(seed)} | {_fmt(ours)} | {note} |" for name, seed, ours, note in rows]
    return "\n".join(lines)


# ---- seed 000, Experiment 1 ----------------------------------------------------------------------
def exp1_metrics(pools: Simulation, baseline: Simulation) -> dict[str, Any]:
    guaranteed = ("guaranteed-a", "guaranteed-c")
    tenants_pools = pools.cluster.stats.tenants
    return {
        "pools_max_waiting": max((sum(s.waiting) for s in pools.samples), default=0),
        "pools_mean_waiting": _mean([float(sum(s.waiting)) for s in pools.samples]),
        "baseline_mean_waiting": _mean([float(sum(s.waiting)) for s in baseline.samples]),
        "pools_max_gateway_queue": max((s.gateway_queue for s in pools.samples), default=0),
        "baseline_max_waiting": _max_waiting(baseline),
        "pools_guaranteed_ttft_p99_s": _ttft_p99(pools, guaranteed),
        "baseline_guaranteed_ttft_p99_s": _ttft_p99(baseline, guaranteed),
        "baseline_guaranteed_ttft_p99_end_phase2_s": _ttft_p99(baseline, guaranteed, 50.0, 60.0),
        "pools_guaranteed_rejected": sum(
            tenants_pools[name].rejected for name in guaranteed if name in tenants_pools
        ),
        "pools_spot_rejected": tenants_pools["spot-b"].rejected,
        "pools_spot_running_phase1": _window_mean(pools, "spot-b", 5, 30),
        "pools_spot_running_phase2": _window_mean(pools, "spot-b", 35, 60),
        "pools_spot_running_phase3": _window_mean(pools, "spot-b", 65, 90),
        "pools_slot_fraction": pools.summary()["utilization"]["slot_fraction"],
    }


def run_exp1() -> tuple[dict[str, Any], dict[str, Simulation]]:
    pools = run_scenario("seed000_exp1_token_pools")
    baseline = run_scenario("seed000_exp1_no_admission")
    return exp1_metrics(pools, baseline), {"token_pools": pools, "no_admission": baseline}


def exp1_report(metrics: dict[str, Any]) -> str:
    rows = [
        ("max requests waiting in vLLM, token pools", 0, metrics["pools_max_waiting"],
         "momentary: closed-loop clients that finish together resend together and wait one step"),
        ("mean requests waiting in vLLM: token pools / none", "~0 / grows",
         f"{_fmt(metrics['pools_mean_waiting'])} / {_fmt(metrics['baseline_mean_waiting'])}", "sampled every second"),
        ("max requests held at the gateway for a slot, token pools", "-", metrics["pools_max_gateway_queue"],
         "guaranteed requests queued ahead of spot for the next free slot (check 5), at most 1 s"),
        ("max waiting requests, no admission", 34, metrics["baseline_max_waiting"],
         "depends on how far spot overshoots; ours offers ~10 slots of spot (Poisson) on top of 12 guaranteed"),
        ("guaranteed p99 TTFT (s), token pools", "< 1.2", metrics["pools_guaranteed_ttft_p99_s"],
         "bounded: prefill plus waiting for the next decode step"),
        ("guaranteed p99 TTFT (s), no admission", "19+ (end of phase 2)", metrics["baseline_guaranteed_ttft_p99_s"],
         "grows with the queue; our queue is shorter than the seed's (see above)"),
        ("guaranteed p99 TTFT 50-60 s (s), no admission", "19+", metrics["baseline_guaranteed_ttft_p99_end_phase2_s"], ""),
        ("guaranteed requests rejected, token pools", 0, metrics["pools_guaranteed_rejected"], ""),
        ("spot requests rejected, token pools", "(429s)", metrics["pools_spot_rejected"], ""),
        ("spot running slots 5-30 s / 35-60 s / 65-90 s", "~10 / near 0 / recovers",
         f"{_fmt(metrics['pools_spot_running_phase1'])} / {_fmt(metrics['pools_spot_running_phase2'])} / "
         f"{_fmt(metrics['pools_spot_running_phase3'])}",
         "spot keeps the 4 slots guaranteed traffic leaves free; squeezed, then back at 60 s"),
        ("pool slot utilization, token pools", "~100%", metrics["pools_slot_fraction"], ""),
    ]  # fmt: skip
    return "\n".join(
        [
            "# Seed 000, Experiment 1: cross-class protection",
            "",
            "16 slots; guaranteed-a 6 (closed loop), spot-b ~10 slots of open-loop Poisson load, guaranteed-c 6 from "
            "30 s to 60 s; 64-token prompts and outputs; one replica at ~240 output tokens/s (fixed latency model: "
            "0.5 ms per prompt token, 66.7 ms per decode step). Same seed for both runs.",
            "",
            _table(rows),
            "",
            "Why numbers differ: the seed measured a real vLLM on a DGX Spark with its own load generator; here the "
            "backend is the simulated instance and the load is modelled (guaranteed tenants as 6 closed-loop clients "
            "each, spot as Poisson arrivals), so the baseline's queue depth and latency depend on the spot rate we "
            "chose. The shape is the seed's: with token pools the waiting queue stays near empty, guaranteed TTFT "
            "stays bounded and no guaranteed request is rejected while spot is squeezed and recovers after 60 s; "
            "without admission control the queue and every tenant's latency grow during the overload.",
            "",
            "Plots: `token_pools/timeline.html`, `no_admission/timeline.html` (PNG beside them when kaleido works).",
        ]
    )


# ---- seed 000, Experiment 2 ----------------------------------------------------------------------
def exp2_metrics(pools: Simulation) -> dict[str, Any]:
    admission: Any = pools.cluster.admission
    stats = pools.cluster.stats.tenants
    samples = admission.debt_samples
    result: dict[str, Any] = {}
    for name in ("elastic-copilot", "elastic-synth", "elastic-reports"):
        tenant = stats[name]
        debts = [s.debt[name] for s in samples if name in s.debt]
        result[name] = {
            "completed": tenant.completed,
            "low_priority_denials": tenant.denials.get("pool_contended", 0),
            "other_denials": {k: v for k, v in tenant.denials.items() if k != "pool_contended"},
            "expired_waiting": pools.cluster.stats.tenants[name].lost,
            "peak_debt": max(debts) if debts else None,
            "running_outage": _window_mean(pools, name, 40, 120),
            "ttft_p99_s": percentile(tenant.ttft, 99),
        }
    from apps.policy.priority import priority_weight

    # Formula (1) with no debt or burst: the SLO term alone, as the seed quotes it.
    result["priority_slo_only"] = {
        name: priority_weight("elastic", target, 15250.0)
        for name, target in (
            ("elastic-copilot", 500.0),
            ("elastic-synth", 30000.0),
            ("elastic-reports", 5000.0),
        )
    }
    peak = {name: max((s.priority.get(name, 0.0) for s in samples if 30 <= s.time < 120), default=None)
            for name in ("elastic-copilot", "elastic-synth")}  # fmt: skip
    result["priority_peak_outage"] = peak
    after = [s for s in samples if 165 <= s.time < 170]
    result["debt_50s_after_recovery"] = after[-1].debt if after else {}
    return result


def run_exp2() -> tuple[dict[str, Any], dict[str, Simulation]]:
    pools = run_scenario("seed000_exp2_token_pools")
    return exp2_metrics(pools), {"token_pools": pools}


def exp2_report(metrics: dict[str, Any]) -> str:
    c, s, r = metrics["elastic-copilot"], metrics["elastic-synth"], metrics["elastic-reports"]
    prio = metrics["priority_slo_only"]
    peak = metrics["priority_peak_outage"]
    rows = [
        ("priority w (no debt): copilot / synth / reports", "93.8 / 20.3 / ~60",
         f"{_fmt(prio['elastic-copilot'], 1)} / {_fmt(prio['elastic-synth'], 1)} / {_fmt(prio['elastic-reports'], 1)}",
         "formula (1) from apps.policy with the pinned pool-average SLO"),
        ("peak priority in the outage: copilot / synth", "- / 83.2",
         f"{_fmt(peak['elastic-copilot'], 1)} / {_fmt(peak['elastic-synth'], 1)}", "debt raises both; copilot stays ahead"),
        ("successful requests: copilot / synth / reports", "700 / 381 / 60",
         f"{c['completed']} / {s['completed']} / {r['completed']}", "our backend runs ~240 tok/s of 32-176-token requests"),
        ("low-priority (pool_contended) denials: copilot / synth / reports", "0 / 317 / 22",
         f"{c['low_priority_denials']} / {s['low_priority_denials']} / {r['low_priority_denials']}",
         "copilot never loses on priority; synth absorbs the contention"),
        ("peak debt: copilot / synth / reports", "0.607 / 0.775 / 0.414",
         f"{_fmt(c['peak_debt'], 3)} / {_fmt(s['peak_debt'], 3)} / {_fmt(r['peak_debt'], 3)}",
         "ours: gap counts only unmet demand (policy package); synth's is higher, as in the seed"),
        ("running slots during the outage: copilot / synth", "5-7 / 2-3",
         f"{_fmt(c['running_outage'], 1)} / {_fmt(s['running_outage'], 1)}", "mean over 40-120 s"),
        ("debt 50 s after recovery", "near zero",
         ", ".join(f"{k}: {v:.2f}" for k, v in metrics["debt_50s_after_recovery"].items()),
         "negative = credit for running above the 5-slot baseline"),
        ("p99 TTFT (s): copilot / synth / reports", "mostly within SLO",
         f"{_fmt(c['ttft_p99_s'])} / {_fmt(s['ttft_p99_s'])} / {_fmt(r['ttft_p99_s'])}", ""),
    ]  # fmt: skip
    return "\n".join(
        [
            "# Seed 000, Experiment 2: SLO-aware fair share",
            "",
            "Elastic copilot (5 slots, 500 ms), synth (5 slots, 30 s), reports (5 slots, 5 s, joins at 210 s), each "
            "driven by 6 closed-loop clients that back off by Retry-After (0.25 s after a timed-out wait); capacity drops from 16 to 8 slots between "
            "30 s and 120 s; 300 s; prompts and outputs uniform in 32..176 tokens; pool-average SLO pinned at the "
            "seed's 15,250 ms; debt EWMA gamma_d = 0.7 ticked every second.",
            "",
            _table(rows),
            "",
            "Other denials (concurrency limit: a client beyond the 5-slot baseline when the pool has no idle slot to "
            f"borrow): copilot {c['other_denials']}, synth {s['other_denials']}, reports {r['other_denials']}. "
            f"Requests that waited for a slot longer than the 1 s acquire timeout: copilot {c['expired_waiting']}, "
            f"synth {s['expired_waiting']}, reports {r['expired_waiting']}.",
            "",
            "Why numbers differ: request counts follow from our modelled backend and clients (the seed's generator "
            "and retry behaviour are not published); debt values follow the policy package's gap definition "
            "(only unmet demand counts, and running above baseline earns credit), so they are smaller than the "
            "seed's while keeping its order (synth > copilot) and its decay after recovery.",
            "",
            "Plots: `token_pools/timeline.html` and `token_pools/dynamics.html` (debt and priority).",
        ]
    )


# ---- seed 002 --------------------------------------------------------------------------------------
def drr_config(horizon_s: float = 120.0, seed: int = 3) -> tuple[SimConfig, dict[str, Any]]:
    """Tenant B (weight 1) alone, then tenant A (weight 2) bursts from 40 s to 80 s; budget 32."""
    prompt, output = LengthSpec("fixed", 256), LengthSpec("fixed", 64)
    config = SimConfig(
        latency_model="fixed",
        prefill_ms_per_token=0.05,
        decode_ms_per_token=25.0,
        num_instances=1,
        max_num_seqs=64,
        tenants=[
            TenantSpec("tenant-b", rate=30.0, stop=horizon_s, input=prompt, output=output),
            TenantSpec("tenant-a", rate=30.0, start=40.0, stop=80.0, input=prompt, output=output),
        ],
        horizon_s=horizon_s,
        seed=seed,
        sample_interval_s=1.0,
    )
    admission = {"policy": "drr", "budget": 32, "workers": 1, "acquire_timeout_s": 1.0,
                 "flows": {"tenant-a": {"weight": 2, "queue_max": 8}, "tenant-b": {"weight": 1, "queue_max": 8}}}  # fmt: skip
    return config, admission


def drr_metrics(simulation: Simulation) -> dict[str, Any]:
    finished = simulation.finished
    contended = [tenant for when, tenant, _, _ in finished if 45 <= when < 80]
    alone = [tenant for when, tenant, _, _ in finished if 5 <= when < 40]
    share_a = contended.count("tenant-a") / len(contended) if contended else None
    samples_alone = [sum(s.running) for s in simulation.samples if 5 <= s.time < 40]
    return {
        "share_a_contended": share_a,
        "share_b_contended": None if share_a is None else 1 - share_a,
        "b_alone_mean_running": _mean([float(v) for v in samples_alone]),
        "b_alone_completions": len(alone),
        "budget": 32,
        "rejected_by_tenant": {n: t.rejected for n, t in simulation.cluster.stats.tenants.items()},
    }


def run_drr() -> tuple[dict[str, Any], dict[str, Simulation]]:
    config, admission = drr_config()
    simulation = run_simulation(Scenario("seed002-drr", config), admission)
    return drr_metrics(simulation), {"drr": simulation}


def aimd_config(
    initial_cap: int | None,
    static_cap: int | None,
    horizon_s: float = 180.0,
    seed: int = 4,
    acquire_timeout_s: float = 30.0,
) -> tuple[SimConfig, dict[str, Any]]:
    """Seed 002's noisy-neighbour sweep on a roofline H100 pair: tenant-a (weight 2) and tenant-b (weight 1)
    offered more than the GPUs serve; AIMD on (initial cap given) or a static cap."""
    config = SimConfig(
        latency_model="roofline",
        gpu="h100",
        model="qwen/qwen3-8b",
        num_instances=2,
        max_num_seqs=128,
        routing="least-loaded",
        tenants=[
            TenantSpec(
                "tenant-a",
                rate=30.0,
                stop=horizon_s,
                input=LengthSpec("lognormal", mean=1024, sigma=0.5, low=16, high=8192),
                output=LengthSpec("lognormal", mean=512, sigma=0.5, low=16, high=4096),
            ),  # fmt: skip
            TenantSpec(
                "tenant-b",
                rate=30.0,
                stop=horizon_s,
                input=LengthSpec("lognormal", mean=1024, sigma=0.5, low=16, high=8192),
                output=LengthSpec("lognormal", mean=512, sigma=0.5, low=16, high=4096),
            ),  # fmt: skip
        ],
        horizon_s=horizon_s,
        seed=seed,
        sample_interval_s=5.0,
    )
    flows = {"tenant-a": {"weight": 2, "queue_max": 8}, "tenant-b": {"weight": 1, "queue_max": 2}}
    admission: dict[str, Any] = {
        "policy": "drr",
        "workers": 2,
        "acquire_timeout_s": acquire_timeout_s,
        "flows": flows,
    }
    if initial_cap is not None:
        admission["budget"] = initial_cap * 2
        admission["aimd"] = {"enabled": True, "target_p99_ttft_s": 2.0, "tick_s": 5.0, "window_s": 30.0,
                             "cap_per_worker_min": min(16, initial_cap), "cap_per_worker_max": max(128, initial_cap),
                             "cap_per_worker_initial": initial_cap, "target_band_pct": 0.2, "cooldown_ticks": 3}  # fmt: skip
    else:
        admission["budget"] = (static_cap or 32) * 2
    return config, admission


def aimd_point(simulation: Simulation) -> dict[str, Any]:
    stats = simulation.cluster.stats
    ttft = [v for t in stats.tenants.values() for v in t.ttft]
    e2e = [v for t in stats.tenants.values() for v in t.e2e]
    admission: Any = simulation.cluster.admission
    caps = [s.cap for s in admission.trace.samples] if admission.aimd is not None else []
    horizon = simulation.loop.time
    steady = [t for when, _, t, _ in simulation.finished if when >= horizon - 60]
    samples = admission.trace.samples if admission.aimd is not None else []
    in_band = [
        s for s in samples if s.p99_s is not None and admission.aimd.lower <= s.p99_s <= admission.aimd.upper
    ]
    return {
        "ttft_p99_last60_s": percentile(steady, 99),
        "ticks_in_band": len(in_band) / len(samples) if samples else None,
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p99_s": percentile(e2e, 99),
        "completed": stats.completed,
        "rejected": stats.rejected,
        "expired": stats.lost.get("acquire_timeout", 0),
        "output_tokens_per_s": sum(i.output_tokens for i in simulation.cluster.instances)
        / simulation.loop.time,
        "final_cap": caps[-1] if caps else None,
    }


def run_aimd(
    caps: Sequence[int] = (4, 8, 16, 32, 64, 128, 256), horizon_s: float = 180.0
) -> tuple[dict[str, Any], dict[str, Simulation]]:
    sweep: dict[str, Any] = {"aimd": {}, "static": {}}
    runs: dict[str, Simulation] = {}
    for cap in caps:
        config, admission = aimd_config(cap, None, horizon_s)
        simulation = run_simulation(Scenario(f"aimd-{cap}", config), admission)
        sweep["aimd"][cap] = aimd_point(simulation)
        runs[f"aimd_{cap}"] = simulation
    for cap in caps:
        config, admission = aimd_config(None, cap, horizon_s)
        simulation = run_simulation(Scenario(f"static-{cap}", config), admission)
        sweep["static"][cap] = aimd_point(simulation)
    return sweep, runs


def drr_report(metrics: dict[str, Any]) -> str:
    rows = [
        ("tenant-a share of completions while both are active", "~2/3", metrics["share_a_contended"], "weights 2:1"),
        ("tenant-b share while both are active", "~1/3", metrics["share_b_contended"], ""),
        ("running requests while tenant-b is alone (budget 32)", "32 (uses the whole budget)",
         metrics["b_alone_mean_running"], "work-conserving DRR"),
        ("rejections (queue full / 504) by tenant", "B's overflow", metrics["rejected_by_tenant"], ""),
    ]  # fmt: skip
    return "\n".join(
        [
            "# Seed 002: weighted DRR over one global budget",
            "",
            "Budget 32 in flight; tenant-b (weight 1) offers 30 req/s for the whole run, tenant-a (weight 2) offers "
            "30 req/s from 40 s to 80 s; queue_max 8 each, acquire timeout 1 s; 256-token prompts, 64-token outputs "
            "on one fixed-latency instance (25 ms per decode step).",
            "",
            _table(rows),
            "",
            "The seed shows these shapes on its dashboards without exact counts; ours are measured on completions "
            "(the dispatch split under contention) and on sampled running requests. Rejection counts depend on the "
            "offered rates we chose (each tenant offers far more than the budget serves).",
            "",
            "Plots: `drr/timeline.html`.",
        ]
    )


def aimd_report(sweep: dict[str, Any]) -> str:
    lines = [
        "# Seed 002: AIMD sweep against a static-cap sweep",
        "",
        "Two H100 instances (roofline, qwen/qwen3-8b, 128 slots each), two tenants (DRR weights 2 and 1, queue_max 8 "
        "and 2) each offering 30 req/s of lognormal 1024-token prompts and 512-token outputs for 180 s (far more "
        "than the GPUs serve); acquire timeout 30 s (the post-4 setting of the sweeps); target p99 TTFT 2 s, tick "
        "5 s, window 30 s, band 20 %, cooldown 3 ticks, halving on a breach, floor min(16, initial), ceiling "
        "max(128, initial) per worker. TTFT is the gateway's: queue wait included.",
        "",
        "| cap per worker (initial) | static p99 TTFT (s) | static p99 TTFT, last 60 s | static E2E p99 (s) | static tok/s "
        "| AIMD p99 TTFT (s) | AIMD p99 TTFT, last 60 s | AIMD final cap | AIMD ticks in band | AIMD tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cap, point in sweep["aimd"].items():
        static = sweep["static"].get(cap, {})
        lines.append(
            f"| {cap} | {_fmt(static.get('ttft_p99_s'))} | {_fmt(static.get('ttft_p99_last60_s'))} "
            f"| {_fmt(static.get('e2e_p99_s'))} | {_fmt(static.get('output_tokens_per_s'), 0)} "
            f"| {_fmt(point['ttft_p99_s'])} | {_fmt(point['ttft_p99_last60_s'])} | {_fmt(point['final_cap'])} "
            f"| {_fmt(point['ticks_in_band'])} | {_fmt(point['output_tokens_per_s'], 0)} |"
        )
    static_ttft = {cap: p["ttft_p99_s"] for cap, p in sweep["static"].items() if p["ttft_p99_s"] is not None}
    best = min(static_ttft, key=lambda cap: static_ttft[cap]) if static_ttft else None
    top = max(sweep["aimd"]) if sweep["aimd"] else None
    if (
        top is not None
        and sweep["static"].get(top, {}).get("ttft_p99_last60_s")
        and sweep["aimd"][top]["ttft_p99_last60_s"]
    ):
        ours_static = sweep["static"][top]["ttft_p99_last60_s"]
        ours_aimd = sweep["aimd"][top]["ttft_p99_last60_s"]
        lines += [
            "",
            f"In overload (cap {top} per worker), p99 TTFT over the last 60 s is {ours_aimd:.2f} s with the "
            f"controller against {ours_static:.2f} s with the static cap: {ours_static / ours_aimd:.1f}x lower "
            "(seed: about 3x).",
        ]
    lines += [
        "",
        f"Static sweep: p99 TTFT is lowest at cap {best} per worker and higher on both sides (the seed's U-curve): "
        "small caps make requests wait in the gateway queue, large ones make them wait inside vLLM for a slot.",
        "",
        "Seed 002 reports, on its EKS cluster: the U-curve; about 3x lower TTFT with the controller than without "
        "in overload; a sweet spot near 32 per worker without the controller; the controller defending the 2 s "
        "target with repeated small breaches; and the death spiral at the floor when queue wait dominates TTFT. "
        "Where ours differs: our absolute numbers come from the roofline model (a higher sweet spot, since a "
        "simulated H100 serves more than the seed's GPUs); with halving and a 30 s window, a controller started "
        "far above the sweet spot keeps cutting on stale samples after its cooldown and overshoots to the floor, "
        "and one started below it holds at its floor because queue wait keeps p99 above the target (the spiral "
        "the seed describes; its cure, a short acquire timeout, is `acquire_timeout_s` in the scenario).",
        "",
        "Plots: `sweep.html` (both sweeps), `aimd_256/aimd.html` and `aimd_64/aimd.html` (cap and p99 over time).",
    ]
    return "\n".join(lines)


def sweep_figure(sweep: dict[str, Any]) -> Any:
    """p99 TTFT and output throughput against the cap per worker, static and with AIMD."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=1, cols=2, subplot_titles=("p99 TTFT (s), log scale", "output tokens/s"))
    for mode, color in (("static", "#d62728"), ("aimd", "#1f77b4")):
        caps = list(sweep[mode])
        figure.add_trace(go.Scatter(x=caps, y=[sweep[mode][c]["ttft_p99_s"] for c in caps], name=f"{mode} p99 TTFT",
                                    line={"color": color}), row=1, col=1)  # fmt: skip
        figure.add_trace(go.Scatter(x=caps, y=[sweep[mode][c]["output_tokens_per_s"] for c in caps],
                                    name=f"{mode} tok/s", line={"color": color, "dash": "dot"}), row=1, col=2)  # fmt: skip
    figure.add_hline(y=2.0, line={"dash": "dash", "color": "#999"}, row=1, col=1)
    figure.update_xaxes(type="log", title_text="cap per worker (initial for AIMD)")
    figure.update_yaxes(type="log", row=1, col=1)
    figure.update_layout(title="seed 002 sweep: static cap vs AIMD", height=450, template="plotly_white")
    return figure


EXPERIMENTS = {
    "exp1": (run_exp1, exp1_report),
    "exp2": (run_exp2, exp2_report),
    "drr": (run_drr, drr_report),
    "aimd": (run_aimd, aimd_report),
}


def write_experiment(name: str, out: Path, png: bool = True) -> Path:
    from apps.simulator.report import write_plots

    runner, reporter = EXPERIMENTS[name]
    metrics, runs = runner()
    directory = out / name
    directory.mkdir(parents=True, exist_ok=True)
    for label, simulation in runs.items():
        if simulation.samples and (name != "aimd" or label in ("aimd_64", "aimd_256")):
            write_plots(simulation, directory / label, title=f"{name}: {label}", png=png)
    if name == "aimd":
        from apps.simulator.report import write_figure

        write_figure(sweep_figure(metrics), directory, "sweep", png)
    report = directory / "report.md"
    report.write_text(reporter(metrics) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apps.simulator.experiments")
    parser.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    parser.add_argument("--out", default="var/experiments", help="output folder (default var/experiments)")
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args(argv)
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    for name in names:
        report = write_experiment(name, Path(args.out), png=not args.no_png)
        print(report.read_text())
        print(f"written: {report}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


__all__ = ["run_exp1", "run_exp2", "run_drr", "run_aimd", "main"]
