"""Policy engine micro-benchmarks (`make bench-policy`, i.e. `python -m bench.policy`).

Measures, on one core, with a pool of 1,000 entitlements and 10,000 requests in flight:
- the admission decision through `AdmissionLedger.request` (snapshot + the five checks + applying
  the outcome), with the request released again afterwards so the pool stays at 10,000 in flight;
- the pure `admit()` on prebuilt snapshots (what a Redis-backed store would call);
- a contended pool (full, every decision reaches check 5);
- DRR `enqueue` + `dispatch` per request with 1,000 backlogged flows.
Figures are printed, never asserted. `--write-results` also replaces this benchmark's section of
bench/RESULTS.md with the printed figures.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from apps.policy import (
    AdmissionLedger,
    AdmissionRequest,
    DeficitRoundRobin,
    EntitlementLimits,
    admit,
)
from bench.results import write_rendered_section

ENTITLEMENTS = 1_000
IN_FLIGHT = 10_000
SECTION_TITLE = "## Policy engine (`make bench-policy`)"
CLASSES = ("dedicated", "guaranteed", "elastic", "elastic", "spot", "preemptible")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def summary(name: str, samples_ns: list[int]) -> tuple[str, float, float, float]:
    ordered = sorted(samples_ns)
    p50 = percentile(ordered, 0.50) / 1000
    p99 = percentile(ordered, 0.99) / 1000
    mean = statistics.fmean(ordered) / 1000
    return name, p50, p99, mean


def settle() -> None:
    """Collect, then move the long-lived warm-up state out of the collector's generations (what a
    server does after start-up), so collections during timing only walk fresh objects."""
    gc.collect()
    gc.freeze()


def build_pool(rng: random.Random, capacity: int, concurrency: int = 12) -> tuple[AdmissionLedger, list[str]]:
    ledger = AdmissionLedger(concurrency_capacity=capacity, kv_capacity=float("inf"), rng=rng)
    keys = []
    for index in range(ENTITLEMENTS):
        limits = EntitlementLimits(
            entitlement_id=f"ent-{index}",
            service_class=CLASSES[index % len(CLASSES)],
            tokens_per_second=5_000.0,
            kv_bytes=64e9,
            kv_bytes_per_token=1024.0,
            concurrency=concurrency,
            burst_concurrency=2 * concurrency,
            slo_target_ms=rng.choice((200.0, 500.0, 2_000.0, 30_000.0)),
            default_max_tokens=128,
            context_window=8192,
        )
        ledger.upsert_entitlement(limits, now=0.0)
        keys.append(limits.entitlement_id)
    for index in range(IN_FLIGHT):
        key = keys[index % ENTITLEMENTS]
        result = ledger.request(key, AdmissionRequest(f"warm-{index}", 64, 64), now=0.0)
        assert result.decision.admitted, result.decision
    return ledger, keys


def bench_ledger(decisions: int, seed: int) -> tuple[str, float, float, float]:
    rng = random.Random(seed)
    ledger, keys = build_pool(rng, capacity=IN_FLIGHT + 2_000)
    settle()
    samples: list[int] = []
    clock = time.perf_counter_ns
    now = 1.0
    admitted = 0
    for index in range(decisions):
        key = keys[rng.randrange(ENTITLEMENTS)]
        request = AdmissionRequest(f"bench-{index}", rng.randint(16, 512), rng.choice((None, 64, 256)))
        now += 0.0001
        start = clock()
        result = ledger.request(key, request, now)
        samples.append(clock() - start)
        if result.decision.admitted:
            admitted += 1
            ledger.release(request.request_id, now, output_tokens=32)
    assert ledger.running == IN_FLIGHT
    return summary(f"ledger.request, 10k in flight ({admitted}/{decisions} admitted)", samples)


def bench_pure_admit(decisions: int, seed: int) -> tuple[str, float, float, float]:
    rng = random.Random(seed)
    ledger, keys = build_pool(rng, capacity=IN_FLIGHT + 2_000)
    settle()
    pool = ledger.pool_usage()
    cases = []
    for _ in range(1_000):
        key = keys[rng.randrange(ENTITLEMENTS)]
        limits = ledger.limits(key)
        assert limits is not None
        cases.append((limits, ledger.usage(key, 1.0), AdmissionRequest("x", rng.randint(16, 512), 128)))
    samples: list[int] = []
    clock = time.perf_counter_ns
    for index in range(decisions):
        limits, usage, request = cases[index % len(cases)]
        start = clock()
        admit(limits, usage, pool, request)
        samples.append(clock() - start)
    return summary("admit() on prebuilt snapshots", samples)


def bench_contended(decisions: int, seed: int) -> tuple[str, float, float, float]:
    rng = random.Random(seed)
    # A large r_e keeps check 3 passing, so decisions get to check 5.
    ledger, keys = build_pool(rng, capacity=IN_FLIGHT * 5, concurrency=40)
    # Exactly full: no slot is free beyond the idle reservations of dedicated/guaranteed entitlements,
    # so non-reserved requests reach check 5 (queue, evict a preemptible, or be rejected).
    ledger.set_capacity(ledger.running + ledger.reserved_idle_slots, now=1.0)
    settle()
    samples: list[int] = []
    clock = time.perf_counter_ns
    outcomes: Counter[str] = Counter()
    for index in range(decisions):
        key = keys[rng.randrange(ENTITLEMENTS)]
        request = AdmissionRequest(f"c-{index}", 64, 64)
        start = clock()
        result = ledger.request(key, request, 1.0)
        samples.append(clock() - start)
        outcomes[result.decision.reason] += 1
        outcomes["evictions"] += len(result.evicted)
        if ledger.request_state(request.request_id) == "waiting":
            ledger.release(request.request_id, 1.0)  # cancel: keeps the wait list short
    label = "ledger.request, pool full (" + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) + ")"
    return summary(label, samples)


def bench_drr(operations: int, seed: int) -> tuple[str, float, float, float]:
    rng = random.Random(seed)
    flows = [f"flow-{index}" for index in range(ENTITLEMENTS)]
    drr = DeficitRoundRobin({flow: rng.randint(1, 4) for flow in flows})
    for index in range(IN_FLIGHT):  # a standing backlog of 10,000 queued items
        drr.enqueue(flows[index % len(flows)], index)
    settle()
    samples: list[int] = []
    clock = time.perf_counter_ns
    enqueue, dispatch = drr.enqueue, drr.dispatch
    for index in range(operations):
        flow = flows[rng.randrange(len(flows))]
        start = clock()
        enqueue(flow, index)
        dispatch()
        samples.append(clock() - start)
    return summary("DRR enqueue + dispatch, 1k flows, 10k queued", samples)


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        load = "n/a"
    return (
        f"{model}, {os.cpu_count()} cores (shared with other jobs; 1-min load {load} at the end), "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def render(rows: list[tuple[str, float, float, float]], command: str) -> str:
    lines = [
        SECTION_TITLE,
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine()}  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "Targets: admission p99 < 20 us per decision; DRR < 5 us per operation (one core).",
        "",
        "| measurement | p50 (us) | p99 (us) | mean (us) |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {p50:.2f} | {p99:.2f} | {mean:.2f} |" for name, p50, p99, mean in rows]
    lines += [
        "",
        "What each row times (one call each, `time.perf_counter_ns`, one Python thread):",
        "- `ledger.request, 10k in flight`: 1,000 entitlements (all five classes), 10,000 requests running;",
        "  building both snapshots, the five ordered checks, charging the bucket and starting the request.",
        "  Each admitted request is released again (untimed) so the pool stays at 10,000.",
        "- `admit()`: the pure function alone on prebuilt snapshots (what a Redis-backed store calls).",
        "- `pool full`: no free unreserved slot. Most decisions reach check 5: queued (then cancelled,",
        "  untimed), queued with eviction of a preemptible request, rejected as `pool_contended`, or",
        "  admitted into the requester's own reservation; the rest stop at check 3 (an entitlement at",
        "  `r_e` cannot borrow from a full pool). Started requests are kept, so the pool stays full.",
        "- `DRR`: one `enqueue` plus one `dispatch` with 1,000 flows (weights 1..4) and 10,000 queued.",
        "Long-lived warm-up state is moved out of the collector (`gc.freeze()`), as a server would after",
        "start-up; the collector stays on during timing. Other jobs shared the two cores, so the tails",
        "include their interference.",
    ]
    return "\n".join(lines) + "\n"


ROW = re.compile(r"^(?P<name>.+?)\s+p50\s+(?P<p50>[\d.]+) us\s+p99\s+(?P<p99>[\d.]+) us\s+mean\s+(?P<mean>[\d.]+) us$")
Row = tuple[str, float, float, float]


def run_tree(tree: Path, args: argparse.Namespace) -> list[Row]:
    """This benchmark as `tree`'s code has it, in a process of its own; its printed rows."""
    cmd = [sys.executable, "-m", "bench.policy", "--decisions", str(args.decisions), "--drr-ops", str(args.drr_ops),
           "--seed", str(args.seed)]
    out = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                         check=True).stdout
    rows = []
    for line in out.splitlines():
        match = ROW.match(line.strip())
        if match:
            rows.append((match["name"].strip(), float(match["p50"]), float(match["p99"]), float(match["mean"])))
    return rows


def side_by_side(args: argparse.Namespace, rounds: int = 3) -> tuple[list[Row], list[Row], str]:
    """This commit and the baseline in alternating processes, `rounds` each; the median of each figure."""
    from bench.baseline import REPO, source_tree

    with source_tree(args.baseline) as tree:
        ours: list[list[Row]] = []
        theirs: list[list[Row]] = []
        for _ in range(rounds):
            theirs.append(run_tree(tree, args))
            ours.append(run_tree(REPO, args))
        name = tree.name

    def medians(runs: list[list[Row]]) -> list[Row]:
        def median(i: int, k: int) -> float:
            return float(statistics.median([float(run[i][k]) for run in runs]))

        return [(runs[0][i][0], median(i, 1), median(i, 2), median(i, 3)) for i in range(len(runs[0]))]

    return medians(ours), medians(theirs), name


def render_comparison(ours: list[Row], theirs: list[Row], baseline: str) -> str:
    def key(name: str) -> str:
        return name.split(" (")[0]

    base = {key(row[0]): row for row in theirs}
    lines = ["", f"This commit against {baseline}, measured side by side (alternating processes, median of 3 each; "
             "ratio this / baseline, lower is faster):", "",
             "| measurement | p50 us (base) | p50 ratio | p99 us (base) | p99 ratio | mean us (base) | mean ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, p50, p99, mean in ours:
        other = base.get(key(name))
        if other is None:
            continue
        lines.append(f"| {key(name)} | {p50:.2f} ({other[1]:.2f}) | {p50 / other[1]:.2f} | {p99:.2f} ({other[2]:.2f}) "
                     f"| {p99 / other[2]:.2f} | {mean:.2f} ({other[3]:.2f}) | {mean / other[3]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=50_000, help="admission decisions per measurement")
    parser.add_argument("--drr-ops", type=int, default=200_000, help="DRR enqueue+dispatch pairs")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--baseline", metavar="REF",
                        help="measure this commit and REF (e.g. HEAD~1) side by side, alternating processes")
    parser.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args(argv)
    if args.decisions < 1 or args.drr_ops < 1:
        parser.error("--decisions and --drr-ops must be positive")
    if args.baseline:
        ours, theirs, name = side_by_side(args)
        for row in ours:
            print(f"{row[0]:<70} p50 {row[1]:7.2f} us   p99 {row[2]:7.2f} us   mean {row[3]:7.2f} us", flush=True)
        command = "python -m bench.policy " + " ".join(argv if argv is not None else sys.argv[1:])
        section = render(ours, command.strip()) + render_comparison(ours, theirs, name)
        print(section)
        if args.write_results:
            write_rendered_section(section, Path(__file__).resolve().parent / "RESULTS.md")
        return 0

    benches: list[Callable[[], tuple[str, float, float, float]]] = [
        lambda: bench_ledger(args.decisions, args.seed),
        lambda: bench_pure_admit(args.decisions, args.seed),
        lambda: bench_contended(args.decisions, args.seed),
        lambda: bench_drr(args.drr_ops, args.seed),
    ]
    rows = []
    for bench in benches:
        row = bench()
        rows.append(row)
        print(f"{row[0]:<70} p50 {row[1]:7.2f} us   p99 {row[2]:7.2f} us   mean {row[3]:7.2f} us", flush=True)
    print(machine())
    command = "python -m bench.policy " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(rows, command.strip())
    if args.write_results:
        path = Path(__file__).resolve().parent / "RESULTS.md"
        write_rendered_section(section, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
