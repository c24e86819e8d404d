"""Our inference engine: continuous batching with per-tenant quotas and Token-PD KV eviction.

Only the scheduler is imported eagerly so that `from backends.engine import ContinuousBatchScheduler`
works without torch; the model, the eviction policies and the server import torch on demand.
"""

from __future__ import annotations

from backends.engine.scheduler import (
    AdmissionRejectedEvent,
    BatchSchedulerConfig,
    CompletedEvent,
    CompletionReason,
    ContinuousBatchScheduler,
    ModelRunner,
    PreemptedEvent,
    PrefillStrategy,
    PromptRequest,
    QuotaKind,
    RejectionReason,
    SamplingParams,
    SchedulerEvent,
    SequenceResult,
    SequenceWork,
    TenantConfig,
    TenantStateSnapshot,
    TokenEvent,
)

__all__ = [
    "AdmissionRejectedEvent",
    "BatchSchedulerConfig",
    "CompletedEvent",
    "CompletionReason",
    "ContinuousBatchScheduler",
    "ModelRunner",
    "PreemptedEvent",
    "PrefillStrategy",
    "PromptRequest",
    "QuotaKind",
    "RejectionReason",
    "SamplingParams",
    "SchedulerEvent",
    "SequenceResult",
    "SequenceWork",
    "TenantConfig",
    "TenantStateSnapshot",
    "TokenEvent",
]
