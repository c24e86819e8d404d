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
from apps.simulator.experiment_seed002 import aimd_report, drr_report, run_aimd, run_drr, sweep_figure
from apps.simulator.experiment_tables import fmt, mean, table
from apps.simulator.scenario import load_scenario
from apps.simulator.simulation import Simulation, percentile

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


def _window_mean(simulation: Simulation, tenant: str, start: float, stop: float) -> float | None:
    return mean([s.tenant_running.get(tenant, 0) for s in simulation.samples if start <= s.time < stop])


def _max_waiting(simulation: Simulation) -> int:
    return max((sum(s.waiting) + s.gateway_queue for s in simulation.samples), default=0)


def _ttft_p99(
    simulation: Simulation, tenants: Sequence[str], start: float = 0.0, stop: float = float("inf")
) -> float | None:
    values = [
        ttft for when, tenant, ttft, _ in simulation.finished if tenant in tenants and start <= when < stop
    ]
    return percentile(values, 99)


# ---- seed 000, Experiment 1 ----------------------------------------------------------------------
def exp1_metrics(pools: Simulation, baseline: Simulation) -> dict[str, Any]:
    guaranteed = ("guaranteed-a", "guaranteed-c")
    tenants_pools = pools.cluster.stats.tenants
    return {
        "pools_max_waiting": max((sum(s.waiting) for s in pools.samples), default=0),
        "pools_mean_waiting": mean([float(sum(s.waiting)) for s in pools.samples]),
        "baseline_mean_waiting": mean([float(sum(s.waiting)) for s in baseline.samples]),
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
         f"{fmt(metrics['pools_mean_waiting'])} / {fmt(metrics['baseline_mean_waiting'])}", "sampled every second"),
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
         f"{fmt(metrics['pools_spot_running_phase1'])} / {fmt(metrics['pools_spot_running_phase2'])} / "
         f"{fmt(metrics['pools_spot_running_phase3'])}",
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
            table(rows),
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

    # Formula (1) with no debt or burst: the SLO term alone, as the seed quotes it, from the scenario's
    # entitlements and the pool-average SLO the run's ledger used.
    mean_slo_ms = admission.ledger.mean_slo_ms
    result["priority_slo_only"] = {
        tenant.name: priority_weight(str(tenant.entitlement.get("service_class", "elastic")),
                                     float(tenant.entitlement.get("slo_target_ms", tenant.slo_target_ms or 1000.0)),
                                     mean_slo_ms)
        for tenant in pools.config.tenants
    }
    result["mean_slo_ms"] = mean_slo_ms
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
         f"{fmt(prio['elastic-copilot'], 1)} / {fmt(prio['elastic-synth'], 1)} / {fmt(prio['elastic-reports'], 1)}",
         f"formula (1) from apps.policy: the scenario's SLOs, the run's pool-average SLO {metrics['mean_slo_ms']:g} ms"),
        ("peak priority in the outage: copilot / synth", "- / 83.2",
         f"{fmt(peak['elastic-copilot'], 1)} / {fmt(peak['elastic-synth'], 1)}", "debt raises both; copilot stays ahead"),
        ("successful requests: copilot / synth / reports", "700 / 381 / 60",
         f"{c['completed']} / {s['completed']} / {r['completed']}", "our backend runs ~240 tok/s of 32-176-token requests"),
        ("low-priority (pool_contended) denials: copilot / synth / reports", "0 / 317 / 22",
         f"{c['low_priority_denials']} / {s['low_priority_denials']} / {r['low_priority_denials']}",
         "copilot never loses on priority; synth absorbs the contention"),
        ("peak debt: copilot / synth / reports", "0.607 / 0.775 / 0.414",
         f"{fmt(c['peak_debt'], 3)} / {fmt(s['peak_debt'], 3)} / {fmt(r['peak_debt'], 3)}",
         "ours: gap counts only unmet demand (policy package); synth's is higher, as in the seed"),
        ("running slots during the outage: copilot / synth", "5-7 / 2-3",
         f"{fmt(c['running_outage'], 1)} / {fmt(s['running_outage'], 1)}", "mean over 40-120 s"),
        ("debt 50 s after recovery", "near zero",
         ", ".join(f"{k}: {v:.2f}" for k, v in metrics["debt_50s_after_recovery"].items()),
         "negative = credit for running above the 5-slot baseline"),
        ("p99 TTFT (s): copilot / synth / reports", "mostly within SLO",
         f"{fmt(c['ttft_p99_s'])} / {fmt(s['ttft_p99_s'])} / {fmt(r['ttft_p99_s'])}", ""),
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
            table(rows),
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
