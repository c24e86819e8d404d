"""Property tests: conservation, limits, no starvation, work conservation."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from apps.policy import (
    AdmissionLedger,
    AdmissionRequest,
    BudgetScheduler,
    DeficitRoundRobin,
    EntitlementLimits,
    FlowConfig,
    FlowController,
    FlowRequest,
)

CLASSES = ("dedicated", "guaranteed", "elastic", "spot", "preemptible")

limits_strategy = st.builds(
    lambda index, cls, concurrency, extra, rate, kv, slo: EntitlementLimits(
        entitlement_id=f"e{index}",
        service_class=cls,
        concurrency=concurrency,
        burst_concurrency=None if extra is None else concurrency + extra,
        tokens_per_second=rate,
        token_bucket_seconds=10.0,
        kv_bytes=kv,
        burst_kv_bytes=None if kv is None else kv * 2,
        kv_bytes_per_token=1.0,
        slo_target_ms=slo,
        context_window=512,
        default_max_tokens=64,
    ),
    st.integers(0, 3),
    st.sampled_from(CLASSES),
    st.integers(0, 6),
    st.one_of(st.none(), st.integers(0, 4)),
    st.one_of(st.none(), st.floats(5, 200)),
    st.one_of(st.none(), st.floats(100, 2000)),
    st.sampled_from((100.0, 1000.0, 30_000.0)),
)

operation = st.one_of(
    st.tuples(st.just("request"), st.integers(0, 3), st.integers(0, 400), st.one_of(st.none(), st.integers(-1, 200))),
    st.tuples(st.just("release"), st.integers(0, 200), st.integers(0, 200)),
    st.tuples(st.just("evict"), st.integers(0, 200)),
    st.tuples(st.just("advance"), st.floats(0, 3)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("tick")),
    st.tuples(st.just("capacity"), st.integers(0, 12)),
    st.tuples(st.just("saturation"), st.sampled_from((0.0, 0.5, 1.2))),
)


def running_by_entitlement(ledger: AdmissionLedger, now: float) -> dict[str, int]:
    return {key: ledger.usage(key, now).running for key in ledger.entitlement_ids()}


def check_limits(ledger: AdmissionLedger, now: float, previous_running: dict[str, int]) -> None:
    """No limit is exceeded by a start: every per-entitlement and pool bound holds."""
    ledger.check_invariants()
    pool = ledger.pool_usage()
    if pool.running > sum(previous_running.values()):
        assert pool.running <= pool.concurrency_capacity
    if ledger.saturation >= 1.0:
        # A saturated pool starts only dedicated/guaranteed work within its own reserved baseline.
        for key, running in running_by_entitlement(ledger, now).items():
            if running > previous_running.get(key, 0):
                limits = ledger.limits(key)
                assert limits is not None and limits.traits.reserved
                assert limits.concurrency is not None and running <= limits.concurrency
    assert pool.kv_bytes_running <= pool.kv_capacity + 1e-6
    for key in list(ledger.entitlement_ids()):
        limits = ledger.limits(key)
        usage = ledger.usage(key, now)
        assert limits is not None
        if limits.concurrency is not None:
            if not limits.traits.may_burst:
                assert usage.in_flight <= limits.concurrency
            elif limits.burst_concurrency is not None:
                assert usage.in_flight <= limits.burst_concurrency
        if limits.kv_bytes is not None:
            ceiling = limits.kv_bytes if not limits.traits.may_burst else limits.burst_kv_bytes
            if ceiling is not None:
                assert usage.kv_bytes_in_flight <= ceiling + 1e-6
        if limits.tokens_per_second is not None:
            assert -1e-6 <= usage.tokens_available <= (limits.bucket_capacity or 0) + 1e-6


@settings(max_examples=150, deadline=None)
@given(
    st.lists(limits_strategy, min_size=1, max_size=4, unique_by=lambda limits: limits.entitlement_id),
    st.integers(0, 10),
    st.lists(operation, max_size=60),
)
def test_conservation_and_limits_under_random_operations(entitlements, capacity, operations) -> None:
    ledger = AdmissionLedger(concurrency_capacity=capacity, kv_capacity=3000.0, mean_slo_ms=1000.0)
    now = 0.0
    for limits in entitlements:
        ledger.upsert_entitlement(limits, now)
    keys = [limits.entitlement_id for limits in entitlements]
    offered: list[str] = []
    outcomes: Counter[str] = Counter()
    terminal: dict[str, str] = {}

    def close(request_id: str, outcome: str) -> None:
        assert request_id not in terminal, (request_id, terminal[request_id], outcome)
        terminal[request_id] = outcome
        outcomes[outcome] += 1

    for step in operations:
        before = running_by_entitlement(ledger, now)
        kind = step[0]
        if kind == "request":
            request_id = f"r{len(offered)}"
            offered.append(request_id)
            result = ledger.request(
                keys[step[1] % len(keys)], AdmissionRequest(request_id, step[2], step[3]), now
            )
            if not result.decision.admitted and not result.decision.queued:
                close(request_id, "rejected")
            limits = ledger.limits(keys[step[1] % len(keys)])
            if result.decision.admitted and limits is not None and not limits.traits.reserved \
                    and not limits.traits.evictable:
                # Elastic and spot never start into an idle reservation of a dedicated/guaranteed one.
                pool = ledger.pool_usage()
                assert pool.running - pool.evictable_running + pool.reserved_idle_concurrency \
                    <= pool.concurrency_capacity
            for victim in result.evicted:
                close(victim, "evicted")
        elif kind == "release" and offered:
            request_id = offered[step[1] % len(offered)]
            released = ledger.release(request_id, now, output_tokens=step[2])
            if released.outcome in ("completed", "cancelled"):
                close(request_id, released.outcome)
        elif kind == "evict" and offered:
            request_id = offered[step[1] % len(offered)]
            if ledger.evict(request_id, now).outcome == "evicted":
                close(request_id, "evicted")
        elif kind == "advance":
            now += step[1]
        elif kind == "expire":
            for request_id in ledger.expire_waiting(now):
                close(request_id, "expired")
        elif kind == "tick":
            dynamics = ledger.tick(now)
            for key, state in dynamics.items():
                limits = ledger.limits(key)
                assert limits is not None and math.isfinite(state.debt) and state.burst >= 0
                if not limits.traits.accrues_debt:
                    assert state.debt == 0.0
        elif kind == "capacity":
            ledger.set_capacity(step[1], now)
        elif kind == "saturation":
            ledger.set_saturation(step[1], now)
        check_limits(ledger, now, before)

    # Finish everything: each request offered ends in exactly one outcome.
    now += 100.0
    for request_id in ledger.expire_waiting(now):
        close(request_id, "expired")
    for request_id in ledger.in_flight_ids():
        assert ledger.release(request_id, now).outcome == "completed"
        close(request_id, "completed")
    assert sorted(terminal) == sorted(offered)
    assert ledger.counters.offered == len(offered)
    assert ledger.counters.rejected == outcomes["rejected"]
    assert ledger.counters.completed == outcomes["completed"]
    assert ledger.counters.evicted == outcomes["evicted"]
    assert ledger.counters.expired == outcomes["expired"]
    assert ledger.running == 0 and ledger.pool_usage().admission_threshold == -math.inf


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from("ABCDEF"), st.integers(1, 8), min_size=1), st.integers(1, 200))
def test_drr_backlogged_flow_is_served_within_a_bounded_number_of_dispatches(weights, dispatches) -> None:
    drr = DeficitRoundRobin(weights)
    backlog = dispatches + 1  # every flow stays backlogged for the whole run
    for flow in weights:
        for index in range(backlog):
            drr.enqueue(flow, index)
    last_served = dict.fromkeys(weights, -1)
    served: Counter[str] = Counter()
    total = sum(weights.values())
    for step in range(dispatches):
        picked = drr.dispatch()
        assert picked is not None
        flow, item = picked
        assert item == served[flow]  # FIFO within a flow
        served[flow] += 1
        last_served[flow] = step
        for other, weight in weights.items():
            # Between two services of a flow there are at most the other flows' quanta.
            assert step - last_served[other] <= total - weight + 1
    # Over whole rounds each flow's share is exactly proportional to its weight.
    rounds = dispatches // total
    for flow, weight in weights.items():
        assert served[flow] >= rounds * weight


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(("a", "b", "c")), st.sampled_from(("critical", "standard", "batch"))),
             min_size=1, max_size=60),
    st.sampled_from(("global-strict", "round-robin", "weighted-drr")),
)
def test_flow_control_drains_everything_in_band_order(arrivals, fairness) -> None:
    controller = FlowController(dispatch_order="priority", fairness=fairness, weights={"a": 3, "b": 1, "c": 2})
    for index, (tenant, slo) in enumerate(arrivals):
        assert controller.enqueue(FlowRequest(f"q{index}", tenant, slo), now=float(index)).accepted
    out = []
    while (entry := controller.dispatch(now=100.0)) is not None:
        out.append(entry)
    assert len(out) == len(arrivals) and len(controller) == 0
    priorities = [entry.priority for entry in out]
    assert priorities == sorted(priorities, reverse=True)
    for tenant in "abc":  # FIFO within each flow
        seqs = [entry.seq for entry in out if entry.request.tenant_id == tenant and entry.priority == 3]
        assert seqs == sorted(seqs)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 64), st.integers(0, 200), st.dictionaries(st.sampled_from("ABC"), st.integers(1, 5), min_size=1),
       st.sampled_from("ABC"))
def test_single_active_flow_gets_the_whole_budget(budget, requests, weights, active) -> None:
    flows = {flow: FlowConfig(weight=weight, queue_max=1000) for flow, weight in weights.items()}
    scheduler = BudgetScheduler(budget, flows, default_flow=FlowConfig(weight=1, queue_max=1000))
    for index in range(requests):
        scheduler.submit(active, index, now=0.0)
    assert scheduler.in_flight == min(budget, requests)
    assert scheduler.queued == max(0, requests - budget)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(0, 100), st.sampled_from(("dedicated", "elastic", "spot", "preemptible")))
def test_single_bursting_entitlement_gets_the_whole_pool(capacity, requests, cls) -> None:
    ledger = AdmissionLedger(concurrency_capacity=capacity, mean_slo_ms=1000.0)
    ledger.upsert_entitlement(EntitlementLimits("solo", cls, concurrency=1), now=0.0)
    for index in range(requests):
        ledger.request("solo", AdmissionRequest(f"r{index}", 10, 10), now=0.0)
    assert ledger.running == min(capacity, requests)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("enqueue"), st.sampled_from("abc"),
                      st.sampled_from(("critical", "standard", "batch", "sheddable", "background"))),
            st.tuples(st.just("dispatch"), st.sampled_from((0.0, 0.5, 1.0))),
            st.tuples(st.just("cancel"), st.integers(0, 100)),
        ),
        max_size=80,
    ),
    st.integers(0, 6),
    st.integers(0, 10),
    st.booleans(),
    st.sampled_from(("fifo", "priority", "slo-deadline")),
)
def test_flow_control_conserves_requests_and_respects_capacity(
    operations, per_band, max_depth, shedding, order
) -> None:
    controller = FlowController(dispatch_order=order, per_band_capacity=per_band, max_queue_depth=max_depth,
                                queue_shedding=shedding, slo_targets_s={"critical": 0.1})
    offered: list[str] = []
    ended: dict[str, str] = {}
    for index, step in enumerate(operations):
        if step[0] == "enqueue":
            request_id = f"q{index}"
            offered.append(request_id)
            outcome = controller.enqueue(FlowRequest(request_id, step[1], step[2]), now=float(index))
            if not outcome.accepted:
                ended[request_id] = outcome.reason
            if outcome.shed is not None:
                assert outcome.shed.priority < 0  # only sheddable entries are ever shed
                assert outcome.shed.request.request_id not in ended
                ended[outcome.shed.request.request_id] = "shed"
        elif step[0] == "dispatch":
            entry = controller.dispatch(now=float(index), saturation=step[1])
            if step[1] >= 1.0:
                assert entry is None
            if entry is not None:
                assert entry.request.request_id not in ended
                ended[entry.request.request_id] = "dispatched"
        elif offered:
            request_id = offered[step[1] % len(offered)]
            if controller.remove(request_id) is not None:
                assert request_id not in ended
                ended[request_id] = "cancelled"
        if max_depth:
            assert len(controller) <= max_depth
        if per_band:
            assert all(size <= per_band for size in controller.band_sizes().values())
    queued = {entry.request.request_id for entry in controller.entries()}
    assert queued.isdisjoint(ended)
    assert sorted(queued | set(ended)) == sorted(offered)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.sampled_from("ABCD"), st.integers(1, 4), min_size=2),
    st.integers(1, 8),
    st.lists(st.sampled_from("ABCD"), min_size=1, max_size=120),
)
def test_budget_scheduler_never_exceeds_budget_or_starves_a_queue(weights, budget, arrivals) -> None:
    scheduler = BudgetScheduler(
        budget, {flow: FlowConfig(weight=weight, queue_max=1_000) for flow, weight in weights.items()},
        default_flow=None,
    )
    dispatched: list[str] = []
    for flow in arrivals:
        result = scheduler.submit(flow, flow, now=0.0)
        assert result.accepted == (flow in weights)
        dispatched.extend(ticket.flow for ticket in result.dispatched)
        assert scheduler.in_flight <= budget
    while scheduler.in_flight:
        dispatched.extend(ticket.flow for ticket in scheduler.release(now=1.0))
        assert scheduler.in_flight <= budget
    assert scheduler.queued == 0
    assert Counter(dispatched) == Counter(flow for flow in arrivals if flow in weights)
    # Only the first `budget` submissions dispatch at once (nothing is released meanwhile); after
    # that DRR drains the queues, so a flow with work left is passed over at most `budget` times
    # plus one round of everyone's quanta.
    total = sum(weights.values())
    waiting_since: dict[str, int] = {}
    remaining = Counter(dispatched)
    for position, flow in enumerate(dispatched):
        remaining[flow] -= 1
        waiting_since.pop(flow, None)
        for other in weights:
            if remaining[other] and other != flow:
                waiting_since.setdefault(other, position)
                assert position - waiting_since[other] <= total + budget
