"""The model runner: the scheduler's `ModelRunner` over `LlamaModel`, the KV budget and an eviction policy.

The pool has exactly `budget_tokens` slots, so the budget M cannot be exceeded physically; the policy
decides *which* tokens occupy them. Before each forward the runner makes room for the incoming tokens
(exact global cut-off); if protected tokens alone leave too little room, it preempts the newest
sequences of the step, which the scheduler re-prefills later (the recompute penalty).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from backends.engine.eviction import EvictionPolicy, PoolView, ProtectedTokens, make_policy
from backends.engine.model import ForwardOutput, LlamaModel, SequenceCache
from backends.engine.scheduler import SamplingParams, SequenceResult, SequenceWork


@dataclass(frozen=True)
class RunnerConfig:
    budget_tokens: int
    max_batch_size: int = 16
    sink_tokens: int = 4
    recent_tokens: int = 8


@dataclass
class RunnerStats:
    steps: int = 0
    tokens_evicted: int = 0
    tokens_evicted_by_cutoff: int = 0
    tokens_evicted_voluntarily: int = 0
    preemptions: int = 0
    peak_used_tokens: int = 0
    last_used_tokens: int = 0
    policy_seconds_total: float = 0.0
    policy_seconds_last: float = 0.0
    evicted_by_policy: dict[str, int] = field(default_factory=dict)


def budget_tokens_for(mib: float, bytes_per_token: int) -> int:
    return max(1, int(mib * 1024 * 1024) // bytes_per_token)


class EngineRunner:
    def __init__(
        self,
        model_dir: str,
        policy: EvictionPolicy | str,
        config: RunnerConfig,
        device: str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        # Squared attention masses (Token-PD's risk) underflow into subnormals, ~100x slower on x86 CPUs.
        torch.set_flush_denormal(True)
        self.model = LlamaModel(model_dir, num_slots=config.budget_tokens, device=device, dtype=dtype)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.bind(
            config.budget_tokens,
            self.model.config.kv_bytes_per_token_in(dtype),
            config.budget_tokens,
            config.max_batch_size,
        )
        self.sequences: dict[str, SequenceCache] = {}
        self._free_rows: list[int] = []
        self._next_row = 0
        self._seen_by_row = torch.zeros(64, dtype=torch.long)
        pool = self.model.pool
        # Sinks and recent tokens, kept up to date on every admit, eviction and release.
        self.protected = ProtectedTokens(
            pool.owner, pool.position, pool.live, config.sink_tokens, config.recent_tokens
        )
        self._generators: dict[str, torch.Generator] = {}
        self._last_view: PoolView | None = None
        self.last_logits: dict[str, torch.Tensor] = {}
        self.stats = RunnerStats()

    # ---- ModelRunner -------------------------------------------------------------------------------
    def can_admit(self, num_tokens: int) -> bool:
        """Room for a prompt after what the policy could evict; without eviction, only free slots count."""
        pool = self.model.pool
        if num_tokens > self.config.budget_tokens:
            return True  # let it through so the runner reports a clear error instead of waiting forever
        if num_tokens <= pool.num_free:
            return True
        if not self.policy.evicts:
            return False
        return int(self._current_view().evictable.sum()) + pool.num_free >= num_tokens

    def release(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        self._generators.pop(request_id, None)
        if seq is None:
            return
        self.protected.release_row(seq.row, seq.slots)
        self.model.release(seq)
        self._seen_by_row[seq.row] = 0
        self._free_rows.append(seq.row)

    def run(self, work: Sequence[SequenceWork]) -> dict[str, SequenceResult]:
        import time

        results: dict[str, SequenceResult] = {}
        self.stats.steps += 1
        step = self.stats.steps
        active: list[SequenceWork] = []
        for item in work:
            if item.reset:
                self.release(item.request_id)
            if len(item.token_ids) > self.config.budget_tokens:
                results[item.request_id] = SequenceResult(
                    error=f"{len(item.token_ids)} tokens do not fit a KV budget of "
                    f"{self.config.budget_tokens} tokens"
                )
                continue
            if item.request_id not in self.sequences:
                self.sequences[item.request_id] = SequenceCache(row=self._take_row())
            active.append(item)

        policy_seconds = 0.0
        started = time.perf_counter()
        demand_extra = self._fit(active, results)
        policy_seconds += time.perf_counter() - started
        if not active:
            return results

        sequences = [self.sequences[item.request_id] for item in active]
        output = self.model.forward(sequences, [list(item.token_ids) for item in active])
        for seq in sequences:
            self._seen_by_row[seq.row] = seq.seen

        started = time.perf_counter()
        self.protected.admit(output.new_slots, self._seen_by_row)  # every policy: views read it
        if self.policy.evicts:  # a policy that never evicts needs none of the per-slot passes
            self._policy_step(step, active, sequences, output, demand_extra)
        used = self.model.pool.num_used
        policy_seconds += time.perf_counter() - started
        self.stats.policy_seconds_last = policy_seconds
        self.stats.policy_seconds_total += policy_seconds
        self.stats.last_used_tokens = used
        self.stats.peak_used_tokens = max(self.stats.peak_used_tokens, used)

        # Quality measurements (teacher forcing) read the logits of the step.
        self.last_logits = {item.request_id: output.logits[index] for index, item in enumerate(active)}
        for index, item in enumerate(active):
            if not item.sample:
                results[item.request_id] = SequenceResult()
                continue
            token = self._sample(item.request_id, output.logits[index], item.sampling)
            eos = self.model.config.eos_token_id
            results[item.request_id] = SequenceResult(token=token, is_eos=eos is not None and token == eos)
        return results

    # ---- internals ---------------------------------------------------------------------------------
    def _policy_step(
        self,
        step: int,
        active: list[SequenceWork],
        sequences: list[SequenceCache],
        output: ForwardOutput,
        demand_extra: int,
    ) -> None:
        self.policy.on_insert(output.new_slots, step)
        view = self.view(step)
        decode_rows = [i for i, item in enumerate(active) if item.sample]
        if decode_rows and type(self.policy).on_logits is not EvictionPolicy.on_logits:
            # Each sequence's newest slot is the last of the slots its new tokens took (in batch order).
            ends = torch.tensor([len(item.token_ids) for item in active], dtype=torch.long).cumsum(0) - 1
            newest = output.new_slots[ends[decode_rows]]
            self.policy.on_logits(view, newest, output.logits[decode_rows])
        self.policy.observe(view, output.slot_mass, output.slot_stepped)
        victims = self.policy.voluntary_evictions(view)
        self._evict(victims, voluntary=True)
        self.policy.end_step(view, self.model.pool.num_used + demand_extra)
        self._last_view = view  # exact until the next forward (see `_current_view`)

    def _take_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        row = self._next_row
        self._next_row += 1
        if row >= self._seen_by_row.numel():
            grown = torch.zeros(self._seen_by_row.numel() * 2, dtype=torch.long)
            grown[: self._seen_by_row.numel()] = self._seen_by_row
            self._seen_by_row = grown
        return row

    def _current_view(self) -> PoolView:
        """The view taken after the last step stays exact until the next forward: slots are only allocated
        inside the forward, and evictions and releases only clear `live`, a tensor the view shares with the
        pool. Reusing it saves rebuilding the protected mask over the whole pool before each cut-off."""
        if self._last_view is None:
            self._last_view = self.view()
        return self._last_view

    def view(self, step: int | None = None) -> PoolView:
        pool = self.model.pool
        running = torch.tensor([seq.row for seq in self.sequences.values()], dtype=torch.long)
        row_cached = torch.zeros(self._seen_by_row.numel(), dtype=torch.long)
        row_cached[running] = torch.tensor([seq.cached for seq in self.sequences.values()], dtype=torch.long)
        return PoolView(
            live=pool.live,
            # Kept incrementally (no pass over the pool); it stays exact across releases and evictions.
            protected=self.protected.mask,
            owner=pool.owner,
            position=pool.position,
            birth=pool.birth,
            owner_seen=None,  # gathered on demand from seen_by_row (only H2O reads it)
            seen_by_row=self._seen_by_row.clone(),
            num_rows=self._seen_by_row.numel(),
            running_rows=running,
            budget_tokens=self.config.budget_tokens,
            step=self.stats.steps if step is None else step,
            row_cached=row_cached,
        )

    def _fit(self, active: list[SequenceWork], results: dict[str, SequenceResult]) -> int:
        """Make the incoming tokens fit; returns the tokens the step wanted beyond what it kept."""
        pool = self.model.pool
        incoming = sum(len(item.token_ids) for item in active)
        need = incoming - pool.num_free
        if need <= 0:
            return 0
        demand_extra = need
        if self.policy.evicts:
            self._evict(self.policy.make_room(self._current_view(), need), voluntary=False)
        # Protected tokens left too little room: preempt the newest sequences of the step.
        while incoming > pool.num_free and active:
            item = active.pop()
            incoming -= len(item.token_ids)
            self.release(item.request_id)
            results[item.request_id] = SequenceResult(preempted=True)
            self.stats.preemptions += 1
        return demand_extra

    def _evict(self, victims: torch.Tensor, voluntary: bool) -> None:
        if victims.numel() == 0:
            return
        pool = self.model.pool
        marked = torch.zeros(pool.num_slots, dtype=torch.bool)
        marked[victims] = True
        self.protected.forget(victims)
        affected_rows = set(pool.owner[victims].tolist())
        evicted = self.model.evict_marked(
            [seq for seq in self.sequences.values() if seq.row in affected_rows], marked
        )
        self.stats.tokens_evicted += evicted
        if voluntary:
            self.stats.tokens_evicted_voluntarily += evicted
        else:
            self.stats.tokens_evicted_by_cutoff += evicted

    def _sample(self, request_id: str, logits: torch.Tensor, sampling: SamplingParams) -> int:
        if sampling.temperature <= 0:
            return int(logits.argmax())
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
            self._generators[request_id] = generator
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < sampling.top_p
            filtered = torch.zeros_like(probs)
            filtered[order[keep]] = sorted_probs[keep]
            probs = filtered / filtered.sum()
        return int(torch.multinomial(probs, 1, generator=generator))
