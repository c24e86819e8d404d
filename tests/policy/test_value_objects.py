"""The hot path's value objects write their __init__ out (issue 26, item 5: mypyc compiles a class's own __init__,
not the one dataclasses generates), and build their NamedTuples with `tuple.__new__`. Written by hand, a default
or a field can drift from the dataclass's declaration: these tests hold each class to its own fields."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from apps.policy import Dynamics, PolicyConfigError, ResourceVector
from apps.policy.admission import (
    AdmissionDecision,
    AdmissionRequest,
    EntitlementLimits,
    EntitlementUsage,
    PoolUsage,
    admit,
)
from apps.policy.classes import Dimension
from apps.policy.ledger import AdmissionLedger, LedgerResult, ReleaseResult, WakeResult
from apps.policy.queues import full_decision, own_limits_decision, queued_decision
from apps.policy.window import WindowFigures, WindowReading
from apps.simulator.cluster import GateDecision

REQUIRED: dict[type, dict[str, Any]] = {
    AdmissionRequest: {"request_id": "r1", "input_tokens": 10},
    LedgerResult: {"decision": AdmissionDecision(True, "admitted")},
    ReleaseResult: {"outcome": "completed"},
    WakeResult: {},
    WindowFigures: {},
    WindowReading: {"dynamics": Dynamics(), "served": ResourceVector(), "demand": ResourceVector()},
    Dynamics: {},
    ResourceVector: {},
    GateDecision: {"outcome": "admit"},
}


@pytest.mark.parametrize("cls", list(REQUIRED), ids=lambda cls: cls.__name__)
def test_a_written_out_init_gives_every_field_its_declared_default(cls: type) -> None:
    made = cls(**REQUIRED[cls])
    for field in dataclasses.fields(cls):
        expected = REQUIRED[cls].get(field.name, field.default)
        assert field.default is not dataclasses.MISSING or field.name in REQUIRED[cls]
        assert getattr(made, field.name) == expected, field.name


@pytest.mark.parametrize("cls", list(REQUIRED), ids=lambda cls: cls.__name__)
def test_a_written_out_init_takes_every_field_by_name_and_position(cls: type) -> None:
    # A distinct value for every field: each must land in its own attribute, whichever way it is passed.
    values = {field.name: _distinct(REQUIRED[cls].get(field.name, field.default), index)
              for index, field in enumerate(dataclasses.fields(cls))}
    by_name, by_position = cls(**values), cls(*values.values())
    assert by_name == by_position
    assert {name: getattr(by_name, name) for name in values} == values
    # dataclasses.replace goes through __init__ too (the gateway and the tiers use it).
    first = next(iter(values))
    assert dataclasses.replace(by_name, **{first: values[first]}) == by_name
    assert repr(by_name).startswith(f"{cls.__name__}(")


def _distinct(default: Any, index: int) -> Any:
    """A value of the default's type that no other field gets (None and objects: the default itself)."""
    kind = type(default)
    if kind is bool:
        return not default
    if kind is int:
        return index + 1
    if kind is float:
        return index + 1.5
    if kind is str:
        return f"v{index}"
    if kind is tuple:
        return (f"v{index}",)
    return default


def test_the_results_stay_frozen() -> None:
    result = LedgerResult(AdmissionDecision(True, "admitted"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.started = ("x",)  # type: ignore[misc]


@pytest.mark.parametrize("field", ["tokens_per_second", "kv_bytes", "concurrency"])
@pytest.mark.parametrize("value", [-1.0, math.nan, "12"])
def test_a_resource_vector_refuses_an_amount_that_is_not_a_non_negative_number(field: str, value: Any) -> None:
    # (The compiled build refuses a string as a TypeError at the call, naming the type, not the field.)
    with pytest.raises((PolicyConfigError, TypeError), match=field if isinstance(value, float) else None):
        ResourceVector(**{field: value})
    with pytest.raises((PolicyConfigError, TypeError)):
        dataclasses.replace(ResourceVector(), **{field: value})


def test_a_resource_vector_reads_each_dimension_as_a_float() -> None:
    vector = ResourceVector(tokens_per_second=100, kv_bytes=2.5, concurrency=4)
    assert [vector.get(dimension) for dimension in Dimension] == [100.0, 2.5, 4.0]
    assert all(type(vector.get(dimension)) is float for dimension in Dimension)


def _limits(service_class: str = "elastic", **overrides: Any) -> EntitlementLimits:
    return EntitlementLimits("e", service_class, concurrency=2, tokens_per_second=1000.0, **overrides)


def test_admit_builds_the_decisions_the_named_tuple_would() -> None:
    pool = PoolUsage(concurrency_capacity=4)
    request = AdmissionRequest("r", 100, 50)
    admitted = admit(_limits(), EntitlementUsage(tokens_available=1000.0), pool, request)
    assert type(admitted) is AdmissionDecision
    assert admitted == AdmissionDecision(True, "admitted", priority=admitted.priority, max_tokens=50,
                                         token_cost=150, slo_tier=admitted.slo_tier)
    guaranteed = _limits("guaranteed")  # no burst: refused at its concurrency
    refused = admit(guaranteed, EntitlementUsage(in_flight=2, tokens_available=1000.0), pool, request)
    assert refused == AdmissionDecision(False, "concurrency_limit_exceeded", 1.0, max_tokens=50, token_cost=150,
                                        slo_tier=refused.slo_tier, check=3)
    full = PoolUsage(concurrency_capacity=4, running=4, admission_threshold=math.inf)
    contended = admit(_limits(), EntitlementUsage(tokens_available=1000.0), full, request)
    assert contended == AdmissionDecision(False, "pool_contended", 1.0, priority=contended.priority, max_tokens=50,
                                          token_cost=150, slo_tier=contended.slo_tier, check=5)
    waiting = admit(_limits(), EntitlementUsage(tokens_available=1000.0), full._replace(admission_threshold=0.0),
                    request)
    assert waiting == AdmissionDecision(False, "queued", queued=True, priority=waiting.priority, max_tokens=50,
                                        token_cost=150, slo_tier=waiting.slo_tier, check=5)


def test_the_queue_decisions_are_the_replaced_decision() -> None:
    refused = AdmissionDecision(False, "concurrency_limit_exceeded", 1.0, retryable=True, priority=2.0,
                                max_tokens=50, token_cost=150, kv_bytes=3.0, borrowed=True, slo_tier="standard",
                                check=4, served_class="spot")
    assert queued_decision(refused, 7.0, 0.5) == refused._replace(
        admitted=False, reason="queued", queued=True, evict=False, priority=7.0, check=4, retry_after_s=0.5)
    assert queued_decision(refused._replace(check=5), 7.0, 0.5).check == 3
    assert full_decision(refused, 2.0) == AdmissionDecision(False, "queue_full", 2.0, check=4, max_tokens=50,
                                                            token_cost=150, kv_bytes=3.0, slo_tier="standard")
    decision, route = own_limits_decision(_limits(queue_max=0), refused, 0, lambda _: 9.0, lambda: 0.0)
    assert (decision, route) == (refused._replace(retry_after_s=9.0), None)


def test_the_ledgers_snapshots_are_its_levels() -> None:
    ledger = AdmissionLedger(concurrency_capacity=8)
    ledger.upsert_entitlement(_limits(), 0.0)
    ledger.request("e", AdmissionRequest("r", 100, 50), 0.0)
    usage = ledger.usage("e", 0.0)
    assert type(usage) is EntitlementUsage
    assert usage == EntitlementUsage(in_flight=1, running=1, tokens_available=usage.tokens_available)
    assert usage.tokens_available == pytest.approx(1000.0 * 60 - 150)
    pool = ledger.pool_usage()
    assert type(pool) is PoolUsage
    assert pool == PoolUsage(8, running=1, admission_threshold=pool.admission_threshold)
