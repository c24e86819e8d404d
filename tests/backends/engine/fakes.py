"""A deterministic model runner for scheduler tests: no torch, exact bookkeeping of what it holds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from backends.engine.scheduler import SequenceResult, SequenceWork

EOS_TOKEN = 0


def expected_next_token(context: Sequence[int]) -> int:
    """The fake model's greedy choice: a pure function of the whole context, never EOS on its own."""
    return (sum(context) * 31 + len(context)) % 97 + 1


class FakeRunner:
    def __init__(self, capacity_tokens: int | None = None) -> None:
        self.capacity_tokens = capacity_tokens
        self.contexts: dict[str, list[int]] = {}
        self.release_calls: Counter[str] = Counter()
        self.releases_while_holding: Counter[str] = Counter()
        self.fail_next: set[str] = set()
        self.preempt_next: set[str] = set()
        self.eos_after: dict[str, int] = {}
        self.batches: list[list[SequenceWork]] = []

    def held_tokens(self) -> int:
        return sum(len(ctx) for ctx in self.contexts.values())

    def can_admit(self, num_tokens: int) -> bool:
        return self.capacity_tokens is None or self.held_tokens() + num_tokens <= self.capacity_tokens

    def run(self, work: Sequence[SequenceWork]) -> dict[str, SequenceResult]:
        self.batches.append(list(work))
        results: dict[str, SequenceResult] = {}
        for item in work:
            if item.reset:
                self.contexts.pop(item.request_id, None)
            context = self.contexts.setdefault(item.request_id, [])
            context.extend(item.token_ids)
            if item.request_id in self.fail_next:
                self.fail_next.discard(item.request_id)
                results[item.request_id] = SequenceResult(error="injected failure")
                continue
            if item.request_id in self.preempt_next:
                self.preempt_next.discard(item.request_id)
                results[item.request_id] = SequenceResult(preempted=True)
                continue
            if not item.sample:
                results[item.request_id] = SequenceResult()
                continue
            remaining = self.eos_after.get(item.request_id)
            if remaining is not None:
                self.eos_after[item.request_id] = remaining - 1
                if remaining <= 0:
                    results[item.request_id] = SequenceResult(token=EOS_TOKEN, is_eos=True)
                    continue
            results[item.request_id] = SequenceResult(token=expected_next_token(context))
        return results

    def release(self, request_id: str) -> None:
        self.release_calls[request_id] += 1
        if self.contexts.pop(request_id, None) is not None:
            self.releases_while_holding[request_id] += 1


def greedy_reference(prompt: Sequence[int], max_tokens: int) -> list[int]:
    context = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        token = expected_next_token(context)
        out.append(token)
        context.append(token)
    return out
