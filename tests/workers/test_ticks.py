"""The tick registry and the two in-process runners' rules: no overlap, log and retry next period."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from workers.ticks import Outcome, Ticker, TickSpec, run_tick, tick_specs, ticks_mode


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_registry_has_the_seed_periods() -> None:
    specs = tick_specs()
    assert specs["ewma"].period_s == 1.0
    assert specs["aimd"].period_s == 5.0
    assert specs["dashboard"].period_s == 1.0
    assert set(specs) == {"ewma", "aimd", "scrape", "autoscale", "expiry", "usage_rollup", "request_log",
                          "request_log_drain", "dashboard"}
    for spec in specs.values():
        assert callable(spec.resolve())


def test_periods_come_from_settings_else_the_registry(settings: Any) -> None:
    # TOKENPOOLS_TICK_<NAME>_S in the environment becomes this setting (tests/tokenpools_site/test_settings.py).
    settings.TOKENPOOLS_TICK_PERIODS = {"aimd": 2.5, "scrape": 0.5}
    specs = tick_specs(["aimd", "scrape", "ewma"])
    assert (specs["aimd"].period_s, specs["scrape"].period_s, specs["ewma"].period_s) == (2.5, 0.5, 1.0)


def test_unknown_tick_and_bad_period_are_refused(settings: Any) -> None:
    with pytest.raises(KeyError):
        tick_specs(["nope"])
    settings.TOKENPOOLS_TICK_PERIODS = {"ewma": 0}
    with pytest.raises(ValueError):
        tick_specs(["ewma"])


def test_ticks_mode_follows_the_broker(settings: Any) -> None:
    settings.TOKENPOOLS_TICKS = "auto"
    settings.CELERY_BROKER_URL = "memory://"
    assert ticks_mode() == "in-process"
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:6379/0"
    assert ticks_mode() == "celery"
    settings.TOKENPOOLS_TICKS = "off"
    assert ticks_mode() == "off"
    settings.TOKENPOOLS_TICKS = "sometimes"
    with pytest.raises(ValueError, match="TOKENPOOLS_TICKS"):
        ticks_mode()


def test_a_failing_tick_is_logged_and_runs_again(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("backend down")

    with caplog.at_level(logging.ERROR, logger="workers.ticks"):
        assert run_tick("flaky-test", flaky) is Outcome.FAILED
    assert "tick flaky-test failed" in caplog.text
    assert "backend down" in caplog.text
    assert run_tick("flaky-test", flaky) is Outcome.RAN
    assert len(calls) == 2


def test_run_tick_skips_while_the_same_tick_runs() -> None:
    started, release = threading.Event(), threading.Event()
    outcomes: list[Outcome] = []

    def slow() -> None:
        started.set()
        assert release.wait(30)

    worker = threading.Thread(target=lambda: outcomes.append(run_tick("slow-test", slow)))
    worker.start()
    assert started.wait(30)
    assert run_tick("slow-test", lambda: None) is Outcome.SKIPPED
    # Another tick is not held up by it.
    assert run_tick("other-test", lambda: None) is Outcome.RAN
    release.set()
    worker.join(30)
    assert outcomes == [Outcome.RAN]
    assert run_tick("slow-test", lambda: None) is Outcome.RAN


def _ticker(clock: FakeClock, services: dict[str, Any], periods: dict[str, float]) -> Ticker:
    specs = {name: TickSpec(name, period, "unused:unused") for name, period in periods.items()}
    return Ticker(specs, clock=clock, services=services)


def test_ticker_fires_each_tick_once_per_period() -> None:
    clock = FakeClock()
    counts = {"fast": 0, "slow": 0}
    ticker = _ticker(clock, {
        "fast": lambda: counts.__setitem__("fast", counts["fast"] + 1),
        "slow": lambda: counts.__setitem__("slow", counts["slow"] + 1),
    }, {"fast": 1.0, "slow": 5.0})
    try:
        for step in range(10):  # t = 100.0 .. 104.5 in half seconds
            for future in [ticker.running.get(n) for n in ticker.run_pending()]:
                future.result(30)
            clock.now += 0.5 if step < 9 else 0
        assert counts == {"fast": 5, "slow": 1}
    finally:
        ticker.stop()


def test_ticker_skips_a_firing_while_the_previous_run_is_still_going() -> None:
    clock = FakeClock()
    started, release = threading.Event(), threading.Event()
    runs: list[float] = []

    def slow() -> None:
        runs.append(clock.now)
        started.set()
        assert release.wait(30)

    ticker = _ticker(clock, {"slow": slow}, {"slow": 1.0})
    try:
        assert ticker.run_pending() == ["slow"]
        assert started.wait(30)
        first = ticker.running["slow"]
        for _ in range(3):  # three periods pass while the first run hangs
            clock.now += 1.0
            assert ticker.run_pending() == []
        assert ticker.counts["slow"]["skipped"] == 3
        release.set()
        assert first.result(30) is Outcome.RAN
        clock.now += 1.0
        assert ticker.run_pending() == ["slow"]
        assert ticker.running["slow"].result(30) is Outcome.RAN
        assert runs == [100.0, 104.0]
        assert ticker.counts["slow"]["ran"] == 2
    finally:
        release.set()
        ticker.stop()


def test_ticker_keeps_going_after_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    calls: list[float] = []

    def broken() -> None:
        calls.append(clock.now)
        if len(calls) == 1:
            raise ValueError("first run breaks")

    ticker = _ticker(clock, {"broken": broken}, {"broken": 2.0})
    try:
        with caplog.at_level(logging.ERROR, logger="workers.ticks"):
            ticker.run_pending()
            assert ticker.running["broken"].result(30) is Outcome.FAILED
        assert "first run breaks" in caplog.text
        clock.now += 1.0
        assert ticker.run_pending() == []  # not due yet: a failure does not fire early
        clock.now += 1.0
        ticker.run_pending()
        assert ticker.running["broken"].result(30) is Outcome.RAN
        assert calls == [100.0, 102.0]
        assert ticker.counts["broken"] == {"ran": 1, "skipped": 0, "failed": 1}
    finally:
        ticker.stop()


def test_run_forever_stops_on_request() -> None:
    done = threading.Event()
    ticker = Ticker({"once": TickSpec("once", 3600.0, "unused:unused")}, services={"once": done.set})
    thread = ticker.start()
    assert done.wait(30)
    ticker.stop()
    assert not thread.is_alive()
