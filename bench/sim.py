"""Simulator throughput: simulated requests per wall-clock second for a 4-instance cluster with 128-token
outputs and token-pools admission, and the wall time of a 1,000,000-request run (target: >= 20,000
simulated requests/s on one core).

    python -m bench.sim                      # 1,000,000 requests
    python -m bench.sim --requests 100000    # quicker
    python -m bench.sim --profile            # cProfile top entries on stderr
    python -m bench.sim --requests 200000 --against f487a72   # side by side with another commit's simulator
    TOKENPOOLS_COMPILED=1 python -m bench.sim ...               # the mypyc build (make compile-sim) of this tree

`--against REF` runs the same workload with the simulator of git commit REF (its tree exported to a temporary
directory, run there in a subprocess) and with this tree's, alternately `--rounds` times each, and prints both
best figures and their ratio: on a shared machine only runs this close together compare.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

from apps.compiled import active as compiled_active
from apps.simulator.factory import build_admission
from apps.simulator.simulation import SimConfig, Simulation
from apps.simulator.workload import LengthSpec, TenantSpec

TARGET_REQUESTS_PER_S = 20_000
# Four tenants at this rate offer a little more than the four instances serve: spot gets throttled.
RATE_PER_TENANT = 80.0


def bench_config(num_requests: int, seed: int = 1) -> SimConfig:
    """Four H100 instances (roofline, qwen/qwen3-8b) offered slightly more than they serve, four entitlements."""
    prompt, output = LengthSpec("fixed", 256), LengthSpec("fixed", 128)
    # (entitlement, service class, SLO class, SLO target in ms): one tenant per class, elastic twice.
    shapes = (
        ("guaranteed", "guaranteed", "critical", 500),
        ("elastic-a", "elastic", "standard", 2000),
        ("elastic-b", "elastic", "standard", 10000),
        ("spot", "spot", "sheddable", 30000),
    )
    tenants = [
        TenantSpec(
            name,
            slo_class=slo_class,
            rate=RATE_PER_TENANT,
            slo_target_ms=slo_target_ms,
            entitlement={"service_class": service_class, "concurrency": 256},
            input=prompt,
            output=output,
        )
        for name, service_class, slo_class, slo_target_ms in shapes
    ]
    return SimConfig(
        latency_model="roofline",
        gpu="h100",
        model="qwen/qwen3-8b",
        num_instances=4,
        max_num_seqs=256,
        routing="least-loaded",
        tenants=tenants,
        num_requests=num_requests,
        seed=seed,
        record_latencies=False,
    )


def run(num_requests: int) -> dict[str, Any]:
    config = bench_config(num_requests)
    admission = build_admission({"policy": "token-pools", "tick_s": 1.0}, config)
    simulation = Simulation(config, admission)
    started = time.perf_counter()
    simulation.run()
    wall = time.perf_counter() - started
    summary = simulation.summary()
    return {
        "requests": summary["num_requests"],
        "completed": summary["completed_requests"],
        "rejected": summary["rejected_requests"],
        "conservation": summary["conservation"]["holds"],
        "simulated_s": summary["simulated_seconds"],
        "wall_s": round(wall, 2),
        "requests_per_wall_s": round(summary["num_requests"] / wall),
        "events": simulation.loop.events_run,
        "slot_fraction": summary["utilization"]["slot_fraction"],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "compiled": compiled_active(),  # TOKENPOOLS_COMPILED=1: the mypyc build of the hot path (apps.compiled)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim")
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--write-results", action="store_true", help="rewrite the Simulator section of RESULTS.md"
    )
    parser.add_argument("--against", metavar="REF", help="also run the simulator of git commit REF, side by side")
    parser.add_argument("--rounds", type=int, default=2, help="with --against: runs of each, alternately")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1:
        print("bench.sim: error: --requests and --rounds must be positive", file=sys.stderr)
        return 2
    if args.against:
        return side_by_side(args.against, args.requests, args.rounds)
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        result = run(args.requests)
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    else:
        result = run(args.requests)
    result["target_requests_per_wall_s"] = TARGET_REQUESTS_PER_S
    result["meets_target"] = result["requests_per_wall_s"] >= TARGET_REQUESTS_PER_S
    if args.write_results:
        write_results(result, args.requests)
    print(json.dumps(result, indent=2))
    return 0


def side_by_side(ref: str, requests: int, rounds: int) -> int:
    """This tree's simulator and commit `ref`'s on the same workload, alternately; the best run of each."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        archive = subprocess.run(["git", "-C", str(here), "archive", ref], capture_output=True, check=False)
        if archive.returncode != 0:
            print(f"bench.sim: error: cannot export {ref!r}: {archive.stderr.decode().strip()}", file=sys.stderr)
            return 2
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        if compiled_active() and Path(tmp, "bench", "compile_sim.py").is_file():
            # TOKENPOOLS_COMPILED=1: REF's own hot path compiled too (about a minute); a REF from before the
            # compiled build runs as pure Python (its "compiled" says which).
            print(f"bench.sim: compiling {ref}'s hot path", file=sys.stderr)
            build_env = {key: value for key, value in os.environ.items() if key != "TOKENPOOLS_COMPILED"}
            subprocess.run([sys.executable, "-m", "bench.compile_sim"], cwd=tmp, env=build_env, check=True,
                           stdout=subprocess.DEVNULL)
        command = [sys.executable, "-m", "bench.sim", "--requests", str(requests)]
        best: dict[str, dict[str, Any]] = {}
        for _ in range(rounds):
            for label, cwd in ((ref, tmp), ("this tree", str(here))):
                # `python -m` puts the working directory first on sys.path: each run imports its own tree.
                run_ = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
                if run_.returncode != 0:
                    last = (run_.stderr.strip().splitlines() or ["no output"])[-1]
                    print(f"bench.sim: error: the run of {label} failed: {last}", file=sys.stderr)
                    return 2
                result = json.loads(run_.stdout)
                if label not in best or result["requests_per_wall_s"] > best[label]["requests_per_wall_s"]:
                    best[label] = result
    old, new = best[ref], best["this tree"]
    same = all(old[key] == new[key] for key in ("completed", "rejected", "simulated_s", "events", "slot_fraction"))
    print(json.dumps({
        "requests": requests,
        "rounds": rounds,
        ref: {key: old.get(key) for key in ("requests_per_wall_s", "wall_s", "compiled")},
        "this tree": {key: new.get(key) for key in ("requests_per_wall_s", "wall_s", "compiled")},
        "speedup": round(new["requests_per_wall_s"] / old["requests_per_wall_s"], 2),
        "same_results": same,
        "load_1min": round(os.getloadavg()[0], 2),
    }, indent=2))
    return 0 if same else 1


def write_results(result: dict[str, Any], requests: int) -> None:
    import os
    from datetime import UTC, datetime

    from bench.results import machine_description, write_section

    load = os.getloadavg()[0]
    body = f"""
- Command: `python -m bench.sim --requests {requests} --write-results`
- Machine: {machine_description()} (shared with other jobs; 1-min load {load:.2f} at the end)
- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC

Target: at least {TARGET_REQUESTS_PER_S:,} simulated requests per wall-clock second on one core.

Set-up: 4 instances (roofline, H100, qwen/qwen3-8b, 256 slots each, least-loaded routing), four entitlements
(guaranteed, 2 elastic, spot) at {RATE_PER_TENANT:.0f} req/s each of 256-token prompts and 128-token outputs, token-pools
admission through `apps.policy.AdmissionLedger` (debt/burst tick every simulated second), one process.

| measurement | value |
|---|---:|
| requests simulated | {result["requests"]:,} |
| wall time (s) | {result["wall_s"]:.2f} |
| simulated requests per wall-clock second | {result["requests_per_wall_s"]:,} |
| simulated time (s) | {result["simulated_s"]:.1f} |
| events run | {result["events"]:,} |
| completed / rejected | {result["completed"]:,} / {result["rejected"]:,} |
| conservation holds | {result["conservation"]} |
| slot utilization | {result["slot_fraction"]} |
"""
    write_section("Simulator", body)


if __name__ == "__main__":
    raise SystemExit(main())
