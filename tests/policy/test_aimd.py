"""The AIMD controller (seed 002): deadband, demand gate, cooldown, floor, ceiling, histogram p99."""

from __future__ import annotations

import math

import pytest

from apps.policy import (
    AimdController,
    LatencyHistogram,
    PolicyConfigError,
    histogram_quantile,
    rebucket,
    ttft_histogram_bounds,
)

TARGET = 2.0  # seconds; deadband [1.6, 2.4]


def controller(**kwargs: object) -> AimdController:
    values: dict[str, object] = {"target_p99_s": TARGET, "min_cap": 16, "max_cap": 128, "initial_cap": 64}
    values.update(kwargs)
    return AimdController(**values)  # type: ignore[arg-type]


def test_increase_below_the_band_with_demand() -> None:
    aimd = controller()
    assert aimd.tick(p99_s=1.59, samples=50, has_demand=True) == 65
    assert aimd.last_action == "increase"
    assert aimd.tick(p99_s=1.0, samples=50, has_demand=True) == 66  # no cooldown after an increase


@pytest.mark.parametrize("p99", [1.6, 2.0, 2.4])
def test_hold_inside_the_deadband(p99: float) -> None:
    aimd = controller()
    assert aimd.tick(p99_s=p99, samples=50, has_demand=True) == 64
    assert aimd.last_action == "hold_band"


def test_multiplicative_decrease_above_the_band_then_cooldown() -> None:
    aimd = controller(cooldown_ticks=3)
    assert aimd.tick(p99_s=2.41, samples=50, has_demand=True) == 32
    assert aimd.last_action == "decrease"
    for _ in range(3):  # stale samples in the window: hold, whatever they say
        assert aimd.tick(p99_s=9.0, samples=50, has_demand=True) == 32
        assert aimd.last_action == "hold_cooldown"
    assert aimd.tick(p99_s=9.0, samples=50, has_demand=True) == 16
    for _ in range(3):
        aimd.tick(p99_s=1.0, samples=50, has_demand=True)  # cooldown blocks increases too
    assert aimd.cap == 16
    assert aimd.tick(p99_s=1.0, samples=50, has_demand=True) == 17


def test_subtractive_mode() -> None:
    aimd = controller(mode="aisd", step=4, cooldown_ticks=0)
    assert [aimd.tick(3.0, 50, True) for _ in range(3)] == [60, 56, 52]


def test_no_increase_without_demand() -> None:
    aimd = controller()
    assert aimd.tick(p99_s=0.5, samples=50, has_demand=False) == 64
    assert aimd.last_action == "hold_no_demand"
    assert aimd.tick(p99_s=3.0, samples=50, has_demand=False) == 32  # decreases do not need demand


def test_hold_with_too_few_samples_or_no_p99() -> None:
    aimd = controller(min_samples=10)
    assert aimd.tick(p99_s=30.0, samples=9, has_demand=True) == 64
    assert aimd.last_action == "hold_few_samples"
    assert aimd.tick(p99_s=None, samples=100, has_demand=True) == 64
    assert aimd.tick(p99_s=math.nan, samples=100, has_demand=True) == 64


def test_floor_and_ceiling() -> None:
    low = controller(initial_cap=20, cooldown_ticks=0)
    assert low.tick(5.0, 50, True) == 16  # floor(20 * 0.5) = 10, clamped to the floor
    assert low.tick(5.0, 50, True) == 16
    assert low.last_action == "hold_floor" and low.cooldown_left == 0
    high = controller(initial_cap=128)
    assert high.tick(0.1, 50, True) == 128
    assert high.last_action == "hold_ceiling"


def test_factor_close_to_one_still_decreases() -> None:
    aimd = controller(initial_cap=17, factor=0.99, cooldown_ticks=0)
    assert aimd.tick(5.0, 50, True) == 16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_p99_s": 0},
        {"min_cap": 0},
        {"min_cap": 200},
        {"band": 1.0},
        {"factor": 1.0},
        {"factor": math.nan},
        {"mode": "pid"},
        {"initial_cap": 500},
        {"cooldown_ticks": -1},
    ],
)
def test_invalid_configuration(kwargs: dict[str, object]) -> None:
    with pytest.raises(PolicyConfigError):
        controller(**kwargs)


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    bounds = (0.5, 1.0, 2.0, 4.0)
    # 100 observations: 50 in (0, 0.5], 40 in (0.5, 1], 9 in (1, 2], 1 in (2, 4].
    counts = [50, 40, 9, 1, 0]
    assert histogram_quantile(0.5, bounds, counts) == pytest.approx(0.5)
    assert histogram_quantile(0.9, bounds, counts) == pytest.approx(1.0)
    assert histogram_quantile(0.95, bounds, counts) == pytest.approx(1.0 + 1.0 * 5 / 9)
    assert histogram_quantile(0.995, bounds, counts) == pytest.approx(2.0 + 2.0 * 0.5)
    assert histogram_quantile(0.99, bounds, [0, 0, 0, 0, 3]) == 4.0  # +Inf bucket: highest bound
    assert histogram_quantile(0.99, bounds, [0, 0, 0, 0, 0]) is None


def test_latency_histogram_window_and_controller_integration() -> None:
    histogram = LatencyHistogram(bounds=(1.0, 2.0, 4.0), window_ticks=2)
    for _ in range(20):
        histogram.observe(3.0)
    aimd = controller(cooldown_ticks=0)
    assert aimd.tick_histogram(histogram, has_demand=True) == 32  # p99 ~ 3.98 s > 2.4 s
    assert histogram.count == 20  # the old slice is still in the 2-tick window
    histogram.rotate()
    assert histogram.count == 0
    with pytest.raises(ValueError):
        histogram.observe(-1.0)
    with pytest.raises(PolicyConfigError):
        LatencyHistogram(bounds=(2.0, 1.0))


def test_histogram_bounds_resolve_the_deadband_so_decisions_follow_the_true_p99() -> None:
    """TTFTs crowding just above 1 s (queue wait near a 1 s acquire timeout): the true p99 is under the
    band's lower edge, so the controller must increase; the default buckets read it as ~2.5 s and cut."""
    controller = AimdController(2.0, 16, 128, initial_cap=64)
    assert {1.6, 2.0, 2.4} <= set(controller.histogram_bounds())
    coarse, fine = LatencyHistogram(), LatencyHistogram(controller.histogram_bounds())
    for _ in range(100):
        coarse.observe(1.05)
        fine.observe(1.05)
    assert coarse.quantile(0.99) > controller.upper  # the blind spot of Prometheus-style buckets
    assert fine.quantile(0.99) < controller.lower
    assert controller.tick_histogram(fine, True) == 65
    assert controller.last_action == "increase"


def test_one_set_of_ttft_bounds_per_target_and_counts_moved_between_sets() -> None:
    # The gateway's histogram, the shared window and the controller all take their buckets from here.
    assert ttft_histogram_bounds(TARGET) == controller().histogram_bounds()
    assert {0.4, 0.5, 0.6} <= set(ttft_histogram_bounds(0.5))
    fine = ttft_histogram_bounds(TARGET)
    # Counts keyed by upper bound: exact where the bound exists, rounded up to the next bound otherwise.
    counts = rebucket([(1.6, 3), (2.4, 2), (3.0, 1), (math.inf, 4)], fine)
    assert counts[fine.index(1.6)] == 3 and counts[fine.index(2.4)] == 2
    assert counts[fine.index(5.0)] == 1 and counts[-1] == 4 and sum(counts) == 10


def test_one_step_for_every_controller_floor_from_the_pool() -> None:
    from apps.policy import AimdParams, aimd_floor, aimd_step

    assert [aimd_floor(64, 1, 0.25), aimd_floor(8, 1, 0.25), aimd_floor(3, 5, 0.0)] == [16, 2, 3]
    params = AimdParams(target_p99_s=1.0, min_budget_fraction=0.25)
    bounds = (0.5, 1.0, 2.0)
    hot = [0, 0, 0, 20]  # every sample above 2 s: far above the band
    first = aimd_step(None, capacity=64, counts=hot, bounds=bounds, params=params, has_demand=True)
    assert (first.cap, first.last_action, first.cooldown_left, first.min_cap) == (32, "decrease", 3, 16)
    held = aimd_step(first, capacity=64, counts=hot, bounds=bounds, params=params, has_demand=True)
    assert (held.cap, held.last_action, held.ticks) == (32, "hold_cooldown", 2)
    shrunk = aimd_step(held, capacity=8, counts=[], bounds=bounds, params=params, has_demand=False)
    assert (shrunk.cap, shrunk.min_cap, shrunk.max_cap) == (8, 2, 8)  # clipped into the smaller pool
