"""The engine on a GPU, checked before it is timed (`python -m bench.gpu_check --device cuda --model DIR`).

Prints, never asserts in a way that stops the benchmarks after it (`bench/gpu_check.sh` runs them next):
1. the pool forward on `--device` against the CPU's reference forward (max |logits difference|);
2. greedy decoding through the scheduler and runner, full cache, on `--device` against the CPU (tokens equal);
3. the same with `token-pd` under a budget that forces evictions (finishes; evictions; agreement with the CPU);
4. Token-PD's state bound to `--device` against the CPU's NumPy paths over the same synthetic steps
   (the averages, the values and the victims), and the incremental protected mask against its definition.
Each line ends in `ok` or `MISMATCH`; the last line counts the mismatches.
"""

from __future__ import annotations

import argparse
import random

import torch

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
from backends.engine.eviction import PoolView, ProtectedTokens, TokenPDPolicy, TokenPDPredictorPolicy
from backends.engine.model import LlamaModel, SequenceCache
from backends.engine.runner import EngineRunner, RunnerConfig

mismatches = 0


def report(name: str, good: bool, detail: str) -> None:
    global mismatches
    mismatches += not good
    print(f"check {name:<48} {detail}  {'ok' if good else 'MISMATCH'}", flush=True)


def forward_against_reference(model_dir: str, device: str) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(3, 1000) for _ in range(40)]
    model = LlamaModel(model_dir, num_slots=128, device=device)
    seq = SequenceCache(row=0)
    chunked = torch.cat([model.forward([seq], [prompt[:25]]).logits, model.forward([seq], [prompt[25:]]).logits])
    reference = LlamaModel(model_dir, num_slots=8, device="cpu").reference_logits(prompt)[[24, 39]]
    gap = float((chunked.cpu() - reference).abs().max())
    report(f"forward on {device} vs CPU reference", gap < 1e-3, f"max |diff| {gap:.2e}")


def greedy(model_dir: str, device: str, policy: str, budget: int) -> tuple[dict[str, list[int]], EngineRunner]:
    rng = random.Random(5)
    runner = EngineRunner(model_dir, policy, RunnerConfig(budget_tokens=budget, max_batch_size=8), device=device)
    scheduler = ContinuousBatchScheduler(
        runner,
        BatchSchedulerConfig(max_batch_size=8, prefill_strategy=PrefillStrategy.CHUNKED, prefill_chunk_tokens=16),
    )
    scheduler.register_tenant(TenantConfig("t", max_concurrent=8, max_blocks=10**6))
    requests = [
        PromptRequest("t", f"r{i}", tuple(rng.randrange(3, 1000) for _ in range(rng.randrange(8, 48))),
                      SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        for i in range(8)
    ]
    for request in requests:
        scheduler.submit(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    completed = 0
    while scheduler.has_work():
        for event in scheduler.step():
            if isinstance(event, TokenEvent):
                tokens[event.request_id].append(event.token)
            elif isinstance(event, CompletedEvent):
                completed += 1
    if completed != len(requests):
        report(f"{policy} on {device}: every request completes", False, f"{completed}/{len(requests)}")
    return tokens, runner


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    pairs = [(x, y) for key in a for x, y in zip(a[key], b[key], strict=False)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def decode_against_cpu(model_dir: str, device: str) -> None:
    on_device, _ = greedy(model_dir, device, "none", 4096)
    on_cpu, _ = greedy(model_dir, "cpu", "none", 4096)
    report(f"greedy, full cache, {device} vs CPU", on_device == on_cpu,
           f"token agreement {agreement(on_device, on_cpu):.3f}")
    evicting, runner = greedy(model_dir, device, "token-pd", 160)
    evicting_cpu, cpu_runner = greedy(model_dir, "cpu", "token-pd", 160)
    lengths = all(len(t) == 48 for t in evicting.values())
    report(
        f"token-pd under a 160-token budget on {device}",
        lengths and runner.stats.tokens_evicted > 0 and runner.stats.peak_used_tokens <= 160,
        f"evicted {runner.stats.tokens_evicted} (CPU {cpu_runner.stats.tokens_evicted}), peak "
        f"{runner.stats.peak_used_tokens}, preempt {runner.stats.preemptions}, "
        f"agreement with CPU {agreement(evicting, evicting_cpu):.3f}",
    )


def policy_state_against_cpu(device: str, slots: int = 4096, rows: int = 16, vocab: int = 512) -> None:
    """Token-PD bound to `device` and to the CPU, fed the same steps: same averages, values and victims."""
    generator = torch.Generator().manual_seed(11)
    pairs = {}
    for cls in (TokenPDPolicy, TokenPDPredictorPolicy):
        host, dev = cls(), cls()
        host.bind(slots, 100, slots, rows)
        dev.bind(slots, 100, slots, rows, device=device)
        pairs[cls.name] = (host, dev)
    owner = torch.arange(rows).repeat_interleave(slots // rows)
    position = torch.arange(slots // rows).repeat(rows)
    seen = torch.full((rows,), slots // rows, dtype=torch.long)
    live = torch.ones(slots, dtype=torch.bool)
    protected = ProtectedTokens(owner.to(device), position.to(device), live.to(device), 4, 8, rows)
    protected.admit(torch.arange(slots, device=device), seen.to(device))
    host_protected = ProtectedTokens(owner, position, live, 4, 8, rows)
    host_protected.admit(torch.arange(slots), seen)
    worst = {name: 0.0 for name in pairs}
    same_victims = {name: True for name in pairs}
    for step in range(1, 41):
        mass = torch.rand(slots, generator=generator).pow_(4)
        stepped = torch.rand(slots, generator=generator) < 0.9
        logits = torch.randn(rows, vocab, generator=generator) * 4
        newest = torch.randint(0, slots, (rows,), generator=generator).unique()
        for name, (host, dev) in pairs.items():
            for policy, on in ((host, "cpu"), (dev, device)):
                view = PoolView(live.to(on), host_protected.mask.to(on), owner.to(on), position.to(on),
                                torch.arange(slots, device=on), None, rows, torch.arange(rows, device=on), slots,
                                step, seen_by_row=seen.to(on))
                if isinstance(policy, TokenPDPredictorPolicy):
                    policy.on_logits(view, newest.to(on), logits[: newest.numel()].to(on))
                policy.observe(view, mass.to(on), stepped.to(on))
                victims = policy.voluntary_evictions(view)
                if on == "cpu":
                    host_victims = victims
                else:
                    if victims.device.type != torch.device(device).type:
                        report(f"{name} victims stay on {device}", False, str(victims.device))
                    same_victims[name] &= set(victims.cpu().tolist()) == set(host_victims.tolist())
                policy.end_step(view, slots)
            worst[name] = max(worst[name], float((dev._value.cpu() - host._value).abs().max()))
    for name in pairs:
        # The predictor trains with fused Adam on both: float32 sums in another order, so close, not equal.
        tolerance = 1e-6 if name == "token-pd-ewma" else 1e-3
        report(f"{name} state on {device} vs CPU (40 steps)", worst[name] < tolerance and same_victims[name],
               f"max |value diff| {worst[name]:.2e}, victims equal {same_victims[name]}")
    report(f"protected mask on {device} vs CPU", torch.equal(protected.mask.cpu(), host_protected.mask),
           f"{int(protected.mask.sum())} protected")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", required=True)
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)
    forward_against_reference(args.model, args.device)
    decode_against_cpu(args.model, args.device)
    policy_state_against_cpu(args.device)
    print(f"checks done: {mismatches} mismatch(es)", flush=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
