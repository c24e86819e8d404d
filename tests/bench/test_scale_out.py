"""The scale-out benchmark's set-up: its pools spread over the cluster's primaries, its load reaches every
pool, and a Redis call inside a function is not counted as a round trip."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.scale_out import THIRDS, bench_pools, script_commands, wrk_script
from tests.support.redis_cluster import slot_of


def test_the_pools_fall_one_in_each_third_of_the_slots() -> None:
    pools = bench_pools()
    thirds = [next(i for i, (low, high) in enumerate(THIRDS) if low <= slot_of(f"tp:gw:{{{p}}}:pool") <= high)
              for p in pools]
    assert sorted(thirds) == [0, 1, 2]


def test_the_commands_the_functions_run_are_not_round_trips() -> None:
    inner = script_commands()
    assert {"get", "zadd", "hincrby", "time", "replconf"} <= inner
    assert not {"fcall", "hello", "ping", "info"} & inner


def test_the_wrk_script_sends_every_pool_with_its_key_and_paces_only_when_asked(tmp_path: Path) -> None:
    pairs = [("pool0", "tp-key-a"), ("pool7", "tp-key-b")]
    closed = wrk_script(tmp_path, pairs, None).read_text()
    paced = wrk_script(tmp_path, pairs, 160.0).read_text()
    for model, key in pairs:
        assert f'"Bearer {key}"' in closed
        assert json.dumps(json.dumps({"model": model})[1:-1])[1:-1] in closed
    assert "function delay" not in closed
    assert re.search(r"function delay\(\)\n.*\* 160\.000", paced)
