"""A gateway process that dies does not take capacity or usage with it (real processes, real SIGKILL):
with Redis and `serve --workers 2`, a killed worker's reservations come back within 15 s (their lease,
GATEWAY_LEASE_S 10 s, renewed every GATEWAY_LEASE_RENEW_S 3 s, runs out and any process reaps them), and the
usage of every request answered before a SIGKILL of every process is in the usage records once the site
is served again (it was counted in Redis by each release)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.crash import reclaim_after_sigkill, usage_after_sigkill

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def test_a_killed_workers_reservations_come_back_within_15_seconds(tmp_path: Path, redis_url: str) -> None:
    result = reclaim_after_sigkill(tmp_path, redis_url)
    assert result.held_by_killed, "the killed worker held no request"
    assert result.seconds is not None and result.seconds <= 15.0, result


def test_usage_survives_a_sigkill_of_every_gateway_process(tmp_path: Path, redis_url: str) -> None:
    result = usage_after_sigkill(tmp_path, workers=2, redis_url=redis_url)
    assert result.answered == 200
    assert result.recorded == result.answered, result
