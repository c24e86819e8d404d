"""Build a cluster and workload from a `SimConfig`, run it in virtual time, and summarize the outcome."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from apps.simulator.cluster import AdmissionAdapter, Cluster
from apps.simulator.engine import EventLoop
from apps.simulator.workload import TenantSpec, Workload
from backends.virtual_vllm.instance import Instance, SimRequest
from backends.virtual_vllm.spec import InstanceSpec, build_latency


@dataclass(frozen=True)
class CapacityEvent:
    """At `at` seconds: remove instances (their in-flight requests are lost), restore them, or set slots."""

    at: float
    action: str  # "remove" | "restore" | "slots"
    instances: tuple[int, ...]
    slots: int = 0


@dataclass
class SimConfig:
    model: str = "qwen/qwen3-8b"
    gpu: str = "h100"
    latency_model: str = "roofline"
    prefill_ms_per_token: float = 0.1
    decode_ms_per_token: float = 20.0
    hardware_file: str | None = None
    tensor_parallel: int = 1
    num_instances: int = 1
    max_num_seqs: int = 256
    kv_blocks: int | None = None
    block_size: int = 16
    max_batched_tokens: int | None = 8192
    routing: str = "round-robin"
    admission_latency_s: float = 0.0
    routing_latency_s: float = 0.0
    tenants: list[TenantSpec] = field(default_factory=list)
    num_requests: int | None = None
    seed: int = 42
    horizon_s: float | None = None
    capacity_events: list[CapacityEvent] = field(default_factory=list)
    sample_interval_s: float | None = None
    record_latencies: bool = True

    def instance_spec(self) -> InstanceSpec:
        """Each instance's latency model and limits: the virtual vLLM builds its instance from the same."""
        return InstanceSpec(
            latency_model=self.latency_model,
            model=self.model,
            gpu=self.gpu,
            prefill_ms_per_token=self.prefill_ms_per_token,
            decode_ms_per_token=self.decode_ms_per_token,
            hardware_file=self.hardware_file,
            tensor_parallel=self.tensor_parallel,
            max_num_seqs=self.max_num_seqs,
            kv_blocks=self.kv_blocks,
            block_size=self.block_size,
            max_batched_tokens=self.max_batched_tokens,
        )


@dataclass
class Sample:
    time: float
    running: list[int]
    waiting: list[int]
    kv_utilization: list[float]
    slots: int
    gateway_queue: int
    tenant_in_flight: dict[str, int]
    tenant_running: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)


class Simulation:
    def __init__(
        self,
        config: SimConfig,
        admission: AdmissionAdapter | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.loop = EventLoop()
        spec = config.instance_spec()
        latency, kv_blocks = build_latency(spec)
        self.latency = latency
        self.kv_blocks = kv_blocks
        instances = [
            Instance(
                index,
                self.loop,
                latency,
                max_num_seqs=spec.max_num_seqs,
                kv_blocks=kv_blocks,
                block_size=spec.block_size,
                max_batched_tokens=spec.max_batched_tokens,
            )
            for index in range(config.num_instances)
        ]
        self.cluster = Cluster(
            self.loop,
            instances,
            routing=config.routing,
            admission=admission,
            admission_latency_s=config.admission_latency_s,
            routing_latency_s=config.routing_latency_s,
            record_latencies=config.record_latencies,
        )
        self.workload = Workload(self.loop, self.cluster, config.tenants, config.seed, config.num_requests)
        self.cluster.on_request_done = self.workload.request_done
        self.cluster.on_request_rejected = self.workload.request_rejected
        self.samples: list[Sample] = []
        self.sample_hooks: list[Callable[[Sample], None]] = []
        # Per-request records for time plots, kept only when sampling is on (long runs skip them).
        self.finished: list[tuple[float, str, float, float]] = []
        self.rejections: list[tuple[float, str, str]] = []
        if config.sample_interval_s:
            self.cluster.listeners.append(self._record)
        self.progress = progress
        self._progress_seen = 0
        self.wall_seconds = 0.0

    def _record(self, event: str, request: SimRequest) -> None:
        if event == "finished":
            finished, first = request.finished_at, request.first_token_at
            if finished is not None and first is not None:
                self.finished.append(
                    (finished, request.tenant, first - request.arrival, finished - request.arrival)
                )
        elif event == "rejected":
            self.rejections.append((self.loop.time, request.tenant, request.outcome))

    def _schedule_capacity_events(self) -> None:
        handlers = {
            "remove": self.cluster.remove_instance,
            "restore": self.cluster.restore_instance,
        }
        for event in self.config.capacity_events:
            for index in event.instances:
                if not 0 <= index < len(self.cluster.instances):
                    raise ValueError(
                        f"capacity event at {event.at}s names instance {index}, which does not exist"
                    )
                if event.action == "slots":
                    self.loop.at(event.at, self.cluster.set_slots, index, event.slots)
                else:
                    self.loop.at(event.at, handlers[event.action], index)

    def _sample(self) -> None:
        cluster = self.cluster
        instances = cluster.instances
        running_by_tenant: dict[str, int] = {name: 0 for name in cluster.stats.tenants}
        for instance in instances:
            for request in instance.running.values():
                running_by_tenant[request.tenant] = running_by_tenant.get(request.tenant, 0) + 1
        sample = Sample(
            time=self.loop.time,
            running=[len(i.running) for i in instances],
            waiting=[len(i.waiting) for i in instances],
            kv_utilization=[i.kv_utilization for i in instances],
            slots=cluster.slot_capacity(),
            gateway_queue=cluster.admission.queued(),
            tenant_in_flight={name: t.in_flight for name, t in cluster.stats.tenants.items()},
            tenant_running=running_by_tenant,
        )
        for hook in self.sample_hooks:
            hook(sample)
        self.samples.append(sample)
        self.loop.after(self.config.sample_interval_s or 1.0, self._sample, daemon=True)

    def _tick_progress(self) -> bool:
        if self.progress is not None:
            seen = self.cluster.stats.num_requests
            if seen - self._progress_seen >= 1000:
                self.progress(seen - self._progress_seen)
                self._progress_seen = seen
        return False

    def run(self) -> Simulation:
        import time

        started = time.perf_counter()
        self._schedule_capacity_events()
        self.workload.start()
        if self.config.sample_interval_s:
            self.loop.at(0.0, self._sample, daemon=True)
        stop = self._tick_progress if self.progress is not None else None
        self.loop.run(until=self.config.horizon_s, stop=stop)
        if self.progress is not None:
            self.progress(self.cluster.stats.num_requests - self._progress_seen)
        self.wall_seconds = time.perf_counter() - started
        return self

    def summary(self) -> dict[str, Any]:
        return summarize(self)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def jain_index(values: list[float]) -> float | None:
    """Jain's fairness index from the policy package; None when there is nothing to compare."""
    if not values:
        return None
    from apps.policy.fairness import jain_fairness

    return float(jain_fairness(values))


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summarize(simulation: Simulation) -> dict[str, Any]:
    cluster = simulation.cluster
    stats = cluster.stats
    now = simulation.loop.time
    instances = cluster.instances
    waiting = sum(len(i.waiting) for i in instances)
    running = sum(len(i.running) for i in instances)
    gateway_queued = cluster.admission.queued()
    lost_total = sum(stats.lost.values())
    accounted = stats.completed + waiting + running + gateway_queued + stats.in_routing + lost_total
    per_tenant: dict[str, Any] = {}
    output_tokens: list[float] = []
    for name, tenant in sorted(stats.tenants.items()):
        output_tokens.append(float(tenant.output_tokens))
        per_tenant[name] = {
            "submitted": tenant.submitted,
            "admitted": tenant.admitted,
            "rejected": tenant.rejected,
            "completed": tenant.completed,
            "lost": tenant.lost,
            "output_tokens": tenant.output_tokens,
            "throughput_tokens_per_s": _round(tenant.output_tokens / now if now > 0 else 0.0),
            "ttft_p50_s": _round(percentile(tenant.ttft, 50)),
            "ttft_p99_s": _round(percentile(tenant.ttft, 99)),
            "e2e_p50_s": _round(percentile(tenant.e2e, 50)),
            "e2e_p99_s": _round(percentile(tenant.e2e, 99)),
            "queue_wait_p50_s": _round(percentile(tenant.queue_wait, 50)),
            "queue_wait_p99_s": _round(percentile(tenant.queue_wait, 99)),
            "queue_timeouts": tenant.lost_by_reason.get("queue_timeout", 0),
            "denials": dict(sorted(tenant.denials.items())),
            "served_by_tier": dict(sorted(tenant.served_by_tier.items())),
        }
    busy = 0.0
    slot_seconds = 0.0
    for instance in instances:
        # A batch in progress was booked whole when planned; take back the part beyond the end of the run.
        ahead = 0.0
        if instance.busy:
            ahead = max(0.0, instance.batch_start + instance.batch_steps * instance.step_dt - now)
        busy += instance.busy_seconds - ahead
        slot_seconds += instance.sequence_seconds - ahead * len(instance.running)
    slot_capacity_seconds = sum(i.max_num_seqs for i in instances) * now
    all_ttft = [v for t in stats.tenants.values() for v in t.ttft]
    all_e2e = [v for t in stats.tenants.values() for v in t.e2e]
    return {
        "num_requests": stats.num_requests,
        "injected_requests": stats.injected,
        "rejected_requests": stats.rejected,
        "completed_requests": stats.completed,
        "conservation": {
            "holds": stats.num_requests == stats.injected + stats.rejected + stats.in_admission
            and stats.injected == accounted,
            "num_requests == injected + rejected": stats.num_requests == stats.injected + stats.rejected,
            "pending_admission": stats.in_admission,
            "injected_breakdown": {
                "completed": stats.completed,
                "still_queued_instance": waiting,
                "still_running": running,
                "still_queued_gateway": gateway_queued,
                "in_routing": stats.in_routing,
                **{f"lost_{reason}": count for reason, count in sorted(stats.lost.items())},
            },
        },
        "shed_by_tier": dict(sorted(stats.shed_by_tier.items())),
        "denials_by_reason": dict(sorted(stats.denials.items())),
        "retries": simulation.workload.retries,
        "preemptions": sum(i.preemptions for i in instances),
        "simulated_seconds": round(now, 4),
        "wall_seconds": round(simulation.wall_seconds, 4),
        "ttft_p50_s": _round(percentile(all_ttft, 50)),
        "ttft_p99_s": _round(percentile(all_ttft, 99)),
        "e2e_p50_s": _round(percentile(all_e2e, 50)),
        "e2e_p99_s": _round(percentile(all_e2e, 99)),
        "output_tokens": sum(i.output_tokens for i in instances),
        "utilization": {
            "busy_fraction": _round(busy / (len(instances) * now) if now > 0 else 0.0),
            "slot_fraction": _round(slot_seconds / slot_capacity_seconds if slot_capacity_seconds else 0.0),
        },
        "jain_index_output_tokens": _round(jain_index(output_tokens)),
        "tenants": per_tenant,
        "admission": cluster.admission.name,
    }
