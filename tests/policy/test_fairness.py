"""DRR, Jain's index, the blog's budget scheduler and seed 004's flow control."""

from __future__ import annotations

import pytest

from apps.policy import (
    BudgetScheduler,
    DeficitRoundRobin,
    FlowConfig,
    FlowController,
    FlowRequest,
    InFlight,
    PolicyConfigError,
    jain_fairness,
    select_eviction_victim,
)

# -- DRR ---------------------------------------------------------------------------------------


def test_drr_order_under_2_to_1_weights_with_both_flows_backlogged() -> None:
    drr = DeficitRoundRobin({"A": 2, "B": 1})
    for i in range(6):
        drr.enqueue("A", f"a{i}")
    for i in range(6):
        drr.enqueue("B", f"b{i}")
    order = [drr.dispatch() for _ in range(9)]
    assert order == [
        ("A", "a0"), ("A", "a1"), ("B", "b0"),
        ("A", "a2"), ("A", "a3"), ("B", "b1"),
        ("A", "a4"), ("A", "a5"), ("B", "b2"),
    ]
    assert len(drr) == 3
    assert [drr.dispatch() for _ in range(4)] == [("B", "b3"), ("B", "b4"), ("B", "b5"), None]


def test_drr_idle_flow_deficit_resets_and_single_flow_gets_everything() -> None:
    drr = DeficitRoundRobin({"A": 5, "B": 1})
    drr.enqueue("A", "a0")
    assert drr.dispatch() == ("A", "a0")
    assert drr.deficit("A") == 0  # an emptied queue banks no credit
    for i in range(4):
        drr.enqueue("B", f"b{i}")
    assert [drr.dispatch() for _ in range(4)] == [("B", f"b{i}") for i in range(4)]


def test_drr_costs_accumulate_over_rounds() -> None:
    drr = DeficitRoundRobin({"A": 1, "B": 1})
    drr.enqueue("A", "big", cost=3)
    drr.enqueue("B", "b0")
    drr.enqueue("B", "b1")
    drr.enqueue("B", "b2")
    assert [drr.dispatch()[1] for _ in range(4)] == ["b0", "b1", "big", "b2"]


def test_drr_rejects_bad_weights_and_unknown_flows() -> None:
    for weight in (0, -1, 1.5, True):
        with pytest.raises(PolicyConfigError):
            DeficitRoundRobin({"A": weight})  # type: ignore[dict-item]
    strict = DeficitRoundRobin({"A": 1}, default_weight=None)
    with pytest.raises(PolicyConfigError):
        strict.enqueue("Z", 1)
    assert len(strict) == 0


def test_drr_remove() -> None:
    drr = DeficitRoundRobin()
    drr.enqueue("A", "a0")
    drr.enqueue("B", "b0")
    assert drr.remove("A", "a0")
    assert not drr.remove("A", "a0")
    assert drr.dispatch() == ("B", "b0") and drr.dispatch() is None


def test_jain_fairness() -> None:
    assert jain_fairness([5, 5, 5, 5]) == pytest.approx(1.0)
    assert jain_fairness([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_fairness([2, 1]) == pytest.approx(9 / 10)
    assert jain_fairness([0, 0]) == 1.0
    with pytest.raises(ValueError):
        jain_fairness([])
    with pytest.raises(ValueError):
        jain_fairness([1, -1])


# -- the blog's budget scheduler ---------------------------------------------------------------


def test_budget_scheduler_is_work_conserving_then_splits_by_weight() -> None:
    scheduler = BudgetScheduler(4, {"A": FlowConfig(weight=2, queue_max=100), "B": FlowConfig(1, 100)})
    # B alone gets the whole budget.
    dispatched = [t.item for i in range(6) for t in scheduler.submit("B", f"b{i}", now=0).dispatched]
    assert dispatched == ["b0", "b1", "b2", "b3"] and scheduler.in_flight == 4
    for i in range(20):
        scheduler.submit("A", f"a{i}", now=0)
        scheduler.submit("B", f"bb{i}", now=0)
    served = [t.flow for _ in range(30) for t in scheduler.release(now=1)]
    assert served.count("A") == 20 and served.count("B") == 10


def test_budget_scheduler_queue_max_timeout_and_budget_changes() -> None:
    scheduler = BudgetScheduler(1, {"free": FlowConfig(weight=1, queue_max=2)}, default_flow=None,
                                acquire_timeout_s=1.0)
    assert scheduler.submit("free", "x0", now=0).dispatched[0].item == "x0"
    assert scheduler.submit("free", "x1", now=0).accepted
    assert scheduler.submit("free", "x2", now=0.5).accepted
    full = scheduler.submit("free", "x3", now=0.5)
    assert not full.accepted and full.reason == "queue_full"
    assert scheduler.submit("paying", "p", now=0).reason == "unknown_flow"
    assert [t.item for t in scheduler.expire(now=1.2)] == ["x1"]  # waited >= 1 s
    assert scheduler.has_demand
    grown = scheduler.set_budget(3, now=1.3)
    assert [t.item for t in grown] == ["x2"] and scheduler.in_flight == 2
    scheduler.set_budget(1, now=1.4)  # shrink: nothing is cancelled
    assert scheduler.in_flight == 2
    scheduler.submit("free", "x4", now=1.5)
    assert scheduler.release(now=1.6) == ()  # 1 in flight == budget: still no room
    assert [t.item for t in scheduler.release(now=1.7)] == ["x4"]
    scheduler.release(now=1.8)
    assert not scheduler.has_demand
    with pytest.raises(PolicyConfigError):
        scheduler.release(now=2)
    with pytest.raises(PolicyConfigError):
        BudgetScheduler(-1)
    with pytest.raises(PolicyConfigError):
        FlowConfig(weight=0)


def test_budget_scheduler_set_flow_adds_a_flow_and_changes_its_weight_and_queue() -> None:
    # Entitlements appear after the scheduler is built: set_flow must reach both the flow table
    # (queue depth, unknown-flow check) and the DRR weights.
    scheduler = BudgetScheduler(0, default_flow=None)
    assert scheduler.submit("A", "a", now=0).reason == "unknown_flow"
    scheduler.set_flow("A", FlowConfig(weight=2, queue_max=100))
    scheduler.set_flow("B", FlowConfig(weight=1, queue_max=100))
    for i in range(30):
        assert scheduler.submit("A", f"a{i}", now=0).accepted
        assert scheduler.submit("B", f"b{i}", now=0).accepted
    assert [t.flow for t in scheduler.set_budget(9, now=0)].count("A") == 6  # 2:1

    scheduler.set_budget(0, now=1)
    for _ in range(9):
        scheduler.release(now=1)
    scheduler.set_flow("B", FlowConfig(weight=2, queue_max=100))
    assert scheduler.config("B") == FlowConfig(weight=2, queue_max=100)
    assert [t.flow for t in scheduler.set_budget(8, now=1)].count("B") == 4  # now 1:1

    # A shorter queue drops nothing already queued; it refuses the next submit.
    scheduler.set_flow("A", FlowConfig(weight=2, queue_max=1))
    assert scheduler.queued_for("A") > 1
    assert scheduler.submit("A", "late", now=2).reason == "queue_full"


# -- seed 004 flow control ---------------------------------------------------------------------


def fr(request_id: str, tenant: str, slo: str = "standard", target: float | None = None) -> FlowRequest:
    return FlowRequest(request_id, tenant, slo, target)


def drain(controller: FlowController, now: float = 10.0) -> list[str]:
    out = []
    while (entry := controller.dispatch(now)) is not None:
        out.append(entry.request.request_id)
    return out


def test_fifo_dispatches_global_arrival_order() -> None:
    controller = FlowController(dispatch_order="fifo")
    for rid, slo in [("1", "batch"), ("2", "critical"), ("3", "standard")]:
        controller.enqueue(fr(rid, "t", slo), now=0)
    assert drain(controller) == ["1", "2", "3"]


def test_priority_order_bands_high_first_global_strict_within() -> None:
    controller = FlowController(dispatch_order="priority", fairness="global-strict")
    for rid, tenant, slo in [("b1", "x", "batch"), ("s1", "y", "standard"), ("c1", "y", "critical"),
                             ("s2", "x", "standard"), ("s3", "y", "standard")]:
        controller.enqueue(fr(rid, tenant, slo), now=0)
    assert drain(controller) == ["c1", "s1", "s2", "s3", "b1"]


def test_round_robin_cycles_tenants_in_sorted_order() -> None:
    controller = FlowController(dispatch_order="priority", fairness="round-robin")
    for rid, tenant in [("z1", "zed"), ("z2", "zed"), ("z3", "zed"), ("a1", "amy"), ("m1", "max")]:
        controller.enqueue(fr(rid, tenant), now=0)
    assert drain(controller) == ["a1", "m1", "z1", "z2", "z3"]


def test_weighted_drr_fairness_within_a_band() -> None:
    controller = FlowController(dispatch_order="priority", fairness="weighted-drr", weights={"a": 2, "b": 1})
    for i in range(4):
        controller.enqueue(fr(f"a{i}", "a"), now=0)
        controller.enqueue(fr(f"b{i}", "b"), now=0)
    assert drain(controller)[:6] == ["a0", "a1", "b0", "a2", "a3", "b1"]


def test_slo_deadline_order_within_flow() -> None:
    controller = FlowController(dispatch_order="slo-deadline", slo_targets_s={"critical": 0.1, "standard": 0.5})
    controller.enqueue(fr("loose", "t", "standard"), now=0.0)  # deadline 0.5
    controller.enqueue(fr("own", "t", "standard", target=0.2), now=0.1)  # 0.3
    controller.enqueue(fr("none", "t", "unknown-tier"), now=0.0)  # standard band, no target: far future
    controller.enqueue(fr("tie", "t", "standard"), now=0.0)  # 0.5, after "loose" by arrival
    assert drain(controller) == ["own", "loose", "tie", "none"]


def test_band_and_global_capacity_and_shedding() -> None:
    controller = FlowController(per_band_capacity=2, max_queue_depth=3)
    assert controller.enqueue(fr("s1", "t", "standard"), 0).accepted
    assert controller.enqueue(fr("s2", "t", "standard"), 0).accepted
    assert controller.enqueue(fr("s3", "t", "standard"), 0).reason == "band_full"
    assert controller.enqueue(fr("b1", "t", "batch"), 0).accepted
    assert controller.enqueue(fr("c1", "t", "critical"), 0).reason == "queue_full"  # no shedding by default

    shedding = FlowController(max_queue_depth=3, queue_shedding=True)
    for rid, slo in [("c1", "critical"), ("bg1", "background"), ("bg2", "background")]:
        shedding.enqueue(fr(rid, "t", slo), 0)
    outcome = shedding.enqueue(fr("b1", "t", "batch"), 0)
    assert outcome.accepted and outcome.shed is not None and outcome.shed.request.request_id == "bg2"
    # A background arrival cannot shed its own band or anything above it.
    assert shedding.enqueue(fr("bg3", "t", "background"), 0).reason == "queue_full"
    assert len(shedding) == 3


def test_saturation_gates_dispatch() -> None:
    controller = FlowController()
    controller.enqueue(fr("1", "t"), 0)
    assert controller.dispatch(now=1, saturation=1.0) is None
    assert controller.dispatch(now=1, saturation=0.99).request.request_id == "1"


def test_eviction_victim_lowest_priority_newest_dispatch() -> None:
    running = [
        InFlight("crit", 4, 9.0),
        InFlight("batch", -1, 8.0),
        InFlight("bg-old", -3, 1.0),
        InFlight("bg-new", -3, 5.0),
    ]
    assert select_eviction_victim(running).request_id == "bg-new"
    assert select_eviction_victim([InFlight("std", 3, 1.0), InFlight("crit", 4, 2.0)]) is None


def test_flow_control_rejects_bad_configuration() -> None:
    for kwargs in ({"dispatch_order": "lifo"}, {"fairness": "random"}, {"per_band_capacity": -1},
                   {"weights": {"a": 0}}, {"slo_targets_s": {"critical": -1}}):
        with pytest.raises(PolicyConfigError):
            FlowController(**kwargs)  # type: ignore[arg-type]
