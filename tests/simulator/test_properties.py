"""Invariants over random small workloads: every request is accounted for and every KV block comes back."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.simulator.factory import build_admission
from apps.simulator.simulation import CapacityEvent, SimConfig, Simulation
from apps.simulator.workload import LengthSpec, TenantSpec

CLASSES = ("guaranteed", "elastic", "spot", "preemptible", "dedicated")
POLICIES = ("none", "token-pools", "always-admit", "token-bucket", "tier-shed", "gaie-legacy", "reject-all")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SimConfig, dict]:
    tenants = []
    for index in range(draw(st.integers(1, 3))):
        closed = draw(st.booleans())
        tenants.append(
            TenantSpec(
                f"t{index}",
                slo_class=draw(st.sampled_from(("critical", "standard", "batch", "sheddable"))),
                rate=0.0 if closed else draw(st.floats(1.0, 80.0)),
                concurrency=draw(st.integers(1, 6)) if closed else 0,
                input=LengthSpec("fixed", draw(st.integers(1, 300))),
                output=LengthSpec("fixed", draw(st.integers(1, 60))),
                start=draw(st.floats(0.0, 2.0)),
                stop=draw(st.floats(3.0, 6.0)),
                entitlement={
                    "service_class": draw(st.sampled_from(CLASSES)),
                    "concurrency": draw(st.integers(1, 8)),
                },
            )
        )
    instances = draw(st.integers(1, 3))
    events = []
    if draw(st.booleans()):
        victim = draw(st.integers(0, instances - 1))
        events = [CapacityEvent(1.5, "remove", (victim,)), CapacityEvent(3.0, "restore", (victim,))]
    config = SimConfig(
        latency_model="fixed",
        prefill_ms_per_token=draw(st.floats(0.01, 1.0)),
        decode_ms_per_token=draw(st.floats(1.0, 40.0)),
        num_instances=instances,
        max_num_seqs=draw(st.integers(1, 12)),
        kv_blocks=draw(st.integers(25, 200)),
        block_size=draw(st.sampled_from((4, 16))),
        routing=draw(st.sampled_from(("round-robin", "least-loaded", "kv-aware"))),
        tenants=tenants,
        capacity_events=events,
        seed=draw(st.integers(0, 1000)),
    )
    return config, {"policy": draw(st.sampled_from(POLICIES))}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_requests_are_conserved_and_kv_blocks_all_return(case):
    config, admission = case
    simulation = Simulation(config, build_admission(admission, config)).run()
    summary = simulation.summary()
    assert summary["conservation"]["holds"], summary["conservation"]
    assert summary["num_requests"] == summary["injected_requests"] + summary["rejected_requests"]
    # The run drains: nothing is left running or waiting, and the cache is empty again.
    breakdown = summary["conservation"]["injected_breakdown"]
    assert (
        breakdown["still_running"]
        == breakdown["still_queued_instance"]
        == breakdown["still_queued_gateway"]
        == 0
    )
    for instance in simulation.cluster.instances:
        assert instance.used_blocks == 0
        assert sum(instance.phase_counts) == 0
        assert instance.output_tokens >= 0
    for tenant in simulation.cluster.stats.tenants.values():
        assert tenant.in_flight == 0 and tenant.running == 0
        assert all(ttft <= e2e for ttft, e2e in zip(tenant.ttft, tenant.e2e, strict=True))
