"""The cluster: gateway admission, an optional gateway queue, routing over instances, and the statistics.

Pipeline per request (BLIS's order): arrival -> admission latency -> admission decision -> (gateway queue)
-> routing latency -> instance. The admission decision and the queue come from `apps.policy` through the
adapters in `apps.simulator.admission`; this module only moves requests and counts them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from apps.simulator.engine import EventLoop
from backends.virtual_vllm.instance import Instance, SimRequest

ROUTING_POLICIES = ("round-robin", "least-loaded", "kv-aware")


@dataclass(slots=True)
class GateDecision:
    """What an admission adapter tells the gateway: admit now, hold in the gateway queue, or reject."""

    outcome: str  # "admit" | "queue" | "reject"
    reason: str = ""
    retry_after_s: float | None = None
    priority: float = 0.0
    # The class it is served as: its entitlement's, or lower (spilled over, demoted); "": the policy has none.
    served_class: str = ""

    # Written out (dataclasses keeps a class's own __init__): mypyc compiles this one, the generated one stays
    # interpreted, and every request gets a decision (make bench-sim).
    def __init__(self, outcome: str, reason: str = "", retry_after_s: float | None = None, priority: float = 0.0,
                 served_class: str = "") -> None:
        self.outcome = outcome
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.priority = priority
        self.served_class = served_class


ADMIT_NOW = GateDecision("admit")


class AdmissionAdapter(Protocol):
    name: str

    def bind(self, cluster: Cluster) -> None: ...

    def decide(self, request: SimRequest) -> GateDecision: ...

    def on_dispatch(self, request: SimRequest) -> None: ...

    def on_done(self, request: SimRequest) -> None: ...

    def next_dispatch(self) -> SimRequest | None:
        """A held request that may go to an instance now, if any (flow control / pool queue)."""
        ...

    def queued(self) -> int: ...

    def on_capacity_change(self) -> None: ...


class HoldNothing:
    """Shared no-op hooks for admission adapters without a gateway queue."""

    def on_dispatch(self, request: SimRequest) -> None:
        return None

    def on_done(self, request: SimRequest) -> None:
        return None

    def next_dispatch(self) -> SimRequest | None:
        return None

    def queued(self) -> int:
        return 0

    def on_capacity_change(self) -> None:
        return None


class AlwaysAdmitAdapter(HoldNothing):
    """No admission control at all (the seed-000 baseline)."""

    name = "none"

    def bind(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def decide(self, request: SimRequest) -> GateDecision:
        return ADMIT_NOW


@dataclass
class TenantStats:
    submitted: int = 0
    admitted: int = 0
    rejected: int = 0
    completed: int = 0
    lost: int = 0
    in_flight: int = 0
    running: int = 0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    queue_wait: list[float] = field(default_factory=list)
    denials: Counter[str] = field(default_factory=Counter)
    # Admitted requests by the class that serves them (issue 24: spillover, quota demotion), as `admitted`.
    served_by_tier: Counter[str] = field(default_factory=Counter)
    # Requests lost after admission (queue timeouts, evictions), by reason.
    lost_by_reason: Counter[str] = field(default_factory=Counter)


@dataclass
class Stats:
    num_requests: int = 0
    injected: int = 0
    rejected: int = 0
    completed: int = 0
    in_admission: int = 0  # inside the admission latency, not yet decided
    in_routing: int = 0  # admitted, inside the routing latency
    lost: Counter[str] = field(default_factory=Counter)
    shed_by_tier: Counter[str] = field(default_factory=Counter)
    denials: Counter[str] = field(default_factory=Counter)
    tenants: dict[str, TenantStats] = field(default_factory=lambda: defaultdict(TenantStats))
    record_latencies: bool = True


class Cluster:
    def __init__(
        self,
        # Typed as the simulator's loop (its only one): under mypyc every `loop.time` is then a native read.
        loop: EventLoop,
        instances: Sequence[Instance],
        *,
        routing: str = "round-robin",
        admission: AdmissionAdapter | None = None,
        admission_latency_s: float = 0.0,
        routing_latency_s: float = 0.0,
        record_latencies: bool = True,
    ) -> None:
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing {routing!r}; expected one of {', '.join(ROUTING_POLICIES)}")
        self.loop = loop
        self.instances = list(instances)
        self.routing = routing
        self.admission: AdmissionAdapter = admission or AlwaysAdmitAdapter()
        self.admission_latency_s = admission_latency_s
        self.routing_latency_s = routing_latency_s
        self.stats = Stats(record_latencies=record_latencies)
        self._round_robin = 0
        self._online: list[Instance] = []
        self._online_valid = False
        self.listeners: list[Callable[[str, SimRequest], None]] = []
        self.on_request_done: Callable[[SimRequest], None] = lambda request: None
        self.on_request_rejected: Callable[[SimRequest, float | None], None] = lambda request, wait: None
        for instance in self.instances:
            instance.on_first_token = self._first_token
            instance.on_finish = self._finish
            instance.on_lost = self._lost
        self.admission.bind(self)

    def _refresh_online(self) -> list[Instance]:
        self._online = [instance for instance in self.instances if instance.online]
        self._online_valid = True
        return self._online

    # ---- views the admission adapters read -------------------------------------------------------
    def online_instances(self) -> list[Instance]:
        return [instance for instance in self.instances if instance.online]

    def slot_capacity(self) -> int:
        return sum(instance.max_num_seqs for instance in self.instances if instance.online)

    def running_total(self) -> int:
        return sum(len(instance.running) for instance in self.instances)

    # ---- the pipeline ----------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> None:
        stats = self.stats
        stats.num_requests += 1
        stats.tenants[request.tenant].submitted += 1
        if self.admission_latency_s > 0:
            stats.in_admission += 1
            self.loop.after(self.admission_latency_s, self._decide, request, True)
        else:
            self._decide(request, False)

    def _decide(self, request: SimRequest, delayed: bool) -> None:
        stats = self.stats
        if delayed:
            stats.in_admission -= 1
        decision = self.admission.decide(request)
        tenant = stats.tenants[request.tenant]
        if decision.outcome == "reject":
            stats.rejected += 1
            stats.shed_by_tier[request.slo_class or "standard"] += 1
            stats.denials[decision.reason] += 1
            tenant.rejected += 1
            tenant.denials[decision.reason] += 1
            request.outcome = decision.reason or "rejected"
            if self.listeners:
                self._emit("rejected", request)
            self.on_request_rejected(request, decision.retry_after_s)
            return
        stats.injected += 1
        tenant.admitted += 1
        tenant.in_flight += 1
        request.admitted_at = self.loop.time
        request.priority = decision.priority
        request.served_class = decision.served_class
        if decision.served_class:
            tenant.served_by_tier[decision.served_class] += 1
        if self.listeners:
            self._emit("admitted", request)
        if decision.outcome == "admit":
            self._dispatch(request)
        # "queue": the adapter holds it and hands it back through next_dispatch()

    def _dispatch(self, request: SimRequest) -> None:
        request.dispatched_at = self.loop.time
        self.stats.tenants[request.tenant].running += 1
        self.admission.on_dispatch(request)
        if self.routing_latency_s > 0:
            self.stats.in_routing += 1
            self.loop.after(self.routing_latency_s, self._route, request, True)
            return
        # `_route(request, False)`, written out: every request takes this path.
        instance = self._pick()
        if instance is None:
            self._lost(request, "no_instance")
            return
        instance.enqueue(request)

    def pump(self) -> None:
        """Dispatch held requests while the adapter releases them."""
        while True:
            request = self.admission.next_dispatch()
            if request is None:
                return
            self._dispatch(request)

    def _route(self, request: SimRequest, delayed: bool) -> None:
        if delayed:
            self.stats.in_routing -= 1
        instance = self._pick()
        if instance is None:
            self._lost(request, "no_instance")
            return
        instance.enqueue(request)

    def _pick(self) -> Instance | None:
        online = self._online if self._online_valid else self._refresh_online()
        if not online:
            return None
        if self.routing == "round-robin":
            self._round_robin += 1
            return online[self._round_robin % len(online)]
        if self.routing == "least-loaded":
            best = online[0]
            best_load = len(best.waiting) + len(best.running)
            for instance in online:
                load = len(instance.waiting) + len(instance.running)
                if load < best_load:
                    best, best_load = instance, load
            return best
        return min(online, key=lambda instance: (instance.kv_utilization, instance.load, instance.index))

    # ---- instance callbacks ----------------------------------------------------------------------
    def _first_token(self, request: SimRequest) -> None:
        if self.listeners:
            self._emit("first_token", request)

    def _finish(self, request: SimRequest) -> None:
        stats = self.stats
        stats.completed += 1
        tenant = stats.tenants[request.tenant]
        tenant.completed += 1
        tenant.in_flight -= 1
        tenant.running -= 1
        tenant.output_tokens += request.output_tokens
        if stats.record_latencies:
            tenant.ttft.append(request.first_token_at - request.arrival)  # type: ignore[operator]
            tenant.e2e.append(request.finished_at - request.arrival)  # type: ignore[operator]
            tenant.queue_wait.append(request.dispatched_at - request.arrival)  # type: ignore[operator]
        request.outcome = "completed"
        self.admission.on_done(request)
        if self.listeners:
            self._emit("finished", request)
        self.on_request_done(request)
        self.pump()

    def _lost(self, request: SimRequest, reason: str) -> None:
        stats = self.stats
        stats.lost[reason] += 1
        tenant = stats.tenants[request.tenant]
        tenant.lost += 1
        tenant.lost_by_reason[reason] += 1
        tenant.in_flight -= 1
        if request.dispatched_at is not None:
            tenant.running -= 1
        request.outcome = f"lost:{reason}"
        self.admission.on_done(request)
        self._emit("lost", request)
        self.on_request_done(request)
        self.pump()

    def expire(self, request: SimRequest, reason: str = "expired") -> None:
        """A request held in the gateway queue ran out of time before it was dispatched."""
        self._lost(request, reason)

    def evict(self, request: SimRequest, reason: str = "evicted") -> None:
        """Terminate an in-flight request (flow control's in-flight eviction)."""
        if request.instance < 0 or not self.instances[request.instance].abort(request):
            return
        self._lost(request, reason)

    def _emit(self, event: str, request: SimRequest) -> None:
        for listener in self.listeners:
            listener(event, request)

    # ---- capacity events -------------------------------------------------------------------------
    def remove_instance(self, index: int) -> None:
        self.instances[index].go_offline()
        self._online_valid = False
        self.admission.on_capacity_change()
        self.pump()

    def restore_instance(self, index: int) -> None:
        self.instances[index].go_online()
        self._online_valid = False
        self.admission.on_capacity_change()
        self.pump()

    def set_slots(self, index: int, slots: int) -> None:
        self.instances[index].set_max_num_seqs(slots)
        self.admission.on_capacity_change()
        self.pump()
