"""Idle cores kept from halting for a measurement (bench/cpu_idle.py): the request is held exactly while the
block runs, and gone after it, also when the block fails; the machine as configured is left alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.cpu_idle import PM_QOS_DEVICE, IdleStatesUnavailable, idle_states, latency_limit_us
from bench.gateway import main as gateway_main

needs_device = pytest.mark.skipif(not os.access(PM_QOS_DEVICE, os.R_OK | os.W_OK),
                                  reason=f"{PM_QOS_DEVICE} is not writable here (not root, or not Linux)")


@needs_device
def test_poll_holds_a_zero_latency_request_for_the_block_only() -> None:
    before = latency_limit_us()
    if before == 0:
        pytest.skip("another process already holds idle states to 0 us: this test could not tell")
    with idle_states("poll"):
        assert latency_limit_us() == 0
    assert latency_limit_us() == before


@needs_device
def test_the_request_goes_when_the_measurement_fails() -> None:
    before = latency_limit_us()
    with pytest.raises(KeyboardInterrupt), idle_states("poll"):
        assert latency_limit_us() == 0
        raise KeyboardInterrupt
    assert latency_limit_us() == before


@needs_device
def test_halt_leaves_the_machine_as_configured() -> None:
    before = latency_limit_us()
    with idle_states("halt"):
        assert latency_limit_us() == before


def test_a_device_it_cannot_open_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IdleStatesUnavailable, match="no-such-device"), idle_states("poll", tmp_path / "no-such-device"):
        pass
    with pytest.raises(ValueError, match="'spin' is not one of halt, poll"), idle_states("spin"):
        pass


def test_the_gateway_bench_says_so_and_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr("bench.gateway.idle_states",
                        lambda mode: idle_states(mode, tmp_path / "missing"))
    monkeypatch.setattr("bench.gateway.measure_all", lambda args: pytest.fail("measured without its idle states"))
    assert gateway_main(["--no-litellm", "--cpu-idle", "poll"]) == 2
    assert "--cpu-idle poll: cannot hold idle cores from halting" in capsys.readouterr().err
