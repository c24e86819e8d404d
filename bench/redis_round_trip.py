"""The floor a Redis round trip puts under the Redis store's added latency on this machine: one PING through the
gateway's own client (`MultiplexedRedis`) from a process on the gateway's core (0), to a Redis pinned on core 1
(where `bench.gateway` puts it) or on core 0, with the calls a fixed gap apart. At 50 requests/s the gateway's
cores sit idle between requests, and each round trip pays for waking them; back to back it does not.

    python -m bench.redis_round_trip [--calls 400] [--gaps-ms 20 2 0] [--redis-cores 1 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import uvloop

from apps.gateway.resp import MultiplexedRedis
from bench.cpu_idle import MODES, idle_states
from bench.gateway import pin_redis
from bench.policy import percentile
from tests.support.services import running_redis


async def round_trips(url: str, calls: int, gap_s: float) -> list[float]:
    """Microseconds of each of `calls` PINGs, `gap_s` apart."""
    client = MultiplexedRedis.from_url(url, timeout_s=2.0)
    assert client is not None
    try:
        await client.call("PING")
        took = []
        for _ in range(calls):
            began = time.perf_counter()
            await client.call("PING")
            took.append((time.perf_counter() - began) * 1e6)
            if gap_s:
                await asyncio.sleep(gap_s)
        return sorted(took)
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=[20.0, 2.0, 0.0])
    parser.add_argument("--redis-cores", nargs="+", default=["1", "0"])
    parser.add_argument("--cpu-idle", nargs="+", choices=MODES, default=["halt"],
                        help="idle cores halt (as configured) or poll (bench/cpu_idle.py; root); several: each in turn")
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {0})  # the gateway's core
    print("| idle cores | Redis on core | gap between calls | PING p50 us | p90 us |\n|---|---|---:|---:|---:|")
    for core in args.redis_cores:
        with running_redis() as url:
            pin_redis(url, core)
            for mode in args.cpu_idle:
                with idle_states(mode):
                    for gap_ms in args.gaps_ms:
                        took = uvloop.run(round_trips(url, args.calls, gap_ms / 1000))
                        print(f"| {mode} | {core} | {gap_ms:g} ms | {percentile(took, 0.5):.0f} | "
                              f"{percentile(took, 0.9):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
