"""The dashboards' samples: what a sample carries survives JSON (the history on Redis and the channel
messages are JSON)."""

from __future__ import annotations

from apps.dashboard.samples import EntitlementPoint, PoolSample

T0 = 1_800_000_000.0


def test_sample_round_trips_through_json() -> None:
    sample = PoolSample(time=T0, pool="qwen", slots=16, budget=12, aimd_action=1, running=4, queued=2,
                        p99_ttft_s=0.8, kv_usage={"http://r1": 0.4}, kv_admitted=0.1,
                        entitlements=(EntitlementPoint("a", "acme", "elastic", 3, 1, 0.5, 500.0, 0.2, 40.0, 2,
                                                       {"pool_contended": 1}, 90.0, 100.0, 1024.0),))
    assert PoolSample.from_dict(sample.to_dict()) == sample
