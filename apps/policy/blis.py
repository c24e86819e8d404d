"""BLIS cluster admission policies and tenant budgets, as seed 004 ("Admission Control") describes.

always-admit, token-bucket, tier-shed, gaie-legacy, reject-all; plus tenant budgets that shed only
sheddable traffic, and `AdmissionStage`, which runs budget then policy and keeps the per-tier shed
counters (ShedByTier) and the conservation count the simulator reports.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from apps.policy.bucket import TokenBucket
from apps.policy.errors import PolicyConfigError, require_finite, require_non_negative
from apps.policy.saturation import (
    DEFAULT_KV_THRESHOLD,
    DEFAULT_QD_THRESHOLD,
    DEFAULT_STALENESS_S,
    InstanceSnapshot,
    pool_saturation,
    validate_thresholds,
)
from apps.policy.slo import is_sheddable, merged_priorities, priority_in

REASON_INSUFFICIENT_TOKENS = "insufficient tokens"
REASON_TIER_SHED = "tier-shed"
REASON_SATURATED = "gaie-saturated"
REASON_REJECT_ALL = "reject-all"
REASON_TENANT_BUDGET = "tenant-budget"


@dataclass(frozen=True, slots=True)
class BlisRequest:
    input_tokens: int
    slo_class: str = "standard"
    tenant_id: str = ""


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What an admission policy may look at: the instances' last snapshots and the clock (seconds)."""

    instances: Sequence[InstanceSnapshot] = ()
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class PolicyDecision:
    admitted: bool
    reason: str = ""


ADMIT = PolicyDecision(True)


class AdmissionPolicy(Protocol):
    name: str

    def admit(self, request: BlisRequest, cluster: ClusterView) -> PolicyDecision: ...


class AlwaysAdmit:
    name = "always-admit"

    def admit(self, request: BlisRequest, cluster: ClusterView) -> PolicyDecision:
        return ADMIT


class RejectAll:
    name = "reject-all"

    def admit(self, request: BlisRequest, cluster: ClusterView) -> PolicyDecision:
        return PolicyDecision(False, REASON_REJECT_ALL)


class TokenBucketAdmission:
    """Cost = input tokens; bucket starts full, refills continuously, capped at capacity."""

    name = "token-bucket"

    def __init__(self, capacity: float = 10_000, refill_rate: float = 1_000) -> None:
        self.bucket = TokenBucket(capacity, refill_rate)

    def admit(self, request: BlisRequest, cluster: ClusterView) -> PolicyDecision:
        if self.bucket.try_consume(max(0, request.input_tokens), cluster.now):
            return ADMIT
        return PolicyDecision(False, REASON_INSUFFICIENT_TOKENS)


class TierShed:
    """Under overload (max per-instance queue depth + batch size strictly above the threshold),
    reject requests whose SLO priority is below `min_priority`."""

    name = "tier-shed"

    def __init__(
        self, threshold: float = 0, min_priority: int = 3, slo_priorities: Mapping[str, int] | None = None
    ) -> None:
        self.threshold = require_non_negative("tier_shed_threshold", threshold)
        if isinstance(min_priority, bool) or not isinstance(min_priority, int):
            raise PolicyConfigError(f"tier_shed_min_priority must be an integer, got {min_priority!r}")
        self.min_priority = min_priority
        self.priorities = merged_priorities(slo_priorities)

    def overloaded(self, cluster: ClusterView) -> bool:
        return any(instance.effective_load > self.threshold for instance in cluster.instances)

    def admit(self, request: BlisRequest, cluster: ClusterView) -> PolicyDecision:
        if priority_in(self.priorities, request.slo_class) >= self.min_priority:
            return ADMIT
        if self.overloaded(cluster):
            return PolicyDecision(False, REASON_TIER_SHED)
        return ADMIT


class GaieLegacy:
    """Non-sheddable always passes; sheddable is rejected when pool-average saturation >= 1.0."""

    name = "gaie-legacy"

    def __init__(
        self,
        qd_threshold: float = DEFAULT_QD_THRESHOLD,
        kv_threshold: float = DEFAULT_KV_THRESHOLD,
        slo_priorities: Mapping[str, int] | None = None,
        staleness_s: float = DEFAULT_STALENESS_S,
    ) -> None:
        self.qd_threshold, self.kv_threshold = validate_thresholds(qd_threshold, kv_threshold)
        self.staleness_s = require_non_negative("staleness_s", staleness_s)
        self.priorities = merged_priorities(slo_priorities)

    def saturation(self, cluster: ClusterView) -> float:
        return pool_saturation(
            cluster.instances, self.qd_threshold, self.kv_threshold, cluster.now, self.staleness_s
        )

    def admit(self, request: BlisRequest, cluster: ClusterView) -> PolicyDecision:
        if not is_sheddable(priority_in(self.priorities, request.slo_class)):
            return ADMIT
        if self.saturation(cluster) >= 1.0:
            return PolicyDecision(False, REASON_SATURATED)
        return ADMIT


class TenantBudgets:
    """Per-tenant capacity budgets; a tenant at or over its budget has only its sheddable requests
    shed (critical and standard are always protected). Tenants without a budget are unlimited."""

    def __init__(self, budgets: Mapping[str, float], slo_priorities: Mapping[str, int] | None = None) -> None:
        self.budgets = {
            str(tenant): require_non_negative(f"budget[{tenant!r}]", value) for tenant, value in budgets.items()
        }
        self.priorities = merged_priorities(slo_priorities)

    def admit(self, request: BlisRequest, tenant_usage: float) -> PolicyDecision:
        budget = self.budgets.get(request.tenant_id)
        if budget is None or tenant_usage < budget:
            return ADMIT
        if is_sheddable(priority_in(self.priorities, request.slo_class)):
            return PolicyDecision(False, REASON_TENANT_BUDGET)
        return ADMIT


_FACTORIES: dict[str, Callable[..., AdmissionPolicy]] = {
    "always-admit": AlwaysAdmit,
    "token-bucket": TokenBucketAdmission,
    "tier-shed": TierShed,
    "gaie-legacy": GaieLegacy,
    "reject-all": RejectAll,
}

# The YAML field names of seed 004's policy bundle, mapped onto constructor arguments.
_BUNDLE_FIELDS = {
    "token_bucket_capacity": "capacity",
    "token_bucket_refill_rate": "refill_rate",
    "tier_shed_threshold": "threshold",
    "tier_shed_min_priority": "min_priority",
    "gaie_qd_threshold": "qd_threshold",
    "gaie_kv_threshold": "kv_threshold",
}


def admission_policy_names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def make_admission_policy(name: str, **params: Any) -> AdmissionPolicy:
    """Build a policy by its seed-004 name; accepts constructor names or the bundle's YAML names."""
    factory = _FACTORIES.get(str(name).strip().lower())
    if factory is None:
        raise PolicyConfigError(
            f"unknown admission policy {name!r}; expected one of {', '.join(admission_policy_names())}"
        )
    arguments = {_BUNDLE_FIELDS.get(key, key): value for key, value in params.items()}
    for key, value in arguments.items():
        if isinstance(value, float):
            require_finite(key, value)
    try:
        return factory(**arguments)
    except TypeError as error:
        raise PolicyConfigError(f"invalid parameters for {name!r}: {error}") from None


@dataclass
class AdmissionStage:
    """Tenant budget, then the cluster policy; counts every outcome so that
    `offered == admitted + rejected` (the seed's conservation formula) can be checked."""

    policy: AdmissionPolicy
    tenant_budgets: TenantBudgets | None = None
    admitted: int = 0
    rejected: int = 0
    shed_by_tier: Counter[str] = field(default_factory=Counter)

    def admit(self, request: BlisRequest, cluster: ClusterView, tenant_usage: float = 0.0) -> PolicyDecision:
        decision = ADMIT
        if self.tenant_budgets is not None:
            decision = self.tenant_budgets.admit(request, tenant_usage)
        if decision.admitted:
            decision = self.policy.admit(request, cluster)
        if decision.admitted:
            self.admitted += 1
        else:
            self.rejected += 1
            self.shed_by_tier[request.slo_class or "standard"] += 1
        return decision

    @property
    def offered(self) -> int:
        return self.admitted + self.rejected
