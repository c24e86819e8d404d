"""Adapters that let the cluster drive `apps.policy`: BLIS's admission policies (through `AdmissionStage`)
and the seed-000 token-pools admission (through `AdmissionLedger`). Every decision, queue, release, debt and
burst update is the policy package's; these classes only translate simulator requests and clocks.
"""

from __future__ import annotations

import datetime as dt
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from apps.policy.admission import (
    AdmissionConfig,
    AdmissionRequest,
    EntitlementLimits,
    EntitlementState,
    resolved_max_tokens,
)
from apps.policy.aimd import AimdController, LatencyHistogram
from apps.policy.blis import AdmissionStage, BlisRequest, ClusterView, TenantBudgets, make_admission_policy
from apps.policy.errors import PolicyConfigError
from apps.policy.ledger import AdmissionLedger
from apps.policy.priority import Dynamics, DynamicsConfig
from apps.policy.quota import QUOTA_ON_EXCEEDED, QUOTA_WINDOWS, QuotaClaim, QuotaRule
from apps.policy.saturation import InstanceSnapshot, pool_saturation
from apps.simulator.cluster import ADMIT_NOW, Cluster, GateDecision, HoldNothing
from apps.simulator.workload import TenantSpec
from backends.virtual_vllm.instance import SimRequest

BLIS_POLICIES = ("always-admit", "token-bucket", "tier-shed", "gaie-legacy", "reject-all")


def instance_snapshots(cluster: Cluster) -> list[InstanceSnapshot]:
    now = cluster.loop.time
    return [
        InstanceSnapshot(len(i.waiting), i.kv_utilization, updated_at=now, batch_size=len(i.running))
        for i in cluster.instances
        if i.online
    ]


class BlisAdmission(HoldNothing):
    """One of seed 004's cluster admission policies, optionally behind per-tenant budgets."""

    def __init__(
        self,
        policy: str,
        params: dict[str, Any] | None = None,
        tenant_budgets: dict[str, float] | None = None,
        slo_priorities: dict[str, int] | None = None,
    ) -> None:
        params = dict(params or {})
        if slo_priorities and policy in ("tier-shed", "gaie-legacy"):
            params.setdefault("slo_priorities", slo_priorities)
        budgets = TenantBudgets(tenant_budgets, slo_priorities) if tenant_budgets else None
        self.stage = AdmissionStage(make_admission_policy(policy, **params), budgets)
        self.name = policy
        # Only these two read instance state; the others get an empty view (keeps the hot path lean).
        self.needs_snapshots = policy in ("tier-shed", "gaie-legacy")

    def bind(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def decide(self, request: SimRequest) -> GateDecision:
        cluster = self.cluster
        view = ClusterView(instance_snapshots(cluster) if self.needs_snapshots else (), cluster.loop.time)
        usage = float(cluster.stats.tenants[request.tenant].in_flight)
        decision = self.stage.admit(
            BlisRequest(request.prompt_tokens, request.slo_class or "standard", request.tenant), view, usage
        )
        if decision.admitted:
            return ADMIT_NOW
        return GateDecision("reject", decision.reason)


@dataclass
class DebtSample:
    time: float
    debt: dict[str, float] = field(default_factory=dict)
    burst: dict[str, float] = field(default_factory=dict)
    priority: dict[str, float] = field(default_factory=dict)


# Virtual time 0 is this instant on the calendar, for quota windows (hour, day, month).
SIM_EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def quota_rules(tenant: TenantSpec) -> tuple[QuotaRule, ...]:
    """`entitlement.quota: {tokens: N, window: hour|day|month, timezone: ..., on_exceeded: reject|spot}`, as the
    gateway enforces it (money quotas need pool prices, which scenarios do not have)."""
    quota = tenant.entitlement.get("quota")
    if quota is None:
        return ()
    if not isinstance(quota, dict) or not isinstance(quota.get("tokens"), int) or quota["tokens"] < 1:
        raise PolicyConfigError(f"tenant {tenant.name!r}: entitlement.quota needs tokens (a positive integer)")
    if quota.get("window") not in QUOTA_WINDOWS:
        raise PolicyConfigError(f"tenant {tenant.name!r}: entitlement.quota.window must be one of "
                                f"{', '.join(QUOTA_WINDOWS)}")
    on_exceeded = quota.get("on_exceeded", "reject")
    if on_exceeded not in QUOTA_ON_EXCEEDED:
        raise PolicyConfigError(f"tenant {tenant.name!r}: entitlement.quota.on_exceeded must be one of "
                                f"{', '.join(QUOTA_ON_EXCEEDED)}")
    return (QuotaRule(f"entitlement:{tenant.name}", float(quota["tokens"]), quota["window"],
                      str(quota.get("timezone", "UTC")), on_exceeded=on_exceeded),)


def entitlement_limits(tenant: TenantSpec) -> EntitlementLimits:
    """The entitlement a scenario tenant holds: its `entitlement:` mapping, with the tenant's SLO."""
    spec = dict(tenant.entitlement)
    spec.pop("quota", None)  # `quota_rules`
    spec.setdefault("slo_target_ms", tenant.slo_target_ms or 1000.0)
    spec.setdefault("tenant_id", tenant.name)
    try:
        return EntitlementLimits(entitlement_id=tenant.name, **spec)
    except (TypeError, PolicyConfigError) as error:
        raise PolicyConfigError(f"tenant {tenant.name!r}: entitlement: {error}") from None


class TokenPoolsAdmission:
    """Seed 000's admission: the five ordered checks, priority (1), debt (2) and burst (3) ticks, the
    pool-contention queue and Retry-After, all from `AdmissionLedger`. Entitlements bind when their tenant
    joins and expire when it leaves; pool capacity follows the cluster's online slots."""

    name = "token-pools"

    def __init__(
        self,
        tenants: list[TenantSpec],
        *,
        seed: int = 0,
        tick_s: float = 1.0,
        expire_check_s: float = 0.05,
        config: AdmissionConfig | None = None,
        dynamics: DynamicsConfig | None = None,
        mean_slo_ms: float | None = None,
        retry_jitter: float = 0.0,
        use_saturation: bool = False,
        aimd: AimdController | None = None,
        aimd_tick_s: float = 5.0,
        aimd_window_ticks: int = 6,
        aimd_bounds_s: list[float] | None = None,
    ) -> None:
        self.tenants = tenants
        # Seed 002's AIMD on the pool's dispatch budget, a check of the same state machine (`set_budget`).
        self.aimd = aimd
        self.aimd_tick_s = aimd_tick_s
        self.ttft = None if aimd is None else LatencyHistogram(aimd_bounds_s or aimd.histogram_bounds(),
                                                                window_ticks=aimd_window_ticks)
        self.budget_samples: list[tuple[float, int, str]] = []
        # Requests that waited in their entitlement's own queue: how long (left out of the budget's TTFT).
        self.own_wait: dict[str, float] = {}
        self.limits = {tenant.name: entitlement_limits(tenant) for tenant in tenants}
        self.quotas = {tenant.name: rules for tenant in tenants if (rules := quota_rules(tenant))}
        self.seed = seed
        self.tick_s = tick_s
        self.expire_check_s = expire_check_s
        self.config = config or AdmissionConfig()
        self.dynamics_config = dynamics or DynamicsConfig()
        self.mean_slo_ms = mean_slo_ms
        self.retry_jitter = retry_jitter
        self.use_saturation = use_saturation
        self.held: dict[str, SimRequest] = {}
        # Held requests waiting in their entitlement's own queue (their expiry is a queue_timeout).
        self.own_held: set[str] = set()
        self._wake_at = math.inf
        self.ready: deque[SimRequest] = deque()
        self.live: dict[str, SimRequest] = {}
        self.retired: set[str] = set()
        self.debt_samples: list[DebtSample] = []
        self.priorities: dict[str, float] = {}

    def bind(self, cluster: Cluster) -> None:
        self.cluster = cluster
        loop = cluster.loop
        self.ledger = AdmissionLedger(
            concurrency_capacity=cluster.slot_capacity(),
            mean_slo_ms=self.mean_slo_ms,
            config=self.config,
            dynamics_config=self.dynamics_config,
            rng=random.Random(f"{self.seed}:ledger"),
            retry_jitter=self.retry_jitter,
            now=0.0,
        )
        for tenant in self.tenants:
            loop.at(tenant.start, self._join, tenant.name)
            if tenant.stop is not None:
                loop.at(tenant.stop, self._leave, tenant.name)
        loop.at(self.tick_s, self._tick, daemon=True)
        if self.aimd is not None:
            cluster.listeners.append(self._observe)
            self.ledger.set_budget(self.aimd.cap, 0.0)
            loop.at(self.aimd_tick_s, self._aimd_tick, daemon=True)

    def _observe(self, event: str, request: SimRequest) -> None:
        if event == "first_token" and request.first_token_at is not None and self.ttft is not None:
            # The gateway's TTFT: from arrival at the gateway, queue wait included (seed 002, section 1), but not
            # a wait in the entitlement's own queue (its own limit, not the pool's load: as the gateway's budget).
            own_wait = self.own_wait.pop(str(request.rid), 0.0)
            self.ttft.observe(max(0.0, request.first_token_at - request.arrival - own_wait))

    def _aimd_tick(self) -> None:
        assert self.aimd is not None and self.ttft is not None
        now = self.cluster.loop.time
        ledger = self.ledger
        demand = ledger.running > 0 or ledger.waiting > 0 or ledger.queued > 0
        cap = self.aimd.tick_histogram(self.ttft, demand)
        self._collect(ledger.set_budget(cap, now))
        self.budget_samples.append((now, cap, self.aimd.last_action))
        self.cluster.loop.after(self.aimd_tick_s, self._aimd_tick, daemon=True)

    # ---- entitlement lifecycle -------------------------------------------------------------------
    def _join(self, name: str) -> None:
        self.ledger.upsert_entitlement(self.limits[name], self.cluster.loop.time)
        self.retired.discard(name)
        self._sync_held()

    def _leave(self, name: str) -> None:
        limits = replace(self.limits[name], state=EntitlementState.EXPIRED, concurrency=0, kv_bytes=None)
        self.ledger.upsert_entitlement(limits, self.cluster.loop.time)
        self.retired.add(name)
        self._sync_held()

    def _sync_held(self) -> None:
        """`upsert_entitlement` drains the ledger's queue without returning what it started; find those."""
        started = [key for key in self.held if self.ledger.request_state(key) == "running"]
        self._collect(started)

    def _tick(self) -> None:
        now = self.cluster.loop.time
        if self.use_saturation:
            self._collect(
                self.ledger.set_saturation(pool_saturation(instance_snapshots(self.cluster), now=now), now)
            )
        dynamics = self.ledger.tick(now)
        self._record(now, dynamics)
        for name in list(self.retired):
            try:
                self.ledger.remove_entitlement(name)
                self.retired.discard(name)
            except PolicyConfigError:
                pass  # still has requests in flight; try again next tick
        self.cluster.loop.after(self.tick_s, self._tick, daemon=True)

    def _record(self, now: float, dynamics: Any) -> None:
        sample = DebtSample(now)
        mean = self.ledger.mean_slo_ms
        from apps.policy.admission import request_priority

        for name, state in dynamics.items():
            limits = self.ledger.limits(name)
            if limits is None:
                continue
            sample.debt[name] = state.debt
            sample.burst[name] = state.burst
            sample.priority[name] = request_priority(
                limits.traits, limits.slo_target_ms, mean, state.burst, state.debt, self.config
            )
        self.debt_samples.append(sample)

    def dynamics(self, name: str) -> Dynamics:
        return self.ledger.dynamics(name)

    # ---- the gateway's calls ---------------------------------------------------------------------
    def decide(self, request: SimRequest) -> GateDecision:
        now = self.cluster.loop.time
        offered = self.offer_of(request)
        key = offered.request_id
        tenant = request.tenant
        # Most scenarios have no quota: skip building the claim (`_claim` returns None for them).
        claim = self._claim(tenant, offered, now) if self.quotas else None
        result = self.ledger.request(tenant, offered, now, quota=claim)
        decision = result.decision
        if result.evicted:
            for evicted in result.evicted:
                victim = self.live.pop(evicted, None)
                if victim is not None:
                    self.cluster.evict(victim, "evicted")
                    # As the gateway does once the victim's stream is cut: settles its quota, if any.
                    self.ledger.release(evicted, now, victim.generated)
        if not (decision.admitted or decision.queued):
            # Non-retryable rejections carry no Retry-After; the client falls back to its own backoff.
            retry = decision.retry_after_s if decision.retryable else None
            return GateDecision("reject", decision.reason, retry_after_s=retry)
        served = decision.served_class or str(self.limits[tenant].service_class)
        if decision.admitted:
            self.live[key] = request
            started = result.started
            if started != (key,) or self.ready:  # the common case: it started alone, nothing to hand back
                self._collect(tuple(s for s in started if s != key))
            return GateDecision("admit", decision.reason, priority=decision.priority, served_class=served)
        self.held[key] = request
        if decision.own_queue:
            self.own_held.add(key)
        self._collect(result.started)
        self._schedule_wake()
        return GateDecision("queue", decision.reason, priority=decision.priority, served_class=served)

    def offer_of(self, request: SimRequest) -> AdmissionRequest:
        """What the gateway offers the state machine for this request; a scenario's client asks for exactly the
        tokens it will get (a replay asks for its recorded max_tokens: `apps.simulator.replay`)."""
        return AdmissionRequest(str(request.rid), request.prompt_tokens, request.output_tokens)  # max_tokens

    def _claim(self, tenant: str, request: AdmissionRequest, now: float) -> QuotaClaim | None:
        """The request's quota reservation, as the gateway's admission step builds it."""
        rules = self.quotas.get(tenant)
        max_tokens = None if rules is None else resolved_max_tokens(self.limits[tenant], request)
        if rules is None or max_tokens is None:
            return None
        when = SIM_EPOCH + dt.timedelta(seconds=now)
        return QuotaClaim(request.request_id, request.input_tokens, max_tokens,
                          tuple(rule.charge_at(when) for rule in rules), when.timestamp(), scope=tenant)

    def _collect(self, started: Any) -> None:
        for key in started:
            if key in self.own_held:
                self.own_held.discard(key)
                if self.ttft is not None and key in self.held:
                    self.own_wait[key] = self.cluster.loop.time - self.held[key].arrival
            request = self.held.pop(key, None)
            if request is not None:
                self.live[key] = request
                self.ready.append(request)
        if self.ready:
            self.cluster.loop.after(0.0, self.cluster.pump)

    def _schedule_wake(self) -> None:
        """Have `_wake` run when the state machine next needs it (a deadline, a queue's bucket refilled)."""
        now = self.cluster.loop.time
        at = self.ledger.next_wake(now)
        if at < self._wake_at:
            self._wake_at = at
            # The epsilon keeps `deadline <= now` true despite float rounding.
            self.cluster.loop.at(max(at, now) + 1e-9, self._wake)

    def _wake(self) -> None:
        now = self.cluster.loop.time
        if now + 1e-9 < self._wake_at:
            return  # an earlier schedule that a later one replaced
        self._wake_at = math.inf
        result = self.ledger.wake(now)
        for key in result.expired:
            request = self.held.pop(key, None)
            own = key in self.own_held
            self.own_held.discard(key)
            if request is not None:
                self.cluster.expire(request, "queue_timeout" if own else "expired")
        self._collect(result.started)
        self._schedule_wake()

    def on_dispatch(self, request: SimRequest) -> None:
        return None

    def on_done(self, request: SimRequest) -> None:
        key = str(request.rid)
        if self.live.pop(key, None) is None:
            return
        produced = request.generated if request.outcome.startswith("lost") else request.output_tokens
        result = self.ledger.release(key, self.cluster.loop.time, produced)
        if result.started or self.ready:
            self._collect(result.started)
        if self.own_held:
            self._schedule_wake()

    def next_dispatch(self) -> SimRequest | None:
        return self.ready.popleft() if self.ready else None

    def queued(self) -> int:
        return len(self.held) + len(self.ready)

    def on_capacity_change(self) -> None:
        now = self.cluster.loop.time
        self._collect(self.ledger.set_capacity(self.cluster.slot_capacity(), now))
