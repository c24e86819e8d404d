"""A release once begun comes before any later offer of the same process (`GatewayStateStore.release`), so
the end of an answer does not wait for the store's reply (`apps.gateway.account`): the client's next
request, sent the moment it sees the end, finds the room free. On each store and each way the Redis store
reaches Redis: its one shared connection (ordered by the connection), redis-py's pool (ordered by waiting),
and a release with a quota to settle after it (the settle is a second call: ordered by waiting too)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from apps.gateway.account import Accountant
from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.state import GatewayStateStore, Reservation
from apps.policy import AdmissionRequest
from apps.policy.quota import QuotaCharge, QuotaClaim
from tests.gateway.test_state import limits, pool

ENT = limits("e", concurrency=1, tokens_per_second=1000.0)
POOL = pool(ENT, slots=1)
QUOTA_LIMIT = 20.0  # room for one request's hold (5 + 10 tokens) at a time, not two (released using none)


def _request() -> AdmissionRequest:
    return AdmissionRequest(uuid.uuid4().hex, input_tokens=5, max_tokens=10)


def _claim(request: AdmissionRequest, quota: bool) -> QuotaClaim | None:
    if not quota:
        return None
    charge = QuotaCharge("tenant:t", QUOTA_LIMIT, "w", time.time() + 3600.0)
    return QuotaClaim(request.request_id, request.input_tokens, request.max_tokens, (charge,), time.time(), scope="t")


async def _offer(store: GatewayStateStore, quota: bool) -> Any:
    request = _request()
    return await store.offer(limits=ENT, pool=POOL, request=request, quota=_claim(request, quota))


def _stores(redis_url: str) -> dict[str, Callable[[], GatewayStateStore]]:
    prefix = f"order-{uuid.uuid4().hex[:8]}:"
    return {
        "memory": MemoryStateStore,
        "redis, one connection": lambda: RedisStateStore(url=redis_url, prefix=prefix + "a:"),
        "redis-py's pool": lambda: RedisStateStore(
            client=aioredis.Redis.from_url(redis_url, decode_responses=True), prefix=prefix + "b:"),
    }


def _run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


@pytest.mark.redis
@pytest.mark.parametrize("quota", [False, True], ids=["no quota", "with a quota"])
@pytest.mark.parametrize("kind", ["memory", "redis, one connection", "redis-py's pool"])
def test_an_offer_after_a_begun_release_finds_its_room_free(redis_url: str, kind: str, quota: bool) -> None:
    async def scenario() -> None:
        store = _stores(redis_url)[kind]()
        try:
            await store.sync_pool(pool=POOL)
            for _ in range(20):  # a race would lose some of them: every one must find the room free
                first = await _offer(store, quota)
                assert first.state == "running" and first.reservation is not None
                # The one slot (and the quota's room) is held: a second offer now is refused.
                held = await _offer(store, quota)
                assert held.state != "running", held.decision
                if held.reservation is not None:  # queued: taken back out
                    await store.release(reservation=held.reservation)
                release = asyncio.ensure_future(store.release(reservation=first.reservation, prompt_tokens=0,
                                                              completion_tokens=0))
                await asyncio.sleep(0)  # its first step, as the account step waits for, no more
                after = await _offer(store, quota)
                assert after.state == "running", after.decision
                assert (await release).outcome == "completed"
                assert after.reservation is not None
                await store.release(reservation=after.reservation, prompt_tokens=0, completion_tokens=0)
        finally:
            await store.close()

    _run(scenario)


class _SlowRelease(MemoryStateStore):
    """The in-process store, its release answering only once `answer` is set (Redis's reply on its way)."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()
        self.begun = 0

    async def release(self, **kwargs: Any) -> Any:
        self.begun += 1
        result = await super().release(**kwargs)  # applied at once: what a begun release guarantees
        await self.answer.wait()
        return result


def test_the_account_step_waits_for_the_release_to_begin_and_stop_for_it_to_land() -> None:
    from apps.gateway.admission import InFlight
    from apps.gateway.metrics import GatewayMetrics
    from apps.gateway.peers import Alone
    from apps.gateway.usage import UsageAccumulator

    async def scenario() -> None:
        store = _SlowRelease()
        accountant = Accountant(store=store, peers=Alone(), metrics=GatewayMetrics(), usage=UsageAccumulator(),
                                in_flight=InFlight(), budgets={})
        offer = await _offer(store, False)
        reservation: Reservation = offer.reservation
        await accountant._begin_release(reservation, 5, 10, None)
        assert store.begun == 1 and len(accountant.unreleased()) == 1  # on its way, its lease still renewed
        assert (await _offer(store, False)).state == "running"  # and already applied
        settling = asyncio.ensure_future(accountant.settle())
        await asyncio.sleep(0.05)
        assert not settling.done()  # stop waits for it
        store.answer.set()
        await asyncio.wait_for(settling, 1.0)
        assert accountant.unreleased() == []

    _run(scenario)
