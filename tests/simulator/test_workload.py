"""Arrival processes, length distributions, phases and closed loops, all from seeded generators."""

from __future__ import annotations

import random
import statistics

import pytest

from apps.simulator.simulation import SimConfig, Simulation
from apps.simulator.workload import LengthSpec, RatePhase, TenantSpec, WorkloadError


def arrivals(tenant: TenantSpec, horizon: float, seed: int = 1) -> list[float]:
    config = SimConfig(
        latency_model="fixed", max_num_seqs=10_000, tenants=[tenant], horizon_s=horizon, seed=seed
    )
    simulation = Simulation(config)
    times: list[float] = []
    simulation.cluster.listeners.append(
        lambda event, request: times.append(request.arrival) if event == "admitted" else None
    )
    simulation.run()
    return times


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    times = arrivals(
        TenantSpec("p", rate=50.0, input=LengthSpec("fixed", 8), output=LengthSpec("fixed", 2)), 200.0
    )
    assert len(times) == pytest.approx(50 * 200, rel=0.05)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1.0, abs=0.05)


def test_gamma_arrivals_are_burstier_at_the_same_rate():
    tenant = TenantSpec(
        "g", rate=50.0, arrival="gamma", cv=3.0, input=LengthSpec("fixed", 8), output=LengthSpec("fixed", 2)
    )
    times = arrivals(tenant, 200.0)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(times) == pytest.approx(50 * 200, rel=0.15)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) > 2.0


def test_phases_change_the_rate_and_join_leave_bound_the_arrivals():
    tenant = TenantSpec(
        "ph", rate=10.0, phases=(RatePhase(50.0, 40.0), RatePhase(100.0, 0.0)), start=10.0, stop=150.0,
        input=LengthSpec("fixed", 8), output=LengthSpec("fixed", 2),
    )  # fmt: skip
    times = arrivals(tenant, 200.0)
    assert min(times) >= 10.0 and max(times) < 100.0
    early = sum(1 for t in times if t < 50)
    late = sum(1 for t in times if 50 <= t < 100)
    assert early == pytest.approx(10 * 40, rel=0.2)
    assert late == pytest.approx(40 * 50, rel=0.1)


def test_lognormal_lengths_have_the_mean_and_respect_bounds():
    spec = LengthSpec.parse({"dist": "lognormal", "mean": 500, "sigma": 0.6, "min": 10, "max": 3000}, "x")
    rng = random.Random(3)
    values = [spec.sample(rng) for _ in range(20_000)]
    assert statistics.mean(values) == pytest.approx(500, rel=0.03)
    assert min(values) >= 10 and max(values) <= 3000
    uniform = LengthSpec.parse({"dist": "uniform", "min": 32, "max": 176}, "x")
    assert {uniform.sample(rng) for _ in range(5000)} == set(range(32, 177))


@pytest.mark.parametrize(
    "raw",
    [
        0,
        -1,
        2.5,
        "ten",
        {"dist": "zipf"},
        {"dist": "lognormal", "mean": -1},
        {"dist": "uniform", "min": 9, "max": 3},
    ],
)
def test_bad_length_specs_are_refused(raw):
    with pytest.raises(WorkloadError):
        LengthSpec.parse(raw, "tenants[a].input")


def test_closed_loop_clients_keep_exactly_their_concurrency_busy():
    tenant = TenantSpec(
        "c", concurrency=3, stop=10.0, input=LengthSpec("fixed", 10), output=LengthSpec("fixed", 10)
    )
    config = SimConfig(latency_model="fixed", prefill_ms_per_token=1, decode_ms_per_token=10, max_num_seqs=100,
                       tenants=[tenant], sample_interval_s=0.5)  # fmt: skip
    simulation = Simulation(config).run()
    assert max(s.tenant_running.get("c", 0) + sum(s.waiting) for s in simulation.samples) <= 3
    assert {s.tenant_in_flight.get("c", 0) for s in simulation.samples if 1 <= s.time <= 9} == {3}
    # Each request takes 10 ms + 9 * 10 ms of decode (+ joining steps), so 3 clients finish ~100 per second.
    assert 200 < simulation.cluster.stats.completed < 310


def test_num_requests_caps_generation_and_the_same_seed_repeats_the_run():
    tenant = TenantSpec("n", rate=100.0, input=LengthSpec.parse({"dist": "uniform", "min": 5, "max": 50}, "i"),
                        output=LengthSpec("fixed", 4))  # fmt: skip

    def run(seed: int) -> list[tuple[float, int]]:
        config = SimConfig(latency_model="fixed", tenants=[tenant], num_requests=500, seed=seed)
        simulation = Simulation(config)
        seen: list[tuple[float, int]] = []
        simulation.cluster.listeners.append(
            lambda e, r: seen.append((r.arrival, r.prompt_tokens)) if e == "admitted" else None
        )
        simulation.run()
        assert simulation.cluster.stats.num_requests == 500
        return seen

    assert run(7) == run(7)
    assert run(7) != run(8)
