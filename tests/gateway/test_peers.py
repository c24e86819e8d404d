"""What a gateway process shares with the others on its store (apps.gateway.peers), chosen with the store: on
Redis, usage counted by the release and written from the store's claims once; in one process, nothing in the
store to write, hear or reap."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.models import UsageRecord
from apps.gateway.peers import Alone, RedisPeers, peers_for
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.request_log import RequestLog
from apps.gateway.snapshot import PoolInfo
from apps.policy import AdmissionRequest, EntitlementLimits

CHAT = EntitlementLimits("acme-chat", service_class="guaranteed", concurrency=2)
POOL = PoolInfo(name="p", model_name="m", replica_urls=("http://x",), concurrency_capacity=4, kv_capacity=1e12,
                kv_bytes_per_token=0, context_window=4096, reserved=(("acme-chat", 2, 0.0),), entitlements=(CHAT,))


@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
def test_on_redis_the_release_counts_usage_and_the_flush_writes_each_claim_once(redis_url: str, acme: Any) -> None:
    log = RequestLog()

    async def run() -> list[int]:
        store = RedisStateStore(url=redis_url, prefix=f"t{uuid.uuid4().hex}:")
        peers = peers_for(store)
        try:
            assert isinstance(peers, RedisPeers) and peers.budgets_shared
            peers.request_log(log)
            offer = await store.offer(limits=CHAT, pool=POOL, request=AdmissionRequest("r1", 5, 10))
            assert offer.reservation is not None
            key = peers.usage_key(tenant_id=acme.pk, service_tier="guaranteed")
            for _ in range(2):  # a release retried (its first answer lost): counted once
                await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=7, usage=key)
            return [await peers.usage_flush(pools=["p"]), await peers.usage_flush(pools=["p"])]
        finally:
            await store.close()

    assert asyncio.run(run()) == [1, 0]
    record = UsageRecord.objects.get(tenant=acme, entitlement="acme-chat")
    assert (record.service_tier, record.requests, record.prompt_tokens, record.completion_tokens) == (
        "guaranteed", 1, 5, 7)
    assert log.redis is not None  # the request log goes through the store's Redis


def test_in_one_process_usage_is_the_processs_and_nothing_is_left_to_reap() -> None:
    store = MemoryStateStore()
    peers = peers_for(store)
    log = RequestLog()

    async def run() -> tuple[Any, ...]:
        offer = await store.offer(limits=CHAT, pool=POOL, request=AdmissionRequest("r1", 5, 10))
        assert offer.reservation is not None
        await peers.listen()  # returns: every transition is this process's own
        # Not renewed, yet not reaped: a request of this process lives and dies with it.
        reaped = await peers.leases(pool="p", request_ids=[])
        state = await store.request_state(reservation=offer.reservation)
        return reaped, state, await peers.usage_flush(pools=["p"])

    assert isinstance(peers, Alone) and not peers.budgets_shared
    assert peers.usage_key(tenant_id=1, service_tier="guaranteed") is None  # the accumulator counts it
    assert asyncio.run(run()) == (0, "running", 0)
    peers.request_log(log)
    assert log.redis is None
