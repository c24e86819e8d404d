"""Seed 002's experiments: the DRR gate's shares under a burst, and the AIMD sweep (static caps at two acquire
timeouts, AIMD from each initial cap, ablations that each undo one fix, and the token-pools machine with the
controller's cap as its budget, `apps.simulator.experiment_budget`).

    python -m apps.simulator.experiments drr|aimd --out DIR
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from apps.policy.aimd import DEFAULT_TTFT_BUCKETS_S
from apps.simulator.cli import run_simulation
from apps.simulator.experiment_budget import machine_point, machine_scenario, machine_table
from apps.simulator.experiment_tables import fmt, mean, table
from apps.simulator.scenario import Scenario
from apps.simulator.simulation import SimConfig, Simulation, percentile
from apps.simulator.workload import LengthSpec, TenantSpec


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
        "b_alone_mean_running": mean([float(v) for v in samples_alone]),
        "b_alone_completions": len(alone),
        "budget": 32,
        "rejected_by_tenant": {n: t.rejected for n, t in simulation.cluster.stats.tenants.items()},
    }


def run_drr() -> tuple[dict[str, Any], dict[str, Simulation]]:
    config, admission = drr_config()
    simulation = run_simulation(Scenario("seed002-drr", config), admission)
    return drr_metrics(simulation), {"drr": simulation}


AIMD_TARGET_S = 2.0
AIMD_BAND = 0.2
AIMD_CAPS = (4, 8, 16, 32, 64, 128, 256)


def aimd_config(
    initial_cap: int | None,
    static_cap: int | None,
    horizon_s: float = 1200.0,
    seed: int = 4,
    acquire_timeout_s: float = 1.0,
    cap_per_worker_max: int = 256,
    factor: float = 0.5,
    histogram_buckets_s: Sequence[float] | None = None,
) -> tuple[SimConfig, dict[str, Any]]:
    """Seed 002's noisy-neighbour sweep on a roofline H100 pair: tenant-a (weight 2, the paying tier's queue_max 8)
    and tenant-b (weight 1, the free tier's queue_max 2) each offered 30 req/s, far more than the GPUs serve;
    AIMD on (initial cap given) or a static cap.

    Defaults are the seed's final configuration (post #4 plus the post #5 update): acquire timeout 1 s, target
    p99 TTFT 2 s, tick 5 s, window 30 s, band 20 %, cooldown 3 ticks after decreases, halving, floor 16 per
    worker (the initial cap when it is lower: 4 and 8 in the sweep), demand gate counting in flight. One
    deviation, explained in the report: the ceiling is 256 per worker, not 128, because on this simulated
    H100 pair the 2 s operating point lies at ~137 per worker (just past the instances' 128 slots)."""
    config = SimConfig(
        latency_model="roofline",
        gpu="h100",
        model="qwen/qwen3-8b",
        num_instances=2,
        max_num_seqs=128,
        routing="least-loaded",
        tenants=[  # the same offered load for both: only their weights and queues differ (below)
            TenantSpec(
                name,
                rate=30.0,
                stop=horizon_s,
                input=LengthSpec("lognormal", mean=1024, sigma=0.5, low=16, high=8192),
                output=LengthSpec("lognormal", mean=512, sigma=0.5, low=16, high=4096),
            )
            for name in ("tenant-a", "tenant-b")
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
        admission["aimd"] = {"enabled": True, "target_p99_ttft_s": AIMD_TARGET_S, "tick_s": 5.0, "window_s": 30.0,
                             "cap_per_worker_min": min(16, initial_cap),
                             "cap_per_worker_max": max(cap_per_worker_max, initial_cap),
                             "cap_per_worker_initial": initial_cap, "target_band_pct": AIMD_BAND, "cooldown_ticks": 3,
                             "mode": "aimd", "factor": factor}  # fmt: skip
        if histogram_buckets_s is not None:
            admission["aimd"]["histogram_buckets_s"] = list(histogram_buckets_s)
    else:
        admission["budget"] = (static_cap or 32) * 2
    return config, admission


def aimd_point(simulation: Simulation, tail_s: float = 300.0) -> dict[str, Any]:
    """Whole-run and tail (the last `tail_s`) figures; p99 TTFT is exact, over the TTFTs of completed requests
    (gateway arrival to first token, queue wait included), not the controller's histogram estimate."""
    stats = simulation.cluster.stats
    ttft = [v for t in stats.tenants.values() for v in t.ttft]
    e2e = [v for t in stats.tenants.values() for v in t.e2e]
    admission: Any = simulation.cluster.admission
    horizon = simulation.loop.time
    samples = admission.trace.samples if admission.aimd is not None else []
    caps = [s.cap for s in samples]
    tail_start = horizon - tail_s
    tail_samples = [s for s in samples if s.time > tail_start]
    lower, upper = AIMD_TARGET_S * (1 - AIMD_BAND), AIMD_TARGET_S * (1 + AIMD_BAND)

    def _in_band(chosen: list[Any]) -> float | None:
        if not chosen:
            return None
        return sum(1 for s in chosen if s.p99_s is not None and lower <= s.p99_s <= upper) / len(chosen)

    tail_ttft = [t for when, _, t, _ in simulation.finished if when >= tail_start]
    tail_p99 = percentile(tail_ttft, 99)
    tail_caps = [s.cap for s in tail_samples]
    return {
        "ttft_p99_last60_s": percentile(
            [t for when, _, t, _ in simulation.finished if when >= horizon - 60], 99
        ),
        "ttft_p99_tail_s": tail_p99,
        "tail_in_band": tail_p99 is not None and lower <= tail_p99 <= upper,
        "tail_s": tail_s,
        "ticks_in_band": _in_band(samples),
        "tail_ticks_in_band": _in_band(tail_samples),
        "tail_cap_min": min(tail_caps) if tail_caps else None,
        "tail_cap_max": max(tail_caps) if tail_caps else None,
        "tail_cap_mean": mean([float(c) for c in tail_caps]),
        "decreases": sum(1 for s in samples if s.action == "decrease"),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p99_s": percentile(e2e, 99),
        "completed": stats.completed,
        "rejected": stats.rejected,
        "expired": stats.lost.get("acquire_timeout", 0),
        "output_tokens_per_s": sum(i.output_tokens for i in simulation.cluster.instances)
        / simulation.loop.time,
        "final_cap": caps[-1] if caps else None,
    }


def _aimd_run(label: str, initial: int | None, static: int | None, horizon_s: float, tail_s: float,
              **options: Any) -> tuple[dict[str, Any], Simulation]:  # fmt: skip
    config, admission = aimd_config(initial, static, horizon_s, **options)
    simulation = run_simulation(Scenario(label, config), admission)
    return aimd_point(simulation, tail_s), simulation


def run_aimd(
    caps: Sequence[int] = AIMD_CAPS, horizon_s: float = 1200.0, tail_s: float = 300.0
) -> tuple[dict[str, Any], dict[str, Simulation]]:
    """The AIMD sweep (final config) beside static sweeps at the final 1 s acquire timeout and at the post-4
    30 s one (the U-curve), plus ablations from initial cap 16 that each undo one fix."""
    sweep: dict[str, Any] = {"aimd": {}, "static": {}, "static_30s": {}, "ablations": {}, "horizon_s": horizon_s,
                             "tail_s": tail_s}  # fmt: skip
    runs: dict[str, Simulation] = {}
    for cap in caps:
        sweep["aimd"][cap], runs[f"aimd_{cap}"] = _aimd_run(f"aimd-{cap}", cap, None, horizon_s, tail_s)
        sweep["static"][cap], _ = _aimd_run(f"static-{cap}", None, cap, horizon_s, tail_s)
        sweep["static_30s"][cap], _ = _aimd_run(f"static30-{cap}", None, cap, horizon_s, tail_s,
                                                acquire_timeout_s=30.0)  # fmt: skip
    ablations: dict[str, dict[str, Any]] = {
        "the policy's default TTFT buckets (none inside the band)": {"histogram_buckets_s": DEFAULT_TTFT_BUCKETS_S},
        "acquire timeout 30 s (post #4)": {"acquire_timeout_s": 30.0},
        "ceiling 128 per worker (the seed's)": {"cap_per_worker_max": 128},
    }  # fmt: skip
    for name, options in ablations.items():
        sweep["ablations"][name], _ = _aimd_run(f"ablation-{name}", 16, None, horizon_s, tail_s, **options)
    lower, upper = AIMD_TARGET_S * (1 - AIMD_BAND), AIMD_TARGET_S * (1 + AIMD_BAND)
    sweep["machine"] = {}
    for cap in caps:
        config, spec = machine_scenario(*aimd_config(cap, None, horizon_s))
        simulation = run_simulation(Scenario(f"machine-{cap}", config), spec)
        sweep["machine"][cap] = machine_point(simulation, tail_s, lower, upper)
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
            table(rows),
            "",
            "The seed shows these shapes on its dashboards without exact counts; ours are measured on completions "
            "(the dispatch split under contention) and on sampled running requests. Rejection counts depend on the "
            "offered rates we chose (each tenant offers far more than the budget serves).",
            "",
            "Plots: `drr/timeline.html`.",
        ]
    )


def _best_cap(points: dict[Any, Any], key: str = "ttft_p99_tail_s") -> Any:
    values = {cap: point[key] for cap, point in points.items() if point.get(key) is not None}
    return min(values, key=lambda cap: values[cap]) if values else None


def _aimd_fixes_text() -> str:
    return (
        "Why the controller did not hold p99 near the target before, and what changed (the ablation rows above "
        "each undo one change, from initial cap 16):\n\n"
        "1. **The controller's histogram could not see the band.** Its p99 is a Prometheus-style estimate, "
        "linear inside a bucket, and the default buckets jump from 1.0 s to 2.5 s: the whole band (1.6..2.4 s) "
        "sits inside one bucket. With a short acquire timeout most served requests wait just under 1 s in the "
        "queue, the window's TTFTs crowd just above 1.0 s, and the interpolated p99 reads 1.6..2.5 s while the "
        'true p99 is ~1.05 s: the controller holds ("in band") or cuts, and sits at its floor with a third of '
        "the throughput. The simulator's adapter now adds the band edges and the target as bucket bounds "
        "(`apps.policy.AimdController.histogram_bounds`; `admission.aimd.histogram_buckets_s` overrides), which makes every "
        "decision the one the exact p99 would give (estimate > upper exactly when more than 1 % of the window is "
        "above upper). `apps/gateway/scheduler.py` and `apps/gateway/metrics.py` use the same default buckets, "
        "so the gateway's controller has the same blind spot.\n"
        "2. **Acquire timeout 1 s (post #5), enforced at each request's own deadline.** With 30 s, queue wait "
        "keeps p99 at ~3 s at the floor (the seed's death spiral; with queue_max 8/2 ours is 3 s, the seed's "
        "queue_max 16 first deploy saw 17 s). The adapter used to sweep the queue every timeout/4, which let "
        "queue wait run to 1.25 s; it now expires each request at enqueue + timeout.\n"
        "3. **Ceiling 256 per worker instead of the seed's 128.** On this simulated H100 pair, with a 1 s timeout, "
        "p99 TTFT is ~1 s (queue wait) for every cap up to the instances' 128 slots and climbs ~0.1 s per extra "
        "cap unit beyond them; 2 s is reached at ~137 per worker. With the seed's ceiling the controller climbs "
        "to 128 and holds p99 at ~0.85 s, under the target but under the band too (ablation row). The seed: "
        '"cap_per_worker_max is a budget for the controller to explore inside, not a ceiling to hit".\n'
        "4. **Runs long enough for additive increase.** +1 per worker every 5 s takes ~130 ticks (~11 min) from a "
        "cap of 4 to ~137, so the runs last 20 min and the tail is the last 5 min (the seed's runs were short, so "
        "its AISD sweep still showed the starting cap)."
    )


def aimd_report(sweep: dict[str, Any]) -> str:
    horizon, tail = sweep.get("horizon_s", 1200.0), sweep.get("tail_s", 300.0)
    lower, upper = AIMD_TARGET_S * (1 - AIMD_BAND), AIMD_TARGET_S * (1 + AIMD_BAND)
    lines = [
        "# Seed 002: AIMD sweep against a static-cap sweep",
        "",
        "Two H100 instances (roofline, qwen/qwen3-8b, 128 slots each), two tenants each offering 30 req/s of "
        f"lognormal 1024-token prompts and 512-token outputs for {horizon:.0f} s (far more than the GPUs serve): "
        "tenant-a paying (DRR weight 2, queue_max 8), tenant-b free (weight 1, queue_max 2). The seed's final "
        f"configuration: acquire timeout 1 s, target p99 TTFT {AIMD_TARGET_S:.0f} s, tick 5 s, window 30 s, "
        f"band +-{AIMD_BAND:.0%} ({lower:.1f}..{upper:.1f} s), cooldown 3 ticks after a decrease only, halving on a "
        "breach (multiplicative decrease restored), +1 per tick while there is demand (in flight or queued), floor "
        "16 per worker (4 and 8 for those initial caps); ceiling 256 per worker (see below). TTFT is the "
        "gateway's, from arrival to first token, queue wait included; every p99 below is exact, over completed "
        f'requests, and "tail" is the last {tail:.0f} s.',
        "",
        "| cap per worker (initial) | static 30 s timeout: p99 TTFT tail (s) | static 1 s: p99 TTFT tail (s) "
        "| static 1 s tok/s | AIMD: p99 TTFT whole run (s) | AIMD: p99 TTFT tail (s) | AIMD tail in band "
        "| AIMD cap in tail (min..max) | AIMD ticks in band, tail | AIMD decreases | AIMD tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cap, point in sweep["aimd"].items():
        static = sweep["static"].get(cap, {})
        static30 = sweep.get("static_30s", {}).get(cap, {})
        lines.append(
            f"| {cap} | {fmt(static30.get('ttft_p99_tail_s'))} | {fmt(static.get('ttft_p99_tail_s'))} "
            f"| {fmt(static.get('output_tokens_per_s'), 0)} | {fmt(point['ttft_p99_s'])} "
            f"| {fmt(point['ttft_p99_tail_s'])} | {'yes' if point['tail_in_band'] else 'no'} "
            f"| {fmt(point['tail_cap_min'])}..{fmt(point['tail_cap_max'])} | {fmt(point['tail_ticks_in_band'])} "
            f"| {point['decreases']} | {fmt(point['output_tokens_per_s'], 0)} |"
        )
    if sweep.get("machine"):
        lines += machine_table(sweep["machine"], fmt)
    ablations = sweep.get("ablations") or {}
    if ablations:
        lines += [
            "",
            "Ablations, AIMD from initial cap 16, each undoing one change:",
            "",
            '| variant | p99 TTFT tail (s) | tail in band | cap in tail | controller\'s ticks "in band", tail | tok/s |',
            "|---|---|---|---|---|---|",
        ]
        for name, point in ablations.items():
            lines.append(
                f"| {name} | {fmt(point['ttft_p99_tail_s'])} | {'yes' if point['tail_in_band'] else 'no'} "
                f"| {fmt(point['tail_cap_min'])}..{fmt(point['tail_cap_max'])} "
                f"| {fmt(point['tail_ticks_in_band'])} | {fmt(point['output_tokens_per_s'], 0)} |"
            )
    static30 = sweep.get("static_30s", {})
    best30 = _best_cap(static30)
    top = max(sweep["aimd"]) if sweep["aimd"] else None
    in_band = [cap for cap, point in sweep["aimd"].items() if point["tail_in_band"]]
    tails = [
        point["ttft_p99_tail_s"] for point in sweep["aimd"].values() if point["ttft_p99_tail_s"] is not None
    ]
    # Runs that held one cap through the tail; a run cut inside its tail is still climbing back (sawtooth).
    parked = [p["tail_cap_min"] for p in sweep["aimd"].values() if p["tail_cap_min"] is not None
              and p["tail_cap_min"] == p["tail_cap_max"]]  # fmt: skip
    sawtooth = [cap for cap, p in sweep["aimd"].items() if p["tail_cap_min"] != p["tail_cap_max"]]
    rows: list[tuple[str, Any, Any, str]] = []
    if best30 is not None:
        rows.append(("static sweet spot (cap per worker), post-4 timeout", "~32", best30,
                     "bottom of the U; a simulated H100 serves more than the seed's GPUs"))  # fmt: skip
    if (
        top is not None
        and sweep["static"].get(top, {}).get("ttft_p99_tail_s")
        and sweep["aimd"][top]["ttft_p99_tail_s"]
    ):
        ratio = sweep["static"][top]["ttft_p99_tail_s"] / sweep["aimd"][top]["ttft_p99_tail_s"]
        whole = sweep["static"][top]["ttft_p99_s"] / sweep["aimd"][top]["ttft_p99_s"]
        rows.append((f"TTFT static / AIMD in overload (cap {top})", "~3x", f"{ratio:.1f}x tail, {whole:.1f}x whole run",
                     "the whole run includes the cut from 256 and its stale window"))  # fmt: skip
    if parked:
        rows.append(("where AIMD parks (in flight, 2 workers)", "~135", f"{2 * min(parked):.0f}..{2 * max(parked):.0f}",
                     f"cap x 2 of the {len(parked)} runs that held one cap through the tail; just past the 256 vLLM slots"
                     + (f"; initial {', '.join(map(str, sawtooth))}: cut inside the tail, climbing back" if sawtooth else "")))  # fmt: skip
    if tails:
        rows.append(("AIMD p99 TTFT, tail (s)", "oscillates around 2 with brief breaches",
                     f"{min(tails):.2f}..{max(tails):.2f}", f"{len(in_band)} of {len(sweep['aimd'])} initial caps within "
                     f"{lower:.1f}..{upper:.1f} s"))  # fmt: skip
    spiral = ablations.get("acquire timeout 30 s (post #4)")
    if spiral:
        rows.append(("controller at its floor with a long acquire timeout: p99 (s)", "17 (queue_max 16)",
                     spiral["ttft_p99_tail_s"], "death spiral; ours has the final queue_max 8/2"))  # fmt: skip
    lines += ["", "Seed beside ours:", "", table(rows), "", _aimd_fixes_text(), ""]
    lines += [
        "Where ours differs from the seed: the absolute numbers come from the roofline model, not the seed's EKS "
        "GPUs, so the static sweet spot and the parking point are higher; the static U-curve shows with the "
        "post-4 30 s timeout (small caps: queue wait; large ones: waiting inside vLLM for a slot) and flattens "
        "on its low side with the 1 s timeout (a request that cannot be served in ~1 s is shed, so queue wait "
        "cannot exceed it); our p99 is flat below the slot limit and steep past it, so a controller parked past "
        "the slots sits in band without acting, while a random breach there halves the cap and costs minutes of "
        "additive climb (the classic sawtooth the seed chose in post #5; initial cap 128 shows one in its tail).",
        "",
        "Plots: `sweep.html` (both static sweeps and the AIMD sweep), `aimd_256/aimd.html` and `aimd_64/aimd.html` "
        "(cap and p99 over time).",
    ]
    return "\n".join(lines)


def sweep_figure(sweep: dict[str, Any]) -> Any:
    """Tail p99 TTFT and output throughput against the cap per worker, static (both timeouts) and with AIMD."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figure = make_subplots(
        rows=1, cols=2, subplot_titles=("p99 TTFT, tail (s), log scale", "output tokens/s")
    )
    modes = (("static_30s", "static, 30 s timeout", "#ff7f0e"), ("static", "static, 1 s timeout", "#d62728"),
             ("aimd", "AIMD (initial cap), 1 s timeout", "#1f77b4"))  # fmt: skip
    for mode, name, color in modes:
        points = sweep.get(mode) or {}
        caps = list(points)
        figure.add_trace(go.Scatter(x=caps, y=[points[c]["ttft_p99_tail_s"] for c in caps], name=f"{name}: p99 TTFT",
                                    line={"color": color}), row=1, col=1)  # fmt: skip
        figure.add_trace(go.Scatter(x=caps, y=[points[c]["output_tokens_per_s"] for c in caps],
                                    name=f"{name}: tok/s", line={"color": color, "dash": "dot"}), row=1, col=2)  # fmt: skip
    figure.add_hrect(y0=AIMD_TARGET_S * (1 - AIMD_BAND), y1=AIMD_TARGET_S * (1 + AIMD_BAND), fillcolor="#999",
                     opacity=0.15, line_width=0, row=1, col=1)  # fmt: skip
    figure.add_hline(y=AIMD_TARGET_S, line={"dash": "dash", "color": "#999"}, row=1, col=1)
    figure.update_xaxes(type="log", title_text="cap per worker (initial for AIMD)")
    figure.update_yaxes(type="log", row=1, col=1)
    figure.update_layout(title="seed 002 sweep: static cap vs AIMD", height=450, template="plotly_white")
    return figure
