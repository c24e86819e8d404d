"""tokenpools policy engine: plain Python shared by the live gateway and the simulator.

No Django, DRF, Celery, Channels, Redis or HTTP imports (import-linter contract in pyproject.toml and
tests/policy/test_framework_free.py). Nothing reads the clock or global randomness: time comes in
as `now` (seconds, any monotonic origin) or through a `Clock`, randomness through `random.Random`.

Seeds: 000 = "Token Management in Multi-Tenant AI Inference Platforms" (token pools),
002 = "WFQ + AIMD on a multi-tenant vLLM gateway" (blog), 004 = BLIS "Admission Control" docs.

Module map (public API importable from `apps.policy`)
----------------------------------------------------
classes.py      `Dimension`, `ResourceVector` (tokens/s, KV bytes, concurrency: 000 s3.1);
                `ServiceClass` with `ClassTraits` (000 s3.2 Table 1: base weights 1000/1000/100/1/0.1,
                baseline reserved/time-averaged/none, burst, shrink/evict, DRR weight 8/8/4/1/1;
                the project's one class table), `SloTier`, default tier
                per class (dedicated, guaranteed -> critical; elastic -> standard; spot -> sheddable;
                preemptible -> background), `effective_slo_tier` (entitlement > class).
priority.py     `priority_weight` = 000 eq. (1); `service_gap`, `debt_update` = eq. (2) (gamma_d 0.7);
                `burst_delta`, `burst_update` = eq. (3) (own gamma_b); `update_dynamics`, `Dynamics`,
                `DynamicsConfig`.
bucket.py       `TokenBucket(capacity, refill_rate)`: `try_consume(cost, now)`, `refund`, `level`,
                `seconds_until` (004 "Token Bucket Mechanics"; 000 check 4 with refunds).
slo.py          `slo_priority(slo_class, overrides=None)`, `is_sheddable(priority)`,
                `DEFAULT_SLO_PRIORITIES` (004 "SLO Tier Priorities": 4/3/-1/-2/-3),
                `merged_priorities(overrides)` and `priority_in(table, slo_class)` for hot paths;
                `known_slo_tier`, and `relaxed_slo_tier`: a request's objective only relaxes its tier.
saturation.py   `InstanceSnapshot(queue_depth, kv_utilization, updated_at=None)`,
                `pool_saturation(...)` (004 "Saturation Formula", GAIE defaults 5 and 0.8).
blis.py         004 admission policies: `AlwaysAdmit`, `TokenBucketAdmission`, `TierShed`, `GaieLegacy`,
                `RejectAll`, `make_admission_policy(name, **params)`; `TenantBudgets` (shed only
                sheddable); `AdmissionStage` (budget + policy + ShedByTier + conservation counts).
admission.py    000 s4.3 ordered checks: `admit(limits, usage, pool, request)` ->
                `AdmissionDecision`; `EntitlementLimits`, `EntitlementUsage`, `PoolUsage`,
                `AdmissionRequest`, `AdmissionConfig`, `EntitlementState`, `Reason` (codes match
                ARCHITECTURE.md: entitlement_not_bound, max_tokens_invalid, context_length_exceeded,
                concurrency_limit_exceeded, rate_limit_exceeded, kv_cache_limit_exceeded,
                pool_contended; plus queued / invalid_request).
ledger.py       `AdmissionLedger`: in-memory state applying admit / release (refund) / expire / evict /
                EWMA tick, waiting room ordered by priority, eviction of preemptible work.
fairness.py     `DeficitRoundRobin(weights)` (002 Act 1), `jain_fairness(values)`.
budget.py       `BudgetScheduler`: per-flow bounded queues, one global budget, DRR drain, per-tier
                `queue_max` (`FlowConfig`, `TIER_PRESETS`), acquire timeout, live budget changes (002).
flow_control.py `FlowController` (004 "Flow Control Admission": bands, per-flow FIFO, dispatch order
                fifo / priority / slo-deadline, fairness global-strict / round-robin / weighted-drr,
                per-band and global capacity, queue shedding, saturation gating);
                `select_eviction_victim` (004 "In-Flight Eviction").
aimd.py         `AimdController(target_p99_s, min_cap, max_cap, ...)`: `tick(p99_s, samples,
                has_demand)` and `.cap` (002, final form: deadband, demand gate counting in-flight,
                cooldown after decreases only, floor, ceiling, multiplicative or subtractive);
                `LatencyHistogram`, `histogram_quantile` (bucket interpolation), `ttft_histogram_bounds`
                (the one set of TTFT buckets of a target), `rebucket` (counts between bucket sets).
clock.py        `Clock` protocol, `MonotonicClock` (the only real clock), `ManualClock` (tests, simulator).
errors.py       `PolicyConfigError` (a ValueError): invalid parameters fail early with a clear message.

Refinements beyond the papers (each documented where it lives)
--------------------------------------------------------------
- Service gap counts only unmet demand: g = (min(baseline, demand) - served) / baseline, so an idle
  entitlement gains no debt and one bursting above baseline earns credit (negative debt).
- Spot and preemptible never accrue debt; a zero-baseline dimension contributes nothing to burst;
  the debt factor of (1) is floored at 0.1 so large credit never makes a weight negative.
- Pool contention needs priority strictly above the threshold (000: "must exceed").
- Idle reservations of dedicated/guaranteed entitlements are not lent to other classes
  (000 Table 1: reserved baseline is never reclaimed, even when idle).
- Eviction is all-or-nothing with at most `max_evictions_per_request` victims, and never for
  saturation alone (an external metric an eviction cannot be seen to lower).
"""

from __future__ import annotations

from apps.policy.admission import (
    AdmissionConfig,
    AdmissionDecision,
    AdmissionRequest,
    EntitlementLimits,
    EntitlementState,
    EntitlementUsage,
    PoolUsage,
    Reason,
    admit,
    request_priority,
)
from apps.policy.aimd import (
    AimdController,
    AimdParams,
    AimdRecord,
    LatencyHistogram,
    aimd_floor,
    aimd_step,
    histogram_quantile,
    rebucket,
    ttft_histogram_bounds,
)
from apps.policy.blis import (
    AdmissionStage,
    AlwaysAdmit,
    BlisRequest,
    ClusterView,
    GaieLegacy,
    PolicyDecision,
    RejectAll,
    TenantBudgets,
    TierShed,
    TokenBucketAdmission,
    make_admission_policy,
)
from apps.policy.bucket import TokenBucket
from apps.policy.budget import TIER_PRESETS, BudgetScheduler, FlowConfig, SubmitResult, Ticket
from apps.policy.classes import (
    CLASS_TRAITS,
    ClassTraits,
    Dimension,
    ResourceVector,
    ServiceClass,
    SloTier,
    default_slo_tier,
    effective_slo_tier,
)
from apps.policy.clock import Clock, ManualClock, MonotonicClock
from apps.policy.errors import PolicyConfigError
from apps.policy.fairness import DeficitRoundRobin, jain_fairness
from apps.policy.flow_control import (
    EnqueueOutcome,
    FlowController,
    FlowRequest,
    InFlight,
    QueuedEntry,
    select_eviction_victim,
)
from apps.policy.ledger import AdmissionLedger, LedgerCounters, LedgerResult, ReleaseResult
from apps.policy.priority import (
    Dynamics,
    DynamicsConfig,
    burst_delta,
    burst_update,
    debt_update,
    priority_weight,
    service_gap,
    update_dynamics,
)
from apps.policy.saturation import InstanceSnapshot, pool_saturation
from apps.policy.slo import (
    DEFAULT_SLO_PRIORITIES,
    is_sheddable,
    known_slo_tier,
    merged_priorities,
    priority_in,
    relaxed_slo_tier,
    slo_priority,
)

__all__ = [
    "CLASS_TRAITS",
    "DEFAULT_SLO_PRIORITIES",
    "TIER_PRESETS",
    "AdmissionConfig",
    "AdmissionDecision",
    "AdmissionLedger",
    "AdmissionRequest",
    "AdmissionStage",
    "AimdController",
    "AimdParams",
    "AimdRecord",
    "AlwaysAdmit",
    "BlisRequest",
    "BudgetScheduler",
    "ClassTraits",
    "Clock",
    "ClusterView",
    "DeficitRoundRobin",
    "Dimension",
    "Dynamics",
    "DynamicsConfig",
    "EnqueueOutcome",
    "EntitlementLimits",
    "EntitlementState",
    "EntitlementUsage",
    "FlowConfig",
    "FlowController",
    "FlowRequest",
    "GaieLegacy",
    "InFlight",
    "InstanceSnapshot",
    "LatencyHistogram",
    "LedgerCounters",
    "LedgerResult",
    "ManualClock",
    "MonotonicClock",
    "PolicyConfigError",
    "PolicyDecision",
    "PoolUsage",
    "QueuedEntry",
    "Reason",
    "RejectAll",
    "ReleaseResult",
    "ResourceVector",
    "ServiceClass",
    "SloTier",
    "SubmitResult",
    "TenantBudgets",
    "Ticket",
    "TierShed",
    "TokenBucket",
    "TokenBucketAdmission",
    "admit",
    "aimd_floor",
    "aimd_step",
    "burst_delta",
    "burst_update",
    "debt_update",
    "default_slo_tier",
    "effective_slo_tier",
    "histogram_quantile",
    "is_sheddable",
    "jain_fairness",
    "make_admission_policy",
    "merged_priorities",
    "known_slo_tier",
    "pool_saturation",
    "priority_in",
    "priority_weight",
    "rebucket",
    "relaxed_slo_tier",
    "request_priority",
    "select_eviction_victim",
    "service_gap",
    "slo_priority",
    "ttft_histogram_bounds",
    "update_dynamics",
]
