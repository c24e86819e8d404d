"""The overview's figures as pure functions (issue 28): fairness (Jain's index of served over entitled),
time to exhaustion of a quota, SLO attainment, refusals per minute and a pool's load, with numbers worked
out by hand."""

from __future__ import annotations

import datetime as dt

import pytest

from apps.dashboard import overview
from apps.dashboard.samples import EntitlementPoint, PoolSample

NOW = dt.datetime(2026, 11, 26, 12, 30, 20, tzinfo=dt.UTC)


def point(name: str, *, served: float, entitled: float, admitted: int = 1, **extra: object) -> EntitlementPoint:
    return EntitlementPoint(name, tokens_per_s=served, baseline_tokens_per_s=entitled, admitted=admitted,
                            **extra)  # type: ignore[arg-type]


def sample(t: float, *points: EntitlementPoint) -> PoolSample:
    return PoolSample(time=t, pool="p", slots=16, entitlements=points)


def test_fairness_is_jains_index_of_served_over_entitled() -> None:
    # a gets 100 of 100 (x=1), b 50 of 200 (x=0.25): (1.25)^2 / (2 * (1 + 0.0625)) = 0.735...
    samples = [sample(0, point("a", served=100, entitled=100), point("b", served=50, entitled=200))]
    assert overview.pool_fairness(samples) == (0.735, 2)
    # Served in proportion to entitlement is fair, whatever the absolute numbers.
    fair = [sample(0, point("a", served=30, entitled=100), point("b", served=60, entitled=200))]
    assert overview.pool_fairness(fair) == (1.0, 2)


def test_fairness_averages_over_the_window_and_counts_only_entitlements_with_demand() -> None:
    samples = [
        # a: 200 then 0 -> mean 100 of 100 (x=1); b: 25 and 25 of 100 (x=0.25); c: idle (no demand)
        sample(0, point("a", served=200, entitled=100), point("b", served=25, entitled=100),
               point("c", served=0, entitled=100, admitted=0)),
        sample(1, point("a", served=0, entitled=100, admitted=0), point("b", served=25, entitled=100),
               point("c", served=0, entitled=100, admitted=0)),
    ]
    # (1.25)^2 / (2 * 1.0625) = 0.735; counting idle c (x=0) would give 1.5625 / 3.1875 = 0.49
    assert overview.pool_fairness(samples) == (0.735, 2)
    # Refused or waiting is demand too, and one with nothing entitled is left out (no share to compare to).
    refused = [sample(0, point("a", served=100, entitled=100),
                      point("b", served=0, entitled=100, admitted=0, denied={"pool_contended": 3}),
                      point("spot", served=40, entitled=0))]
    assert overview.pool_fairness(refused) == (0.5, 2)
    # Fewer than two entitlements with demand: nothing to compare.
    assert overview.pool_fairness([sample(0, point("a", served=10, entitled=100))]) == (None, 1)


def test_time_to_exhaustion() -> None:
    assert overview.time_to_exhaustion(1200.0, 4.0) == 300.0
    assert overview.time_to_exhaustion(0.0, 4.0) == 0.0
    assert overview.time_to_exhaustion(-5.0, 0.0) == 0.0
    assert overview.time_to_exhaustion(1200.0, 0.0) is None


def status(used: float, limit: float, resets_at: dt.datetime) -> dict[str, object]:
    return {"unit": "tokens", "limit": limit, "used": used, "remaining": max(0.0, limit - used),
            "used_percent": round(100 * used / limit, 1), "resets_at": resets_at.isoformat().replace("+00:00", "Z")}


def test_quota_burn_rate_is_the_last_fifteen_minutes_and_says_when_the_window_resets_first() -> None:
    in_one_hour = NOW + dt.timedelta(hours=1)
    # 90,000 tokens in 15 minutes = 100 tokens/s; 60,000 left -> 600 s, before the reset in 3,600 s.
    hot = overview.quota_burn(scope="entitlement", name="acme-chat", tenant="acme",
                              status=status(40_000, 100_000, in_one_hour), used_recently=90_000, now=NOW)
    assert hot.rate_per_s == 100.0 and hot.exhausted_in_s == 600.0 and hot.resets_in_s == 3600.0
    assert not hot.resets_first
    # 9,000 in 15 minutes = 10/s; 60,000 left -> 6,000 s, after the reset: no refusal this window.
    cool = overview.quota_burn(scope="tenant", name="acme", tenant="acme",
                               status=status(40_000, 100_000, in_one_hour), used_recently=9_000, now=NOW)
    assert cool.exhausted_in_s == 6000.0 and cool.resets_first
    idle = overview.quota_burn(scope="tenant", name="globex", tenant="globex",
                               status=status(99_000, 100_000, in_one_hour), used_recently=0, now=NOW)
    assert idle.exhausted_in_s is None and idle.resets_first
    # Nearest first: what runs out before its reset, soonest first; then by share used.
    assert [b.name for b in overview.nearest_limits([cool, idle, hot])] == ["acme-chat", "globex", "acme"]


def test_slo_attainment_is_the_nearest_rank_p99_against_the_target() -> None:
    ttfts = [100.0] * 95 + [300.0] * 4 + [900.0]  # 100 requests
    row = overview.slo_attainment("acme-chat", "acme", 250.0, ttfts)
    # rank ceil(0.99 * 100) = 99 -> 300 ms: over the 250 ms target; 95 of 100 within it.
    assert (row.p99_ms, row.within_percent, row.requests, row.met) == (300.0, 95.0, 100, False)
    assert overview.slo_attainment("a", "t", 300.0, ttfts).met is True
    empty = overview.slo_attainment("a", "t", 300.0, [])
    assert (empty.p99_ms, empty.within_percent, empty.met) == (None, None, None)


def test_refusals_per_minute_by_reason_and_the_tenants_refused_now() -> None:
    minute = NOW.replace(second=0)
    rows = [
        ("acme", "concurrency_limit_exceeded", minute, 7),
        ("acme", "quota_exceeded", minute - dt.timedelta(minutes=3), 2),
        ("globex", "concurrency_limit_exceeded", minute - dt.timedelta(minutes=14), 5),
        ("globex", "pool_contended", minute - dt.timedelta(minutes=1), 4),
        ("initech", "pool_contended", minute - dt.timedelta(minutes=15), 99),  # outside the 15 minutes
    ]
    result = overview.refusals_by_minute(rows, NOW)
    assert len(result.minutes) == 15 and result.minutes[-1] == minute
    assert result.by_reason["concurrency_limit_exceeded"][-1] == 7
    assert result.by_reason["concurrency_limit_exceeded"][0] == 5
    assert sum(result.by_reason["pool_contended"]) == 4
    assert result.total == 18
    # acme was refused in the current minute: first; initech's old refusals are not "now".
    assert [(t.tenant, t.last_minute, t.total) for t in result.tenants] == [("acme", 7, 9), ("globex", 0, 9)]
    assert result.tenants[1].by_reason == {"concurrency_limit_exceeded": 5, "pool_contended": 4}


def test_pool_load_sums_what_the_viewer_sees_against_capacity() -> None:
    samples = [sample(float(t), point("a", served=100.0 * t, entitled=100, in_flight=t, kv_bytes=1e9))
               for t in range(12)]
    load = overview.pool_load("p", samples, slots=16, tokens_per_s=2000.0, kv_bytes=8e9, healthy_replicas=1,
                              replicas=3, unchecked_replicas=1)
    # Last sample: 11 in flight of 16; tokens/s the mean of the last ten samples (200..1100 -> 650).
    assert (load.in_flight, load.slots_percent) == (11, 68.8)
    assert (load.tokens_per_s, load.tokens_percent) == (650.0, 32.5)
    assert load.kv_percent == 12.5
    assert load.unhealthy_replicas == 1  # of 3: one healthy, one not scraped yet
    empty = overview.pool_load("p", [], slots=0, tokens_per_s=0.0, kv_bytes=0.0, healthy_replicas=0, replicas=0)
    assert (empty.in_flight, empty.slots_percent, empty.fairness) == (0, None, None)


@pytest.mark.parametrize(("values", "q", "expected"), [([5.0], 0.99, 5.0), ([1.0, 2.0], 0.5, 1.0),
                                                      ([3.0, 1.0, 2.0], 0.99, 3.0)])
def test_percentile_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert overview.percentile(values, q) == expected
