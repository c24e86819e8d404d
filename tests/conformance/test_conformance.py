"""`make conformance`: the admission state machine is defined once (`apps.policy.AdmissionLedger`); the
gateway's in-process store drives it, and the Redis store's Lua scripts must behave the same. Every
scenario of `scenarios.SCENARIOS` runs on all three with a fake clock; each must meet the scenario's stated
expectations, and the stores' every observation must equal the ledger's."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from apps.policy import ManualClock
from tests.conformance.drivers import LedgerDriver, StoreDriver
from tests.conformance.scenarios import SCENARIOS, At, Offer, Scenario, Usage
from tests.conformance.steps import Race
from tests.conformance.transitions import TRANSITION_SCENARIOS

pytestmark = pytest.mark.conformance

EXPECTED_FIELDS = {"expect": ("state", "outcome", "expired"), "reason": ("reason",), "started": ("started",),
                   "evicted": ("evicted",), "in_flight": ("in_flight",), "running": ("running",),
                   "tokens": ("tokens",), "used": ("used",), "reserved": ("reserved",),
                   "reaped": ("reaped",), "served": ("served_class",), "busy": ("busy",)}


async def _trace(driver: Any, scenario: Scenario) -> list[dict[str, Any]]:
    clock = ManualClock(0.0)
    await driver.start(scenario, clock)
    trace: list[dict[str, Any]] = []
    try:
        for index, step in enumerate(scenario.steps):
            if isinstance(step, At):
                clock.set(step.t)
                continue
            observed = await driver.run(step)
            trace.append({"step": type(step).__name__, "index": index, **observed})
            _check_expectations(driver.name, index, step, observed)
    finally:
        await driver.stop()
    return trace


def _check_expectations(driver: str, index: int, step: Any, observed: dict[str, Any]) -> None:
    if isinstance(step, Race):
        _check_expectations(driver, index, step.late, observed["late"])
        _check_expectations(driver, index, step.early, observed["early"])
        return
    for attribute, keys in EXPECTED_FIELDS.items():
        wanted = getattr(step, attribute, None)
        if wanted is None:
            continue
        key = next(k for k in keys if k in observed)
        got = observed[key]
        where = f"{driver}: step {index} {step}"
        if isinstance(wanted, float):
            assert math.isclose(got, wanted, rel_tol=1e-9, abs_tol=1e-9), f"{where}: {key} {got!r} != {wanted!r}"
        else:
            assert got == wanted, f"{where}: {key} {got!r} != {wanted!r}"
    if isinstance(step, Offer) and step.expect == "rejected":
        assert observed["reason"] not in ("admitted", "queued"), f"{driver}: step {index}"
    if isinstance(step, Usage):
        assert observed["in_flight"] >= observed["running"] >= 0


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return (math.isinf(a) and a == b) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.fixture(params=["memory", "redis"])
def store_driver(request: pytest.FixtureRequest) -> StoreDriver:
    if request.param == "redis":
        return StoreDriver("redis", request.getfixturevalue("redis_url"))
    return StoreDriver("memory")


ALL_SCENARIOS = (*SCENARIOS, *TRANSITION_SCENARIOS)


@pytest.mark.parametrize("scenario", ALL_SCENARIOS, ids=[s.name for s in ALL_SCENARIOS])
def test_store_behaves_as_the_ledger(scenario: Scenario, store_driver: StoreDriver) -> None:
    reference = asyncio.run(_trace(LedgerDriver(), scenario))
    observed = asyncio.run(_trace(store_driver, scenario))
    for expected, got in zip(reference, observed, strict=True):
        assert _same(expected, got), f"{store_driver.name} differs from the ledger:\n  ledger: {expected}\n  store:  {got}"
    if scenario.check is not None:
        scenario.check(reference)
        scenario.check(observed)
