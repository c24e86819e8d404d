"""Quality under eviction: teacher-forced perplexity and divergence from the full cache.

Many sequences share one KV budget exactly as in serving (one runner, one policy, the batch-global
budget); each step feeds every sequence its next *true* token and scores the logits. The same text is
also run once with a budget that fits everything, so each policy's loss of quality is measured as
perplexity and as the mean KL divergence of its next-token distribution from the full-cache one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.engine.model import LlamaConfig
from backends.engine.runner import EngineRunner, RunnerConfig
from backends.engine.scheduler import SamplingParams, SequenceWork

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
    # Share of the answer tokens (long-range tasks, `backends.engine.long_context`) predicted right; None
    # when the texts have no answers.
    recall_accuracy: float | None = None


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


def full_cache_reference(model_dir: str, texts: list[list[int]], prefix: int) -> list[torch.Tensor]:
    """The log-probabilities with a budget that holds every token: the reference each policy is scored by."""
    need = sum(len(text) for text in texts)
    reference, _ = teacher_forced_logprobs(model_dir, "none", need + 1, texts, prefix)
    return reference


def answer_accuracy(
    texts: list[list[int]], answers: list[list[int]], logprobs: list[torch.Tensor], prefix: int
) -> float:
    """Share of the answer positions (indices into each text) whose token is its row's argmax; rows start
    at `prefix`. A sequence with fewer rows (preempted) counts its missing answers as wrong."""
    right, total = 0, 0
    for text, indices, rows in zip(texts, answers, logprobs, strict=True):
        count = rows.shape[0] if rows.numel() else 0
        for index in indices:
            total += 1
            row = index - prefix
            right += int(0 <= row < count and int(rows[row].argmax()) == text[index])
    return right / max(1, total)


def score_policy(
    model_dir: str,
    policy: str,
    budget: int,
    texts: list[list[int]],
    prefix: int,
    reference: list[torch.Tensor],
    answers: list[list[int]] | None = None,
) -> QualityResult:
    """Perplexity, KL from `reference` and top-1 agreement of one policy at one shared budget, and the
    recall accuracy on `answers` when given."""
    got, runner = teacher_forced_logprobs(model_dir, policy, budget, texts, prefix)
    nll, kl, agree, count = 0.0, 0.0, 0, 0
    for text, full, logprobs in zip(texts, reference, got, strict=True):
        rows = logprobs.shape[0] if logprobs.numel() else 0
        if rows == 0:
            continue
        targets = torch.tensor(text[prefix : prefix + rows])
        nll -= float(logprobs[torch.arange(rows), targets].sum())
        kl += float((full[:rows].exp() * (full[:rows] - logprobs)).sum())
        agree += int((full[:rows].argmax(-1) == logprobs.argmax(-1)).sum())
        count += rows
    return QualityResult(
        policy=policy,
        budget_tokens=budget,
        perplexity=math.exp(nll / max(1, count)),
        mean_kl_from_full=kl / max(1, count),
        top1_agreement=agree / max(1, count),
        peak_used_tokens=runner.stats.peak_used_tokens,
        preemptions=runner.stats.preemptions,
        recall_accuracy=None if answers is None else answer_accuracy(texts, answers, got, prefix),
    )


def measure_quality(
    model_dir: str, policies: list[str], budgets: list[int], texts: list[list[int]], prefix: int = 16
) -> list[QualityResult]:
    reference = full_cache_reference(model_dir, texts, prefix)
    return [
        score_policy(model_dir, policy, budget, texts, prefix, reference)
        for budget in budgets
        for policy in policies
    ]


def smallest_passing(
    failing: int, passing: int, passes: Callable[[int], bool], resolution: int = 1
) -> tuple[int | None, dict[int, bool]]:
    """Bisection for the smallest integer in (`failing`, `passing`] for which `passes` holds.

    `failing` is a bound known (or assumed) to fail and is never evaluated; `passing` is evaluated only
    if no point below it passed, so a predicate that fails everywhere returns None instead of pretending
    the upper end passed. The answer is within `resolution` of the true threshold when `passes` is
    monotone (more budget never hurts); when it is not, the answer is still a point that was seen to pass.
    Returns the answer and every evaluation made.
    """
    if passing <= failing:
        raise ValueError(f"need failing < passing, got {failing} and {passing}")
    seen: dict[int, bool] = {}

    def check(value: int) -> bool:
        if value not in seen:
            seen[value] = passes(value)
        return seen[value]

    low, high = failing, passing
    found: int | None = None
    while high - low > max(1, resolution):
        middle = (low + high) // 2
        if check(middle):
            high, found = middle, middle
        else:
            low = middle
    if found is None:
        found = passing if check(passing) else None
    return found, seen


@dataclass(frozen=True)
class IsoQualityResult:
    """The smallest budget found whose perplexity stays within the tolerance, with its measurement."""

    policy: str
    budget_tokens: int | None
    result: QualityResult | None  # the run at `budget_tokens`
    evaluations: tuple[QualityResult, ...]
    bytes_per_token: int  # keys and values of one token in every layer, as the pool stores them

    @property
    def peak_kv_bytes(self) -> int | None:
        return None if self.result is None else self.result.peak_used_tokens * self.bytes_per_token


def iso_quality_budget(
    model_dir: str,
    policy: str,
    texts: list[list[int]],
    prefix: int,
    reference: list[torch.Tensor],
    reference_perplexity: float,
    tolerance: float = 0.01,
    resolution_tokens: int = 1,
    sink_tokens: int = 4,
    recent_tokens: int = 8,
    answers: list[list[int]] | None = None,
    reference_accuracy: float | None = None,
    accuracy_tolerance: float = 0.01,
) -> IsoQualityResult:
    """Smallest shared budget M with perplexity <= (1 + tolerance) x the full cache's and no preemption,
    and, with `answers`, recall accuracy at least the full cache's `reference_accuracy` less
    `accuracy_tolerance` (0.01: one point).

    Below one protected window per sequence plus its next token every step preempts, so the search
    starts just above `len(texts) * (sinks + recent)`; the full need always passes for a policy that
    evicts nothing it must not.
    """
    need = sum(len(text) for text in texts)
    runs: dict[int, QualityResult] = {}

    def passes(budget: int) -> bool:
        result = score_policy(model_dir, policy, budget, texts, prefix, reference, answers)
        runs[budget] = result
        recalls = (
            result.recall_accuracy is None
            or reference_accuracy is None
            or result.recall_accuracy >= reference_accuracy - accuracy_tolerance
        )
        return result.preemptions == 0 and result.perplexity <= (1 + tolerance) * reference_perplexity and recalls

    floor = len(texts) * (sink_tokens + recent_tokens)
    budget, _ = smallest_passing(floor, need, passes, resolution_tokens)
    return IsoQualityResult(
        policy=policy,
        budget_tokens=budget,
        result=runs[budget] if budget is not None else None,
        evaluations=tuple(runs[b] for b in sorted(runs)),
        bytes_per_token=LlamaConfig.from_folder(Path(model_dir)).kv_bytes_per_token,
    )


def windowed_perplexity(
    model_dir: str, texts: list[list[int]], prefix: int, window: int | None, sinks: int = 4
) -> float:
    """Perplexity (positions >= `prefix`) when every token sees only the first `sinks` tokens and its last
    `window` ones (None: everything): how far back the model looks. A sequence's FIFO cache of
    `sinks + window` tokens gives exactly this, so it tells what any policy can save over FIFO: nothing,
    where a short window is already within the tolerance.
    """
    from backends.engine.model import LlamaModel

    model = LlamaModel(model_dir, num_slots=1)
    rows = []
    for text in texts:
        logits = model.reference_logits(text, window=window, sinks=sinks)
        rows.append(torch.log_softmax(logits[prefix - 1 : len(text) - 1].float(), dim=-1))
    return perplexity_of(texts, rows, prefix)


def perplexity_of(texts: list[list[int]], logprobs: list[torch.Tensor], prefix: int) -> float:
    """Perplexity of the true next tokens under per-sequence log-probabilities (rows from `prefix`)."""
    nll, count = 0.0, 0
    for text, rows in zip(texts, logprobs, strict=True):
        n = rows.shape[0] if rows.numel() else 0
        if n == 0:
            continue
        targets = torch.tensor(text[prefix : prefix + n])
        nll -= float(rows[torch.arange(n), targets].sum())
        count += n
    return math.exp(nll / max(1, count))
