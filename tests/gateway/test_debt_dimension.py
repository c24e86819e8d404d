"""GATEWAY_DEBT_DIMENSION: the baseline debt's service gap is measured against, in both stores' ticks."""

from __future__ import annotations

import pytest

from apps.gateway.config import GatewayConfig
from apps.gateway.memory_state import MemoryStateStore
from apps.policy import Dimension, Dynamics, EntitlementLimits
from apps.policy.window import WindowFigures, window_reading

# An elastic entitlement of 5 slots with a rate no run reaches (what the live experiments give a scenario
# tenant that declares none): for 10 s it wanted all 5 slots and was served 2.
LIMITS = EntitlementLimits("synth", service_class="elastic", tokens_per_second=1_000_000, concurrency=5)
WINDOW = WindowFigures(slot_seconds=20.0, waiting_seconds=30.0, tokens_served=640.0, completed=10)


@pytest.mark.parametrize(("dimension", "expected_debt"), [
    ("concurrency", 0.3 * 3 / 5),  # (1 - gamma_d) x gap: 3 of its 5 slots unserved
    ("tokens_per_second", 0.0),    # 64 tokens/s against a million: no measurable gap
])
def test_the_gap_is_measured_on_the_configured_dimension(dimension: str, expected_debt: float) -> None:
    config = GatewayConfig(debt_dimension=dimension).dynamics_config()
    assert config.debt_dimension is Dimension(dimension)
    reading = window_reading(WINDOW, LIMITS, Dynamics(), 10.0, expected_service_s=1.0, config=config)
    assert reading.dynamics.debt == pytest.approx(expected_debt, abs=1e-4)


def test_the_in_process_store_ticks_its_ledgers_with_the_configured_dimension() -> None:
    config = GatewayConfig(debt_dimension="concurrency")
    store = MemoryStateStore(config=config.admission_config(), dynamics_config=config.dynamics_config())
    assert store.dynamics_config is not None and store.dynamics_config.debt_dimension is Dimension.CONCURRENCY
    assert GatewayConfig().dynamics_config().debt_dimension is Dimension.TOKENS_PER_SECOND  # the paper's default


def test_an_unknown_dimension_is_refused() -> None:
    with pytest.raises(ValueError):
        GatewayConfig(debt_dimension="bananas").dynamics_config()
