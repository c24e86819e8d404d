"""Quality under eviction: teacher-forced perplexity and divergence from the full cache.

Many sequences share one KV budget exactly as in serving (one runner, one policy, the batch-global
budget); each step feeds every sequence its next *true* token and scores the logits. The same text is
also run once with a budget that fits everything, so each policy's loss of quality is measured as
perplexity and as the mean KL divergence of its next-token distribution from the full-cache one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.engine.runner import EngineRunner, RunnerConfig
from workers.engine.scheduler import SamplingParams, SequenceWork

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class QualityResult:
    policy: str
    budget_tokens: int
    perplexity: float
    mean_kl_from_full: float
    top1_agreement: float
    peak_used_tokens: int
    preemptions: int


def teacher_forced_logprobs(
    model_dir: str, policy: str, budget_tokens: int, texts: list[list[int]], prefix: int
) -> tuple[list[torch.Tensor], EngineRunner]:
    """Per sequence, the log-probabilities the model gave each scored position (all positions >= prefix).

    A sequence the runner preempts (its protected tokens no longer fit) stops being scored from there;
    the caller sees fewer rows for it, and `runner.stats.preemptions` says how often that happened.
    """
    runner = EngineRunner(
        model_dir, policy, RunnerConfig(budget_tokens=budget_tokens, max_batch_size=len(texts))
    )
    ids = [f"q{i}" for i in range(len(texts))]
    outputs: list[list[torch.Tensor]] = [[] for _ in texts]
    alive = set(range(len(texts)))
    cursor = prefix
    step_work = [SequenceWork(ids[i], tuple(text[:prefix]), True, GREEDY) for i, text in enumerate(texts)]
    while step_work:
        results = runner.run(step_work)
        for work in step_work:
            index = ids.index(work.request_id)
            if results[work.request_id].preempted:
                alive.discard(index)
                continue
            outputs[index].append(torch.log_softmax(runner.last_logits[work.request_id], dim=-1))
        step_work = [
            SequenceWork(ids[i], (texts[i][cursor],), True, GREEDY)
            for i in sorted(alive)
            if cursor < len(texts[i]) - 1
        ]
        cursor += 1
    for request_id in ids:
        runner.release(request_id)
    return [torch.stack(rows) if rows else torch.zeros(0) for rows in outputs], runner


def measure_quality(
    model_dir: str, policies: list[str], budgets: list[int], texts: list[list[int]], prefix: int = 16
) -> list[QualityResult]:
    need = sum(len(text) for text in texts)
    full, _ = teacher_forced_logprobs(model_dir, "none", need + 1, texts, prefix)
    results = []
    for budget in budgets:
        for policy in policies:
            got, runner = teacher_forced_logprobs(model_dir, policy, budget, texts, prefix)
            nll, kl, agree, count = 0.0, 0.0, 0, 0
            for text, reference, logprobs in zip(texts, full, got, strict=True):
                rows = logprobs.shape[0] if logprobs.numel() else 0
                if rows == 0:
                    continue
                targets = torch.tensor(text[prefix : prefix + rows])
                nll -= float(logprobs[torch.arange(rows), targets].sum())
                kl += float((reference[:rows].exp() * (reference[:rows] - logprobs)).sum())
                agree += int((reference[:rows].argmax(-1) == logprobs.argmax(-1)).sum())
                count += rows
            results.append(
                QualityResult(
                    policy=policy,
                    budget_tokens=budget,
                    perplexity=math.exp(nll / max(1, count)),
                    mean_kl_from_full=kl / max(1, count),
                    top1_agreement=agree / max(1, count),
                    peak_used_tokens=runner.stats.peak_used_tokens,
                    preemptions=runner.stats.preemptions,
                )
            )
    return results
