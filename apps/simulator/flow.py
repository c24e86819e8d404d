"""Gateway queues driven from `apps.policy`: BLIS flow control (`FlowController`, saturation-gated dispatch,
in-flight eviction) and seed 002's DRR over a global budget (`BudgetScheduler`) with the AIMD controller
(`AimdController`) tuning that budget from the gateway's own p99 TTFT."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from apps.policy.aimd import DEFAULT_TTFT_BUCKETS_S, AimdController, LatencyHistogram
from apps.policy.budget import BudgetScheduler, FlowConfig
from apps.policy.errors import PolicyConfigError
from apps.policy.flow_control import FlowController, FlowRequest, InFlight, select_eviction_victim
from apps.policy.saturation import pool_saturation
from apps.policy.slo import is_sheddable, merged_priorities, slo_priority
from apps.simulator.admission import instance_snapshots
from apps.simulator.cluster import Cluster, GateDecision
from apps.simulator.simulation import SimConfig
from backends.virtual_vllm.instance import SimRequest

_FLOW_KEYS = {"enabled", "dispatch_order", "fairness_policy", "per_band_capacity", "max_gateway_queue_depth",
              "queue_shedding", "dispatch_tick_interval", "in_flight_eviction", "qd_threshold", "kv_threshold",
              "weights"}  # fmt: skip


class FlowControlAdmission:
    """BLIS's FlowControlAdmission: the queue is the admission; dispatch while pool saturation < 1.0."""

    name = "flow-control"

    def __init__(
        self, spec: dict[str, Any], slo_priorities: dict[str, int] | None, slo_targets_s: dict[str, float]
    ):
        unknown = set(spec) - _FLOW_KEYS
        if unknown:
            raise PolicyConfigError(
                f"flow_control: unknown keys {sorted(unknown)}; allowed: {sorted(_FLOW_KEYS)}"
            )
        self.controller = FlowController(
            dispatch_order=str(spec.get("dispatch_order", "fifo")),
            fairness=str(spec.get("fairness_policy", "global-strict")),
            per_band_capacity=int(spec.get("per_band_capacity", 0)),
            max_queue_depth=int(spec.get("max_gateway_queue_depth", 0)),
            queue_shedding=bool(spec.get("queue_shedding", False)),
            slo_priorities=slo_priorities,
            slo_targets_s=slo_targets_s,
            weights=spec.get("weights"),
        )
        self.priorities = merged_priorities(slo_priorities)
        tick_us = float(spec.get("dispatch_tick_interval") or 1000.0)
        self.tick_s = tick_us / 1e6
        self.qd_threshold = float(spec.get("qd_threshold", 5.0))
        self.kv_threshold = float(spec.get("kv_threshold", 0.8))
        self.in_flight_eviction = bool(spec.get("in_flight_eviction", False))
        self.held: dict[str, SimRequest] = {}
        self.ready: deque[SimRequest] = deque()
        self.live: dict[int, SimRequest] = {}
        self._ticking = False
        self.evicted = 0

    def bind(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def saturation(self) -> float:
        return pool_saturation(instance_snapshots(self.cluster), self.qd_threshold, self.kv_threshold)

    def decide(self, request: SimRequest) -> GateDecision:
        now = self.cluster.loop.time
        key = str(request.rid)
        outcome = self.controller.enqueue(
            FlowRequest(key, request.tenant, request.slo_class or "standard", request.slo_target_s), now
        )
        if not outcome.accepted:
            return GateDecision("reject", outcome.reason)
        self.held[key] = request
        if outcome.shed is not None:
            victim = self.held.pop(outcome.shed.request.request_id, None)
            if victim is not None:
                self.cluster.loop.after(0.0, self.cluster.expire, victim, "shed")
        self.cluster.loop.after(0.0, self._dispatch)
        return GateDecision(
            "queue", "queued", priority=float(slo_priority(request.slo_class, self.priorities))
        )

    def _dispatch(self) -> None:
        controller = self.controller
        now = self.cluster.loop.time
        while len(controller):
            entry = controller.dispatch(now, self.saturation())
            if entry is None:
                break
            request = self.held.pop(entry.request.request_id, None)
            if request is not None:
                self.ready.append(request)
                self.cluster.pump()
        if len(controller) and self.in_flight_eviction:
            self._evict_for_waiting()
        if len(controller) and not self._ticking:
            self._ticking = True
            # A daemon: with nothing else left to happen (say every instance removed for good), the run ends
            # with the queue reported as still queued instead of ticking forever.
            self.cluster.loop.after(self.tick_s, self._tick, daemon=True)

    def _tick(self) -> None:
        self._ticking = False
        self._dispatch()

    def _evict_for_waiting(self) -> None:
        waiting_protected = any(not is_sheddable(entry.priority) for entry in self.controller.entries())
        if not waiting_protected or self.saturation() < 1.0:
            return
        candidates = [
            InFlight(str(r.rid), slo_priority(r.slo_class, self.priorities), r.dispatched_at or 0.0)
            for r in self.live.values()
        ]
        victim = select_eviction_victim(candidates)
        if victim is not None:
            request = self.live.pop(int(victim.request_id))
            self.evicted += 1
            self.cluster.evict(request, "gateway_evicted")

    def on_dispatch(self, request: SimRequest) -> None:
        self.live[request.rid] = request

    def on_done(self, request: SimRequest) -> None:
        self.live.pop(request.rid, None)
        if len(self.controller):
            self.cluster.loop.after(0.0, self._dispatch)

    def next_dispatch(self) -> SimRequest | None:
        return self.ready.popleft() if self.ready else None

    def queued(self) -> int:
        return len(self.controller) + len(self.ready)

    def on_capacity_change(self) -> None:
        self.cluster.loop.after(0.0, self._dispatch)


def build_flow_control(spec: dict[str, Any], config: SimConfig) -> FlowControlAdmission:
    flow = dict(spec.get("flow_control") or {})
    targets = spec.get("slo_targets") or {}
    if not isinstance(targets, dict):
        raise PolicyConfigError("slo_targets must map SLO classes to seconds")
    return FlowControlAdmission(flow, spec.get("slo_priorities"), {k: float(v) for k, v in targets.items()})


@dataclass
class AimdSample:
    time: float
    cap: int
    p99_s: float | None
    action: str
    in_flight: int
    queued: int


@dataclass
class DrrTrace:
    samples: list[AimdSample] = field(default_factory=list)
    dispatched: dict[str, int] = field(default_factory=dict)


class DrrAdmission:
    """Seed 002: per-tenant bounded queues, one global budget, DRR drain; optional AIMD on the budget."""

    name = "drr"

    def __init__(
        self,
        budget: int,
        flows: dict[Hashable, FlowConfig],
        *,
        acquire_timeout_s: float = 1.0,
        aimd: AimdController | None = None,
        aimd_tick_s: float = 5.0,
        window_ticks: int = 6,
        workers: int = 1,
        histogram_bounds_s: Sequence[float] | None = None,
    ) -> None:
        self.scheduler = BudgetScheduler(
            budget, flows, default_flow=FlowConfig(), acquire_timeout_s=acquire_timeout_s
        )
        self.aimd = aimd
        self.aimd_tick_s = aimd_tick_s
        self.workers = workers
        if histogram_bounds_s is None:
            histogram_bounds_s = DEFAULT_TTFT_BUCKETS_S if aimd is None else aimd.histogram_bounds()
        self.histogram = LatencyHistogram(histogram_bounds_s, window_ticks=window_ticks)
        self.ready: deque[SimRequest] = deque()
        self.trace = DrrTrace()

    def bind(self, cluster: Cluster) -> None:
        self.cluster = cluster
        cluster.listeners.append(self._observe)
        if self.aimd is not None:
            self.scheduler.set_budget(self.aimd.cap * self.workers, 0.0)
            cluster.loop.at(self.aimd_tick_s, self._aimd_tick, daemon=True)

    def _observe(self, event: str, request: SimRequest) -> None:
        if event == "first_token" and request.first_token_at is not None:
            # The gateway's TTFT: from arrival at the gateway, queue wait included (seed 002, section 1).
            self.histogram.observe(request.first_token_at - request.arrival)

    def _aimd_tick(self) -> None:
        assert self.aimd is not None
        p99 = self.histogram.quantile(0.99)
        cap = self.aimd.tick_histogram(self.histogram, self.scheduler.has_demand)
        self._take(self.scheduler.set_budget(cap * self.workers, self.cluster.loop.time))
        self.trace.samples.append(
            AimdSample(
                self.cluster.loop.time,
                cap,
                p99,
                self.aimd.last_action,
                self.scheduler.in_flight,
                self.scheduler.queued,
            )  # fmt: skip
        )
        self.cluster.loop.after(self.aimd_tick_s, self._aimd_tick, daemon=True)

    def _take(self, tickets: Any) -> None:
        for ticket in tickets:
            request: SimRequest = ticket.item
            self.ready.append(request)
            self.trace.dispatched[request.tenant] = self.trace.dispatched.get(request.tenant, 0) + 1
        if self.ready:
            self.cluster.pump()

    def decide(self, request: SimRequest) -> GateDecision:
        now = self.cluster.loop.time
        result = self.scheduler.submit(request.tenant, request, now)
        if not result.accepted:
            return GateDecision("reject", result.reason)
        self.cluster.loop.after(0.0, self._take, result.dispatched)
        if not any(ticket.item is request for ticket in result.dispatched):
            # The gateway's acquire(timeout=...): a request still queued at its own deadline gets its 504
            # then, not at the next sweep (a sweep every timeout/4 let queue wait run 25 % past the timeout).
            # The epsilon keeps `now - enqueued_at >= timeout` true despite float rounding.
            self.cluster.loop.after(self.scheduler.acquire_timeout_s + 1e-9, self._expire)
        return GateDecision("queue", "queued")

    def _expire(self) -> None:
        for ticket in self.scheduler.expire(self.cluster.loop.time):
            self.cluster.expire(ticket.item, "acquire_timeout")

    def on_dispatch(self, request: SimRequest) -> None:
        return None

    def on_done(self, request: SimRequest) -> None:
        if request.dispatched_at is None:
            return  # expired in the queue: it never held a slot
        self._take(self.scheduler.release(self.cluster.loop.time))

    def next_dispatch(self) -> SimRequest | None:
        return self.ready.popleft() if self.ready else None

    def queued(self) -> int:
        return self.scheduler.queued + len(self.ready)

    def on_capacity_change(self) -> None:
        return None


_DRR_KEYS = {
    "policy",
    "budget",
    "flows",
    "acquire_timeout_s",
    "aimd",
    "workers",
    "slo_targets",
    "flow_control",
}
_AIMD_KEYS = {"enabled", "target_p99_ttft_s", "tick_s", "window_s", "cap_per_worker_min", "cap_per_worker_max",
              "cap_per_worker_initial", "target_band_pct", "cooldown_ticks", "decrease_step", "mode", "factor",
              "min_samples", "histogram_buckets_s"}  # fmt: skip


def build_drr(spec: dict[str, Any], config: SimConfig) -> DrrAdmission:
    unknown = set(spec) - _DRR_KEYS
    if unknown:
        raise PolicyConfigError(
            f"admission (drr): unknown keys {sorted(unknown)}; allowed: {sorted(_DRR_KEYS)}"
        )
    flows_raw = spec.get("flows") or {}
    if not isinstance(flows_raw, dict):
        raise PolicyConfigError("admission.flows must map tenant names to {weight, queue_max}")
    flows: dict[Hashable, FlowConfig] = {}
    for name, flow in flows_raw.items():
        if not isinstance(flow, dict) or set(flow) - {"weight", "queue_max"}:
            raise PolicyConfigError(f"admission.flows[{name}]: expected {{weight, queue_max}}")
        flows[str(name)] = FlowConfig(**flow)
    workers = int(spec.get("workers", config.num_instances))
    aimd, tick_s, window_ticks, bounds = build_aimd(spec.get("aimd") or {})
    budget = int(spec.get("budget", 32))
    return DrrAdmission(
        budget,
        flows,
        acquire_timeout_s=float(spec.get("acquire_timeout_s", 1.0)),
        aimd=aimd,
        aimd_tick_s=tick_s,
        window_ticks=window_ticks,
        workers=workers,
        histogram_bounds_s=bounds,
    )


def build_aimd(aimd_spec: dict[str, Any]) -> tuple[AimdController | None, float, int, list[float] | None]:
    """An `aimd:` mapping (seed 002's controller) as (controller or None, tick seconds, window ticks, histogram
    bounds or None): the DRR gate's and the token-pools machine's budget read the same keys."""
    aimd = None
    tick_s = 5.0
    window_ticks = 6
    if aimd_spec.get("enabled", bool(aimd_spec)):
        unknown = set(aimd_spec) - _AIMD_KEYS
        if unknown:
            raise PolicyConfigError(
                f"admission.aimd: unknown keys {sorted(unknown)}; allowed: {sorted(_AIMD_KEYS)}"
            )
        tick_s = float(aimd_spec.get("tick_s", 5.0))
        window_ticks = max(1, round(float(aimd_spec.get("window_s", 30.0)) / tick_s))
        aimd = AimdController(
            float(aimd_spec.get("target_p99_ttft_s", 2.0)),
            int(aimd_spec.get("cap_per_worker_min", 16)),
            int(aimd_spec.get("cap_per_worker_max", 128)),
            band=float(aimd_spec.get("target_band_pct", 0.2)),
            cooldown_ticks=int(aimd_spec.get("cooldown_ticks", 3)),
            mode=str(aimd_spec.get("mode", "aimd")),
            factor=float(aimd_spec.get("factor", 0.5)),
            step=int(aimd_spec.get("decrease_step", 4)),
            min_samples=int(aimd_spec.get("min_samples", 10)),
            initial_cap=aimd_spec.get("cap_per_worker_initial"),
        )
    bounds = aimd_spec.get("histogram_buckets_s") if aimd is not None else None
    if bounds is not None and (isinstance(bounds, str) or not isinstance(bounds, Sequence)):
        raise PolicyConfigError(
            "admission.aimd.histogram_buckets_s must be a list of bucket bounds in seconds"
        )
    return aimd, tick_s, window_ticks, None if bounds is None else [float(bound) for bound in bounds]
