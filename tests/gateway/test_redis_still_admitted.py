"""COMMIT's `still_admitted` (apps/gateway/lua/commit.lua) on a real Redis, against `apps.policy.admit` itself.

A start decided on a snapshot that is no longer the pool's stands when `still_admitted` says `admit` would take
the very same decision now. Random pools (every class, reservations, KV limits, buckets, budgets, saturation,
queues) are driven by two processes, so that one's kept snapshots go out of date by the other's work, and every
COMMIT of a start is checked against `admit` on READ's snapshot taken just before it: confirmed exactly when
`admit` takes the same decision (the same priority, cost and KV bytes, borrowing nothing, no queue), refused
otherwise. One clock for both calls, so the bucket's level is the same in both."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from typing import Any

import pytest

from apps.gateway.redis_snapshot import read_snapshot
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.policy import AdmissionRequest, EntitlementLimits, admit
from apps.policy.clock import ManualClock

pytestmark = pytest.mark.redis

# COMMIT's arguments after the keys (0-based): priority, token cost, KV bytes, the `still_admitted` argument.
PRIORITY, COST, KV, STANDING = 5, 6, 7, 25


class CheckedStore(RedisStateStore):
    """The Redis store, checking each COMMIT of a start against `admit` on READ's snapshot just before it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.context: tuple[EntitlementLimits, PoolInfo, AdmissionRequest, float] | None = None
        self.seen: Counter[str] = Counter()

    async def offer(self, **kwargs: Any) -> Any:  # type: ignore[override]
        self.context = (kwargs["limits"], kwargs["pool"], kwargs["request"], kwargs.get("saturation", 0.0))
        return await super().offer(**kwargs)

    async def _call(self, name: str, keys: list[str], args: Any) -> Any:
        if name != "commit" or args[STANDING] == "":
            return await super()._call(name, keys, args)
        assert self.context is not None
        limits, pool, request, saturation = self.context
        snapshot = read_snapshot(await self._read(limits, pool, request.request_id), limits, pool, saturation)
        decision = admit(limits, snapshot.usage, snapshot.pool_usage, request, self.config)
        same = (decision.admitted and not decision.borrowed and snapshot.queue_length == 0 and not snapshot.duplicate
                and repr(decision.priority) == args[PRIORITY] and decision.token_cost == args[COST]
                and repr(decision.kv_bytes) == args[KV])
        raw = await super()._call(name, keys, args)
        confirmed = int(raw[0]) == 1
        how = {1: "mark", 2: "still_admitted"}.get(int(raw[6]), "fingerprint") if confirmed else "refused"
        assert confirmed == same, (how, decision, snapshot, args)
        self.seen[how] += 1
        return raw


def entitlements(rng: random.Random) -> tuple[EntitlementLimits, ...]:
    def maybe(value: Any) -> Any:
        return value if rng.random() < 0.7 else None

    made = []
    for name, service_class in (("ded", "dedicated"), ("gua", "guaranteed"), ("ela", "elastic"), ("spot", "spot"),
                                ("pre", "preemptible")):
        concurrency = rng.randint(1, 3) if service_class in ("dedicated", "guaranteed") else maybe(rng.randint(1, 3))
        kv = maybe(float(rng.choice((150, 300, 450))))
        made.append(EntitlementLimits(
            entitlement_id=name, service_class=service_class, concurrency=concurrency,
            burst_concurrency=None if concurrency is None else maybe(concurrency + rng.randint(0, 2)),
            kv_bytes=kv, burst_kv_bytes=None if kv is None else maybe(kv + 300.0),
            tokens_per_second=maybe(1.0), token_bucket_seconds=rng.choice((40.0, 100.0)), kv_bytes_per_token=10.0,
            slo_target_ms=rng.choice((500.0, 1000.0)), queue_max=rng.choice((0, 2))))
    return tuple(made)


def random_pool(rng: random.Random) -> PoolInfo:
    ents = entitlements(rng)
    reserved = tuple((e.entitlement_id, e.concurrency or 0, float(e.kv_bytes or 0.0)) for e in ents if e.traits.reserved)
    return PoolInfo(name="p", model_name="m", replica_urls=("http://x",), concurrency_capacity=rng.randint(2, 7),
                    kv_capacity=float(rng.choice((600, 900, 1500))), kv_bytes_per_token=10, context_window=4096,
                    reserved=reserved, entitlements=ents)


async def drive(rng: random.Random, stores: tuple[CheckedStore, CheckedStore], clock: ManualClock) -> None:
    p = random_pool(rng)
    await stores[0].sync_pool(pool=p)
    held: list[tuple[CheckedStore, Any]] = []
    offered: list[str] = []  # entitlements Redis holds a record of (a tick moves only those)
    for _ in range(120):
        clock.advance(rng.choice((0.0, 0.01, 0.5, 3.0)))
        store = stores[0] if rng.random() < 0.6 else stores[1]
        roll = rng.random()
        if roll < 0.55:
            limits = rng.choice(p.entitlements)
            offered.append(limits.entitlement_id)
            request = AdmissionRequest(uuid.uuid4().hex, input_tokens=5, max_tokens=rng.choice((5, 10, 25)))
            offer = await store.offer(limits=limits, pool=p, request=request, saturation=rng.choice((0.0, 0.0, 1.5)))
            if offer.reservation is not None:
                held.append((store, offer.reservation))
        elif roll < 0.85 and held:
            owner, reservation = held.pop(rng.randrange(len(held)))
            await owner.release(reservation=reservation, prompt_tokens=5, completion_tokens=3)
        elif roll < 0.93 and offered:
            ent = rng.choice(offered)
            await store._call("dynamics", [store._base("p")], [ent, repr(rng.choice((0.0, 2.0))), "0.0"])
        else:
            await store.pool_budgets_set(budgets={"p": rng.choice((None, 1, 2, 4))})


@pytest.mark.parametrize("seed", range(6))
def test_still_admitted_confirms_exactly_the_starts_admit_takes_again(redis_url: str, seed: int) -> None:
    clock = ManualClock(1000.0)
    prefix = f"t{uuid.uuid4().hex}:"

    async def run() -> Counter[str]:
        stores = (CheckedStore(url=redis_url, prefix=prefix, clock=clock),
                  CheckedStore(url=redis_url, prefix=prefix, clock=clock))
        try:
            await drive(random.Random(seed), stores, clock)
            return stores[0].seen + stores[1].seen
        finally:
            for store in stores:
                await store.close()

    seen = asyncio.run(run())
    # Every way a start is checked came up (the counts differ by seed; each seed sees both outcomes of the check).
    assert seen["still_admitted"] > 0 and seen["refused"] > 0, seen
