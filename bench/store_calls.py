"""The state stores' cost per admission: an offer and its release, one after the other, on the in-process store
and on the Redis store (a real Redis started for it), in wall time and in this process's CPU; and the Redis
store's EWMA tick with many idle entitlements. What the gateway's own CPU a request is made of, without HTTP.

    python -m bench.store_calls [--requests 3000] [--entitlements 10000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.gateway.state import GatewayStateStore
from apps.policy import AdmissionRequest, EntitlementLimits
from tests.support.services import running_redis


def _limits(name: str, concurrency: int) -> EntitlementLimits:
    return EntitlementLimits(entitlement_id=name, service_class="elastic", concurrency=concurrency,
                             tokens_per_second=1e9, token_bucket_seconds=1.0, context_window=4096, queue_max=0)


def _pool(*entitlements: EntitlementLimits, slots: int = 1000) -> PoolInfo:
    return PoolInfo(name="p", model_name="m", replica_urls=("http://x",), concurrency_capacity=slots,
                    kv_capacity=1e12, kv_bytes_per_token=0, context_window=4096, entitlements=entitlements)


async def offer_and_release(store: GatewayStateStore, requests: int) -> tuple[float, float]:
    """Microseconds of wall time and of this process's CPU per offer and its release."""
    limits = _limits("e", 1000)
    pool = _pool(limits)
    await store.sync_pool(pool=pool)
    began, cpu = time.perf_counter(), time.process_time()
    for _ in range(requests):
        offer = await store.offer(limits=limits, pool=pool,
                                  request=AdmissionRequest(uuid.uuid4().hex, input_tokens=5, max_tokens=10))
        assert offer.reservation is not None, offer.decision
        await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=10)
    return (time.perf_counter() - began) / requests * 1e6, (time.process_time() - cpu) / requests * 1e6


async def idle_tick(store: GatewayStateStore, entitlements: int, busy: int) -> float:
    """Milliseconds of one EWMA tick of a pool of `entitlements`, `busy` of them with a request in flight."""
    limits = tuple(_limits(f"e{i}", 2) for i in range(entitlements))
    pool = _pool(*limits)
    await store.sync_pool(pool=pool)
    for entitlement in limits[:busy]:
        await store.offer(limits=entitlement, pool=pool,
                          request=AdmissionRequest(uuid.uuid4().hex, input_tokens=5, max_tokens=10))
    await store.tick(entitlements={"p": limits})
    times = []
    for _ in range(5):
        await asyncio.sleep(0.05)
        began = time.perf_counter()
        await store.tick(entitlements={"p": limits})
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


async def measure(args: argparse.Namespace, redis_url: str) -> None:
    stores = {"memory": lambda: MemoryStateStore(),
              "redis": lambda: RedisStateStore(url=redis_url, prefix=f"bench:{uuid.uuid4().hex}:")}
    for name, make in stores.items():
        walls, cpus = [], []
        for _ in range(args.rounds):
            store = make()
            await offer_and_release(store, 200)  # warm: connections, the function library, caches
            wall, cpu = await offer_and_release(store, args.requests)
            walls.append(wall)
            cpus.append(cpu)
            await store.close()
        print(f"{name:7s} offer+release: wall {statistics.median(walls):7.1f} us  cpu {statistics.median(cpus):6.1f} us"
              f"  (median of {args.rounds} rounds of {args.requests})", flush=True)
    for name, make in stores.items():
        store = make()
        tick_ms = await idle_tick(store, args.entitlements, busy=5)
        await store.close()
        print(f"{name:7s} EWMA tick, {args.entitlements} entitlements, 5 busy: {tick_ms:8.2f} ms (median of 5)",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--entitlements", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with running_redis() as redis_url:
        asyncio.run(measure(args, redis_url))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
