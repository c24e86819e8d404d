"""Continuous batching with per-tenant quotas (seed 003), independent of the model.

The scheduler owns the pending queue, the per-tenant accounting and the tick loop; a `ModelRunner`
does the arithmetic. Keeping torch out of this module lets the admission and quota logic be tested
with a deterministic fake runner and reused by the benchmark without a model.

Accounting rules worth knowing:
- KV blocks are *reserved* at admission for the whole request (prompt + max_tokens), so a tenant can
  never grow past `max_blocks` mid-decode; eviction may make the real footprint smaller, never larger.
- Every way a request ends goes through `_finish`, which releases the reservation exactly once.
- A request over its tenant's quota waits in the queue (the seed's "the remaining 98 wait"); only a
  request that could never fit (`estimate > max_blocks`) or, with `over_quota="reject"`, any request
  finding its tenant at quota is rejected with the `QuotaKind`.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol


class QuotaKind(Enum):
    CONCURRENT_REQUESTS = "concurrent-requests"
    KV_BLOCKS = "kv-blocks"


class RejectionReason(Enum):
    TENANT_QUOTA_EXCEEDED = "tenant_quota_exceeded"
    QUEUE_FULL = "queue_full"
    UNKNOWN_TENANT = "unknown_tenant"
    INVALID_REQUEST = "invalid_request"


class CompletionReason(Enum):
    END_OF_SEQUENCE = "stop"
    MAX_TOKENS_REACHED = "length"
    ENGINE_ERROR = "error"
    CANCELLED = "cancelled"
    EVICTED = "evicted"


class PrefillStrategy(Enum):
    BLOCKING_BEFORE_DECODE = "blocking"
    CHUNKED = "chunked"


@dataclass(frozen=True)
class TenantConfig:
    id: str
    max_concurrent: int = 4
    max_blocks: int = 1024
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError("weight must be positive: deficit round robin needs every tenant to earn credit")
        if self.max_concurrent < 0 or self.max_blocks < 0:
            raise ValueError("quotas cannot be negative")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class PromptRequest:
    tenant_id: str
    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()

    @property
    def max_emitted_tokens(self) -> int:
        return self.sampling.max_tokens


@dataclass(frozen=True)
class BatchSchedulerConfig:
    max_batch_size: int = 16
    max_pending_prompts: int = 256
    prefill_strategy: PrefillStrategy = PrefillStrategy.BLOCKING_BEFORE_DECODE
    block_size: int = 16
    # Prompt tokens fed per tick across all prefilling sequences under the chunked strategy.
    prefill_chunk_tokens: int = 64
    over_quota: Literal["queue", "reject"] = "queue"


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    tenant_id: str
    token: int
    position: int


@dataclass(frozen=True)
class CompletedEvent:
    request_id: str
    tenant_id: str
    reason: CompletionReason
    detail: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class AdmissionRejectedEvent:
    request_id: str
    tenant_id: str
    reason: RejectionReason
    quota: QuotaKind | None = None
    detail: str = ""


@dataclass(frozen=True)
class PreemptedEvent:
    """A running sequence lost its KV cache and will be re-prefilled (the recompute penalty)."""

    request_id: str
    tenant_id: str


SchedulerEvent = TokenEvent | CompletedEvent | AdmissionRejectedEvent | PreemptedEvent


@dataclass(frozen=True)
class TenantStateSnapshot:
    tenant_id: str
    active_count: int
    allocated_blocks: int
    pending_count: int
    max_concurrent: int
    max_blocks: int
    weight: float
    admitted_total: int
    completed_total: int
    rejected_total: int


@dataclass(frozen=True)
class SequenceWork:
    """What the runner must do for one sequence in one tick.

    `token_ids` are appended to the sequence's cache; `reset` asks the runner to drop whatever it
    holds for the sequence first (re-prefill after preemption); `sample` says whether the logits of
    the last token are needed (end of prompt, or decode).
    """

    request_id: str
    token_ids: tuple[int, ...]
    sample: bool
    sampling: SamplingParams
    reset: bool = False


@dataclass(frozen=True)
class SequenceResult:
    token: int | None = None
    is_eos: bool = False
    error: str | None = None
    preempted: bool = False


class ModelRunner(Protocol):
    def can_admit(self, num_tokens: int) -> bool:
        """Whether a sequence of this many prompt tokens fits in the KV pool right now."""
        ...

    def run(self, work: Sequence[SequenceWork]) -> dict[str, SequenceResult]:
        """One batched forward; a sequence missing from the answer is treated as an engine error."""
        ...

    def release(self, request_id: str) -> None:
        """Free every KV slot the sequence holds; called once per sequence that touched the runner."""
        ...


class _State(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    PREEMPTED = "preempted"


@dataclass
class _Sequence:
    request: PromptRequest
    reserved_blocks: int
    state: _State = _State.PREFILL
    # Tokens (prompt, then generated) the runner has not yet seen in cache.
    feed: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    touched_runner: bool = False
    needs_reset: bool = False
    finished: bool = False


@dataclass
class _Tenant:
    config: TenantConfig
    pending: deque[PromptRequest] = field(default_factory=deque)
    active_count: int = 0
    allocated_blocks: int = 0
    deficit: float = 0.0
    admitted_total: int = 0
    completed_total: int = 0
    rejected_total: int = 0


class ContinuousBatchScheduler:
    """Admits prompts by weighted deficit round robin under per-tenant quotas and drives the runner."""

    def __init__(self, runner: ModelRunner, config: BatchSchedulerConfig | None = None) -> None:
        self.runner = runner
        self.config = config or BatchSchedulerConfig()
        self._tenants: dict[str, _Tenant] = {}
        self._ring: list[str] = []
        self._ring_pointer = 0
        self._active: dict[str, _Sequence] = {}
        self._pending_total = 0
        self._pending_ids: set[str] = set()
        self._events: list[SchedulerEvent] = []
        self.preemptions_total = 0
        self.steps_total = 0

    # ---- tenants -------------------------------------------------------------------------------
    def register_tenant(self, config: TenantConfig) -> None:
        existing = self._tenants.get(config.id)
        if existing is not None:
            # Changing quotas keeps live accounting; new limits apply from the next admission.
            existing.config = config
            return
        self._tenants[config.id] = _Tenant(config=config)
        self._ring.append(config.id)

    def tenant_state(self, tenant_id: str) -> TenantStateSnapshot | None:
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            return None
        cfg = tenant.config
        return TenantStateSnapshot(
            tenant_id=tenant_id,
            active_count=tenant.active_count,
            allocated_blocks=tenant.allocated_blocks,
            pending_count=len(tenant.pending),
            max_concurrent=cfg.max_concurrent,
            max_blocks=cfg.max_blocks,
            weight=cfg.weight,
            admitted_total=tenant.admitted_total,
            completed_total=tenant.completed_total,
            rejected_total=tenant.rejected_total,
        )

    def tenant_ids(self) -> list[str]:
        return list(self._ring)

    # ---- observability -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return sum(1 for seq in self._active.values() if seq.state is not _State.PREEMPTED)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_pending(self) -> int:
        return self._pending_total

    def has_work(self) -> bool:
        return bool(self._active) or self._pending_total > 0 or bool(self._events)

    def blocks_for(self, request: PromptRequest) -> int:
        return math.ceil((len(request.token_ids) + request.sampling.max_tokens) / self.config.block_size)

    # ---- submission and cancellation -------------------------------------------------------------
    def submit(self, request: PromptRequest) -> AdmissionRejectedEvent | None:
        """Queue a request. A rejection is returned *and* reported by the next `step()`."""
        tenant = self._tenants.get(request.tenant_id)
        if tenant is None:
            return self._reject(request, RejectionReason.UNKNOWN_TENANT, None, "tenant is not registered")
        if not request.token_ids:
            return self._reject(request, RejectionReason.INVALID_REQUEST, None, "prompt is empty")
        if request.request_id in self._active or request.request_id in self._pending_ids:
            return self._reject(request, RejectionReason.INVALID_REQUEST, None, "duplicate request id")
        if self.blocks_for(request) > tenant.config.max_blocks:
            return self._reject(
                request,
                RejectionReason.TENANT_QUOTA_EXCEEDED,
                QuotaKind.KV_BLOCKS,
                f"needs {self.blocks_for(request)} blocks, tenant max_blocks={tenant.config.max_blocks}",
            )
        if tenant.config.max_concurrent == 0:
            return self._reject(
                request,
                RejectionReason.TENANT_QUOTA_EXCEEDED,
                QuotaKind.CONCURRENT_REQUESTS,
                "max_concurrent=0",
            )
        if self._pending_total >= self.config.max_pending_prompts:
            return self._reject(
                request, RejectionReason.QUEUE_FULL, None, f"{self._pending_total} prompts already pending"
            )
        tenant.pending.append(request)
        self._pending_total += 1
        self._pending_ids.add(request.request_id)
        return None

    def cancel(
        self, request_id: str, reason: CompletionReason = CompletionReason.CANCELLED, detail: str = ""
    ) -> bool:
        """End a request wherever it is; returns False if it is unknown or already finished."""
        if request_id in self._pending_ids:
            for tenant in self._tenants.values():
                for queued in tenant.pending:
                    if queued.request_id == request_id:
                        tenant.pending.remove(queued)
                        self._pending_total -= 1
                        self._pending_ids.discard(request_id)
                        self._events.append(
                            CompletedEvent(
                                request_id,
                                queued.tenant_id,
                                reason,
                                detail,
                                prompt_tokens=len(queued.token_ids),
                            )
                        )
                        return True
        seq = self._active.get(request_id)
        if seq is None:
            return False
        self._finish(seq, reason, detail)
        return True

    def evict(self, request_id: str, detail: str = "") -> bool:
        """Drop a running request for good (e.g. it cannot fit the KV budget even alone)."""
        seq = self._active.get(request_id)
        if seq is None:
            return False
        self._finish(seq, CompletionReason.EVICTED, detail)
        return True

    def shutdown(
        self, reason: CompletionReason = CompletionReason.CANCELLED, detail: str = ""
    ) -> list[SchedulerEvent]:
        """End everything, queued and running, releasing every quota and KV slot; returns the events."""
        for tenant in self._tenants.values():
            for request in list(tenant.pending):
                self.cancel(request.request_id, reason, detail)
        for request_id in list(self._active):
            self.cancel(request_id, reason, detail)
        events, self._events = self._events, []
        return events

    # ---- the tick --------------------------------------------------------------------------------
    def step(self) -> list[SchedulerEvent]:
        self.steps_total += 1
        self._admit()
        work = self._plan_work()
        if work:
            try:
                results = self.runner.run(work)
            except Exception as exc:  # one broken forward fails the batch, not the server
                results = {
                    item.request_id: SequenceResult(error=f"{type(exc).__name__}: {exc}") for item in work
                }
            self._apply(work, results)
        events, self._events = self._events, []
        return events

    def _reject(
        self, request: PromptRequest, reason: RejectionReason, quota: QuotaKind | None, detail: str
    ) -> AdmissionRejectedEvent:
        tenant = self._tenants.get(request.tenant_id)
        if tenant is not None:
            tenant.rejected_total += 1
        event = AdmissionRejectedEvent(request.request_id, request.tenant_id, reason, quota, detail)
        self._events.append(event)
        return event

    def _quota_block(self, tenant: _Tenant, request: PromptRequest) -> QuotaKind | None:
        if tenant.active_count >= tenant.config.max_concurrent:
            return QuotaKind.CONCURRENT_REQUESTS
        if tenant.allocated_blocks + self.blocks_for(request) > tenant.config.max_blocks:
            return QuotaKind.KV_BLOCKS
        return None

    def _eligible(self, tenant: _Tenant) -> bool:
        """Whether the tenant's head-of-line request can be admitted now (rejecting it if so configured)."""
        while tenant.pending:
            head = tenant.pending[0]
            blocked = self._quota_block(tenant, head)
            if blocked is None:
                return self.runner.can_admit(len(head.token_ids))
            if self.config.over_quota == "reject":
                self._pop_head(tenant)
                self._reject(head, RejectionReason.TENANT_QUOTA_EXCEEDED, blocked, "tenant at quota")
                continue
            return False
        return False

    def _pop_head(self, tenant: _Tenant) -> PromptRequest:
        request = tenant.pending.popleft()
        self._pending_total -= 1
        self._pending_ids.discard(request.request_id)
        return request

    def _admit(self) -> None:
        """Weighted deficit round robin: each visit adds `weight` credit; one admission costs 1."""
        if not self._ring:
            return
        visits_without_progress = 0
        while len(self._active) < self.config.max_batch_size and visits_without_progress < len(self._ring):
            tenant = self._tenants[self._ring[self._ring_pointer]]
            if not self._eligible(tenant):
                # A tenant that cannot use its turn banks no credit, so it cannot burst later.
                tenant.deficit = 0.0
                self._advance_ring()
                visits_without_progress += 1
                continue
            tenant.deficit += tenant.config.weight
            admitted = False
            while (
                tenant.deficit >= 1.0
                and len(self._active) < self.config.max_batch_size
                and self._eligible(tenant)
            ):
                self._start(tenant, self._pop_head(tenant))
                tenant.deficit -= 1.0
                admitted = True
            if len(self._active) >= self.config.max_batch_size and tenant.deficit >= 1.0:
                break  # keep the turn: the batch filled up in the middle of it
            self._advance_ring()
            visits_without_progress = 0 if admitted else visits_without_progress + 1
            if not admitted and tenant.deficit > 0:
                # Fractional weights need several visits; a visit that earned credit is progress.
                visits_without_progress = 0

    def _advance_ring(self) -> None:
        self._ring_pointer = (self._ring_pointer + 1) % len(self._ring)

    def _start(self, tenant: _Tenant, request: PromptRequest) -> None:
        blocks = self.blocks_for(request)
        tenant.active_count += 1
        tenant.allocated_blocks += blocks
        tenant.admitted_total += 1
        self._active[request.request_id] = _Sequence(
            request=request, reserved_blocks=blocks, feed=list(request.token_ids)
        )

    def _plan_work(self) -> list[SequenceWork]:
        work: list[SequenceWork] = []
        chunked = self.config.prefill_strategy is PrefillStrategy.CHUNKED
        chunk_budget = self.config.prefill_chunk_tokens
        resumed_this_tick = False
        for seq in self._active.values():
            if seq.state is _State.PREEMPTED:
                # Re-prefill one preempted sequence per tick, and only when the pool has room again.
                if resumed_this_tick or not self.runner.can_admit(
                    len(seq.request.token_ids) + len(seq.generated)
                ):
                    continue
                seq.state = _State.PREFILL
                seq.feed = list(seq.request.token_ids) + seq.generated
                seq.needs_reset = True
                resumed_this_tick = True
            if seq.state is _State.PREFILL:
                if chunked:
                    if chunk_budget <= 0:
                        continue
                    take = min(chunk_budget, len(seq.feed))
                    chunk_budget -= take
                else:
                    take = len(seq.feed)
                tokens, seq.feed = seq.feed[:take], seq.feed[take:]
                work.append(
                    SequenceWork(
                        seq.request.request_id,
                        tuple(tokens),
                        sample=not seq.feed,
                        sampling=seq.request.sampling,
                        reset=seq.needs_reset,
                    )
                )
                seq.needs_reset = False
            else:
                work.append(
                    SequenceWork(
                        seq.request.request_id, tuple(seq.feed), sample=True, sampling=seq.request.sampling
                    )
                )
                seq.feed = []
            seq.touched_runner = True
        return work

    def _apply(self, work: Iterable[SequenceWork], results: dict[str, SequenceResult]) -> None:
        for item in work:
            seq = self._active.get(item.request_id)
            if seq is None or seq.finished:
                continue
            result = results.get(item.request_id)
            if result is None:
                self._finish(seq, CompletionReason.ENGINE_ERROR, "runner returned no result")
                continue
            if result.error is not None:
                self._finish(seq, CompletionReason.ENGINE_ERROR, result.error)
                continue
            if result.preempted:
                self._preempt(seq)
                continue
            if not item.sample:
                continue  # a prefill chunk that did not reach the end of the prompt
            if result.token is None:
                self._finish(seq, CompletionReason.ENGINE_ERROR, "runner sampled no token")
                continue
            seq.state = _State.DECODE
            token = result.token
            position = len(seq.request.token_ids) + len(seq.generated)
            seq.generated.append(token)
            sampling = seq.request.sampling
            stop = token in sampling.stop_token_ids or (result.is_eos and not sampling.ignore_eos)
            if not stop:
                self._events.append(TokenEvent(item.request_id, seq.request.tenant_id, token, position))
            if stop:
                self._finish(seq, CompletionReason.END_OF_SEQUENCE)
            elif len(seq.generated) >= sampling.max_tokens:
                self._finish(seq, CompletionReason.MAX_TOKENS_REACHED)
            else:
                seq.feed = [token]

    def _preempt(self, seq: _Sequence) -> None:
        self.runner.release(seq.request.request_id)
        seq.state = _State.PREEMPTED
        seq.feed = []
        self.preemptions_total += 1
        self._events.append(PreemptedEvent(seq.request.request_id, seq.request.tenant_id))

    def _finish(self, seq: _Sequence, reason: CompletionReason, detail: str = "") -> None:
        if seq.finished:
            return
        seq.finished = True
        request = seq.request
        del self._active[request.request_id]
        tenant = self._tenants[request.tenant_id]
        tenant.active_count -= 1
        tenant.allocated_blocks -= seq.reserved_blocks
        tenant.completed_total += 1
        if seq.touched_runner:
            self.runner.release(request.request_id)
        self._events.append(
            CompletedEvent(
                request.request_id,
                request.tenant_id,
                reason,
                detail,
                prompt_tokens=len(request.token_ids),
                completion_tokens=len(seq.generated),
            )
        )


_request_counter = itertools.count()


def next_request_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{next(_request_counter)}"
