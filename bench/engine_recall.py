"""Benchmark 1 where long context matters: iso-quality KV memory on the long-range tasks.

The model is `backends/engine/assets/tiny-recall` (`make train-recall`), which answers copy and recall
questions about tokens hundreds of positions back (`backends.engine.long_context`). Many teacher-forced
sequences share one KV budget M, as in `bench.engine`'s benchmark 1; a policy passes at M when its recall
accuracy stays within `--accuracy-tolerance` of the full cache's (1 point), its perplexity within
`--tolerance` (1%), and nothing is preempted. Per policy a bisection finds the smallest M. The seed's
targets: Token-PD's peak KV at most 0.5x FIFO's and 0.8x H2O's.

`--throughput` adds benchmark 2 on the same workload: per stream count, `--requests-per-stream` copy
prompts per stream (a held-out copy sequence up to the repeat's first token) arrive as a Poisson stream
and are generated greedily in this process under one KV budget (`--budget-fraction` of what the streams
hold at once); tokens/s, p95 latency and copy accuracy (generated tokens equal to the span's) per
policy. The seed's target: Token-PD at least 1.3x FIFO's throughput at equal quality.

    python -m bench.engine_recall --write-results [--throughput]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.engine import iso_ratios, throughput_ratios
from bench.results import machine_description, write_rendered_section

SECTION_TITLE = "## Inference engine on long context (`make bench-engine-recall`)"
RECALL_MODEL = Path("backends/engine/assets/tiny-recall")
POLICIES = ("fifo", "lru", "h2o", "token-pd", "token-pd-ewma", "token-pd-fixed-step")
WINDOWS = (16, 32, 64, 128, 256)
TARGETS = {"fifo": 0.5, "h2o": 0.8}
THROUGHPUT_POLICIES = ("none", "fifo", "lru", "h2o", "token-pd", "token-pd-ewma")


def reach(args: argparse.Namespace, sequences: list) -> list[tuple[int | None, float, float]]:
    """Recall accuracy and perplexity when each token sees only 4 sinks and its last w tokens: what a FIFO
    cache of 4 + w tokens per sequence leaves the model."""
    from backends.engine.long_context import windowed_accuracy
    from backends.engine.quality import windowed_perplexity

    texts = [s.ids for s in sequences]
    return [
        (window, windowed_accuracy(args.model, sequences, window),
         windowed_perplexity(args.model, texts, args.prefix, window))
        for window in [*[w for w in WINDOWS if w < args.length], None]
    ]


def run(args: argparse.Namespace) -> dict:
    from backends.engine.long_context import held_out_tasks
    from backends.engine.quality import (
        answer_accuracy,
        full_cache_reference,
        iso_quality_budget,
        perplexity_of,
    )

    sequences = held_out_tasks(args.model, args.sequences, args.length)
    texts = [s.ids for s in sequences]
    answers = [s.scored for s in sequences]
    need = sum(len(t) for t in texts)
    started = time.perf_counter()
    reference = full_cache_reference(args.model, texts, args.prefix)
    reference_perplexity = perplexity_of(texts, reference, args.prefix)
    reference_accuracy = answer_accuracy(texts, answers, reference, args.prefix)
    print(f"full cache: {len(texts)} x {args.length} tokens, recall accuracy {reference_accuracy:.3f}, perplexity "
          f"{reference_perplexity:.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    windows = reach(args, sequences)
    print("reach: " + ", ".join(f"{w or 'all'}: {a:.3f} / {p:.2f}" for w, a, p in windows), flush=True)
    resolution = max(1, round(args.resolution * need))
    found = []
    for index, policy in enumerate(args.policies, 1):
        started = time.perf_counter()
        iso = iso_quality_budget(args.model, policy, texts, args.prefix, reference, reference_perplexity,
                                 tolerance=args.tolerance, resolution_tokens=resolution, answers=answers,
                                 reference_accuracy=reference_accuracy, accuracy_tolerance=args.accuracy_tolerance)
        found.append(iso)
        runs = ", ".join(f"{r.budget_tokens}:{r.recall_accuracy:.3f}/{r.perplexity:.2f}" for r in iso.evaluations)
        print(f"[{index}/{len(args.policies)}] {policy:<20} M {iso.budget_tokens} "
              f"({time.perf_counter() - started:.0f} s: {runs})", flush=True)
    return {"need": need, "reference_accuracy": reference_accuracy, "reference_perplexity": reference_perplexity,
            "windows": windows, "found": found, "sequences": sequences}


def throughput(args: argparse.Namespace) -> list[dict]:
    """Benchmark 2 on copy prompts: one row per stream count and policy."""
    import random

    from backends.engine.long_context import held_out_tasks
    from bench.engine import WorkloadRequest, bench_throughput_inprocess, poisson_arrivals

    rows = []
    for streams in args.throughput_streams:
        count = streams * args.requests_per_stream
        tasks = held_out_tasks(args.model, count, args.length, seed=11, kinds=("copy",))
        prompts = [t.ids[: t.scored[0]] for t in tasks]
        expected = [t.ids[t.scored[0]:] for t in tasks]
        arrivals = poisson_arrivals(random.Random(args.seed), count, args.arrival_rate * streams)
        workload = [WorkloadRequest(at, len(p), len(e)) for at, p, e in zip(arrivals, prompts, expected, strict=True)]
        budget = int(args.budget_fraction * streams * args.length)
        for policy in args.throughput_policies:
            generated: dict[int, list[int]] = {}
            figures = bench_throughput_inprocess(args.model, policy, streams, budget, workload, args.seed,
                                                 prompts=prompts, generated_ids=generated)
            right = sum(int(a == b) for i, e in enumerate(expected) for a, b in zip(generated.get(i, []), e, strict=False))
            figures |= {"streams": streams, "policy": policy, "budget_tokens": budget,
                        "copy_accuracy": right / max(1, sum(len(e) for e in expected))}
            rows.append(figures)
            print(f"throughput {streams:>3} streams {policy:<14} {figures['tokens_per_s']:8.1f} tok/s, p95 "
                  f"{figures['p95_latency_s']:.2f} s, copy accuracy {figures['copy_accuracy']:.3f}, preemptions "
                  f"{figures['preemptions']}", flush=True)
    return rows


def throughput_lines(args: argparse.Namespace, rows: list[dict]) -> list[str]:
    lines = [
        "",
        f"### Throughput on copy prompts ({args.requests_per_stream} requests per stream, Poisson arrivals at "
        f"{args.arrival_rate:g}/s per stream, budget {args.budget_fraction:.0%} of streams x {args.length} "
        "tokens, in process)",
        "",
        "| streams | policy | tok/s | p95 latency s | copy accuracy | preemptions | tokens evicted |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['streams']} | {r['policy']} | {r['tokens_per_s']:.1f} | {r['p95_latency_s']:.2f} | "
              f"{r['copy_accuracy']:.3f} | {r['preemptions']} | {r['evicted']} |" for r in rows]
    lines += ["", "| streams | Token-PD / FIFO tok/s (target >= 1.3 at equal quality) | accuracy Token-PD, FIFO |",
              "|---:|---|---|"]
    by_key = {(r["policy"], r["streams"]): r for r in rows}
    speedups = throughput_ratios([(r["policy"], r["streams"], r) for r in rows], base="fifo")
    for streams, value in sorted(speedups.items()):
        mine, fifo = by_key[("token-pd", streams)], by_key[("fifo", streams)]
        equal = mine["copy_accuracy"] >= fifo["copy_accuracy"] - 0.01
        mark = "met" if value >= 1.3 and equal else "NOT met"
        lines.append(f"| {streams} | {value:.2f} ({mark}) | {mine['copy_accuracy']:.3f}, {fifo['copy_accuracy']:.3f} |")
    return lines


def render(args: argparse.Namespace, command: str, figures: dict) -> str:
    import torch

    sequences = figures["sequences"]
    distances = sorted(s.distance for s in sequences)
    lines = [
        SECTION_TITLE,
        "",
        f"Command: `{command}`. Machine: {machine_description()}, shared with other jobs; torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread(s). Date: {datetime.now(UTC):%Y-%m-%d}.",
        "",
        f"Model `{args.model}`. {len(sequences)} held-out sequences of {args.length} tokens (copy and recall in "
        f"turn, text filler from the held-out files; answers {distances[0]}-{distances[-1]} tokens after their "
        f"source), teacher-forced, sharing one budget M; scoring starts after {args.prefix} tokens. Full "
        f"cache ({figures['need']:,} tokens): recall accuracy {figures['reference_accuracy']:.3f}, perplexity "
        f"{figures['reference_perplexity']:.3f}. Iso-quality: accuracy >= full - {args.accuracy_tolerance:.2f}, "
        f"perplexity <= {1 + args.tolerance:.2f} x full, no preemption; bisection resolution "
        f"{args.resolution:.0%} of the full need.",
        "",
        "What the model loses with only 4 sinks and its last w tokens (a FIFO cache of 4 + w per sequence):",
        "",
        "| w | recall accuracy | perplexity |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {w or 'all'} | {a:.3f} | {p:.3f} |" for w, a, p in figures["windows"]]
    lines += [
        "",
        "| policy | smallest M (tokens) | share of the full need | recall accuracy at M | perplexity at M "
        "| peak KV bytes |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for iso in figures["found"]:
        if iso.result is None:
            lines.append(f"| {iso.policy} | none passed | | | | |")
            continue
        r = iso.result
        lines.append(f"| {iso.policy} | {iso.budget_tokens:,} | {iso.budget_tokens / figures['need']:.0%} | "
                     f"{r.recall_accuracy:.3f} | {r.perplexity:.3f} | {iso.peak_kv_bytes:,} |")
    lines += ["", "| target (seed 001) | Token-PD peak KV / theirs | |", "|---|---:|---|"]
    ratios = iso_ratios(figures["found"])
    for other, target in TARGETS.items():
        value = ratios[other]["peak_bytes"]
        mark = "not measured" if value is None else ("met" if value <= target else "NOT met")
        shown = "–" if value is None else f"{value:.2f}"
        lines.append(f"| Token-PD <= {target:.1f}x {other.upper()} | {shown} | {mark} |")
    if figures.get("throughput"):
        lines += throughput_lines(args, figures["throughput"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(RECALL_MODEL))
    parser.add_argument("--sequences", type=int, default=16, help="concurrent streams")
    parser.add_argument("--length", type=int, default=None,
                        help="tokens per stream (default: the context the model was trained on)")
    parser.add_argument("--prefix", type=int, default=16, help="prompt tokens before scoring starts")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--tolerance", type=float, default=0.01, help="allowed perplexity increase")
    parser.add_argument("--accuracy-tolerance", type=float, default=0.01, help="allowed recall accuracy loss")
    parser.add_argument("--resolution", type=float, default=0.02, help="fraction of the full need")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--throughput", action="store_true", help="also run benchmark 2 on copy prompts")
    parser.add_argument("--throughput-streams", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--throughput-policies", nargs="+", default=list(THROUGHPUT_POLICIES))
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--arrival-rate", type=float, default=2.0, help="requests/s per stream")
    parser.add_argument("--budget-fraction", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").exists():
        parser.error(f"no model in {args.model}; run `make train-recall` first")
    if args.length is None:
        report = Path(args.model) / "train_report.json"
        args.length = json.loads(report.read_text())["spec"]["context"] if report.exists() else 256
    import torch

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    figures = run(args)
    if args.throughput:
        figures["throughput"] = throughput(args)
    command = "python -m bench.engine_recall " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(args, command.strip(), figures)
    if args.write_results:
        write_rendered_section(section)
        print(f"wrote {SECTION_TITLE[3:]} in bench/RESULTS.md")
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
