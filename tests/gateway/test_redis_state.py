"""The Redis store on a real Redis, as several gateway processes share it: exact limits across stores,
priority-ordered waiting across stores, idempotent release with refunds, leases of dead processes,
the dispatch budget as a check of the shared machine, fail-closed errors. (That each transition behaves
as the ledger's is tests/conformance's job.)"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.gateway.state import StateStoreUnavailable
from apps.policy import AdmissionConfig, AdmissionRequest, EntitlementLimits
from tests.support.services import free_port

pytestmark = pytest.mark.redis


def limits(name: str, **overrides: object) -> EntitlementLimits:
    # No queue unless a test gives one: these tests count the limits' own refusals.
    fields: dict[str, object] = {"service_class": "guaranteed", "concurrency": 3, "tokens_per_second": 1.0,
                                 "token_bucket_seconds": 100_000.0, "context_window": 4096, "queue_max": 0}
    fields.update(overrides)
    return EntitlementLimits(entitlement_id=name, **fields)  # type: ignore[arg-type]


def pool(name: str, slots: int = 100, *entitlements: EntitlementLimits) -> PoolInfo:
    reserved = tuple((e.entitlement_id, e.concurrency or 0, float(e.kv_bytes or 0.0))
                     for e in entitlements if e.traits.reserved)
    return PoolInfo(name=name, model_name="m", replica_urls=("http://x",), concurrency_capacity=slots,
                    kv_capacity=1e12, kv_bytes_per_token=0, context_window=4096, reserved=reserved,
                    entitlements=entitlements)


def request(max_tokens: int = 10) -> AdmissionRequest:
    return AdmissionRequest(uuid.uuid4().hex, input_tokens=5, max_tokens=max_tokens)


def with_stores(redis_url: str, count: int, body: Callable[..., Awaitable[Any]],
                store_class: type[RedisStateStore] = RedisStateStore, **options: Any) -> Any:
    """Run `body(*stores)` with `count` stores on one prefix: as many gateway processes."""
    prefix = f"t{uuid.uuid4().hex}:"

    async def run() -> Any:
        stores = [store_class(url=redis_url, prefix=prefix, **options) for _ in range(count)]
        try:
            return await body(*stores)
        finally:
            for store in stores:
                await store.close()

    return asyncio.run(run())


def test_two_stores_enforce_one_concurrency_limit_exactly(redis_url: str) -> None:
    async def body(first: RedisStateStore, second: RedisStateStore) -> tuple[int, int, int]:
        ent, p = limits("e"), pool("p")
        offers = await asyncio.gather(*(
            (first if i % 2 else second).offer(limits=ent, pool=p, request=request()) for i in range(24)
        ))
        admitted = [o for o in offers if o.state == "running"]
        assert {o.decision.reason for o in offers if o.state == "rejected"} <= {"concurrency_limit_exceeded"}
        in_flight = (await first.entitlement_usage(limits=ent, pool="p")).in_flight
        running = await second.pool_running(pool="p")
        for offer in admitted:
            assert offer.reservation is not None
            await first.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=10)
        return len(admitted), in_flight, running

    assert with_stores(redis_url, 2, body) == (3, 3, 3)


def test_two_stores_share_one_token_bucket_exactly(redis_url: str) -> None:
    async def body(first: RedisStateStore, second: RedisStateStore) -> list[str]:
        # A 100-token bucket refilling at 0.001 token/s; each request costs 5 + 25 = 30.
        ent = limits("e", concurrency=50, tokens_per_second=0.001, token_bucket_seconds=100_000.0)
        offers = await asyncio.gather(*(
            (first if i % 2 else second).offer(limits=ent, pool=pool("p"), request=request(max_tokens=25))
            for i in range(10)
        ))
        return sorted(o.decision.reason for o in offers)

    reasons = with_stores(redis_url, 2, body)
    assert reasons.count("admitted") == 3
    assert reasons.count("rate_limit_exceeded") == 7


def test_release_is_idempotent_and_refunds_unused_tokens(redis_url: str) -> None:
    async def body(store: RedisStateStore) -> None:
        ent, p = limits("e"), pool("p")
        before = (await store.entitlement_usage(limits=ent, pool="p")).tokens_available
        offer = await store.offer(limits=ent, pool=p, request=request(max_tokens=100))
        assert offer.reservation is not None
        charged = (await store.entitlement_usage(limits=ent, pool="p")).tokens_available
        # Refill is 1 token/s: allow for the seconds this test may take, nothing near the 105 charged.
        assert before - 105 <= charged <= before - 105 + 5
        first = await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=20)
        second = await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=20)
        assert (first.outcome, first.refunded_tokens, second.outcome) == ("completed", 80.0, "unknown")
        usage = await store.entitlement_usage(limits=ent, pool="p")
        assert usage.in_flight == 0
        assert before - 25 <= usage.tokens_available <= before - 25 + 5
        assert await store.pool_running(pool="p") == 0

    with_stores(redis_url, 1, body)


TO_HASH = """
local t = cmsgpack.unpack(redis.call('GET', KEYS[1]))
redis.call('DEL', KEYS[1])
for field, value in pairs(t) do
  if type(value) == 'number' then value = string.format('%.17g', value) end
  redis.call('HSET', KEYS[1], field, value)
end
return 1
"""


def test_records_an_earlier_release_kept_as_hashes_are_read_and_rewritten(redis_url: str) -> None:
    """A Redis holding state from a release that kept the records as hashes: a running request admitted
    then is released correctly (its refund, the entitlement's levels) and the records come back as records."""
    async def body(store: RedisStateStore) -> None:
        ent, p = limits("e"), pool("p")
        before = (await store.entitlement_usage(limits=ent, pool="p")).tokens_available
        offer = await store.offer(limits=ent, pool=p, request=request(max_tokens=100))
        assert offer.reservation is not None
        keys = [store._base("p") + suffix for suffix in ("pool", "ent:e", f"req:{offer.reservation.request_id}")]
        for key in keys:
            await store.redis.eval(TO_HASH, 1, key)
        assert [await store.redis.type(key) for key in keys] == ["hash"] * 3
        assert (await store.entitlement_usage(limits=ent, pool="p")).in_flight == 1
        assert await store.pool_running(pool="p") == 1
        released = await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=20)
        assert (released.outcome, released.refunded_tokens) == ("completed", 80.0)
        usage = await store.entitlement_usage(limits=ent, pool="p")
        assert usage.in_flight == 0 and await store.pool_running(pool="p") == 0
        assert before - 25 <= usage.tokens_available <= before - 25 + 5
        assert [await store.redis.type(key) for key in keys] == ["string", "string", "none"]

    with_stores(redis_url, 1, body)


def test_the_busy_set_an_earlier_release_did_not_keep_is_filled_by_the_next_sync(redis_url: str) -> None:
    """`in_flight` reads the pool's set of busy entitlements, which a release before it did not keep: the
    records it left show once the snapshot's next sync writes them, and a release empties the set."""
    async def body(store: RedisStateStore) -> None:
        busy, idle = limits("busy"), limits("idle")
        p = pool("p", 100, busy, idle)
        await store.sync_pool(pool=p)
        offers = [await store.offer(limits=busy, pool=p, request=request()) for _ in range(2)]
        assert await store.in_flight(pool=p) == {"busy": 2}
        await store.redis.delete(store._base("p") + "busy")  # as a Redis written by an earlier release holds it
        assert await store.in_flight(pool=p) == {}
        await store.sync_pool(pool=p)
        assert await store.in_flight(pool=p) == {"busy": 2}
        for offer in offers:
            assert offer.reservation is not None
            await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=1)
        assert await store.in_flight(pool=p) == {}
        assert await store.redis.scard(store._base("p") + "busy") == 0

    with_stores(redis_url, 1, body)


def test_waiting_is_priority_ordered_across_stores(redis_url: str) -> None:
    """Three processes: one holds the pool's only slot, one has a low-priority waiter that came first, one
    a high-priority waiter; the holder's release starts the high-priority one, wherever it waits."""

    async def body(holder: RedisStateStore, low: RedisStateStore, high: RedisStateStore) -> list[str]:
        cheap = limits("cheap", service_class="spot", concurrency=1)
        relaxed = limits("relaxed", service_class="elastic", concurrency=1, slo_target_ms=5000.0)
        urgent = limits("urgent", service_class="elastic", concurrency=1, slo_target_ms=500.0)
        p = pool("p", 1, cheap, relaxed, urgent)
        held = await holder.offer(limits=cheap, pool=p, request=request())
        first = await low.offer(limits=relaxed, pool=p, request=request())
        second = await high.offer(limits=urgent, pool=p, request=request())
        assert (held.state, first.state, second.state) == ("running", "waiting", "waiting")
        assert held.reservation and first.reservation and second.reservation
        order: list[str] = []
        # As every gateway process does: hear the other processes' starts (pub/sub).
        listeners = [asyncio.create_task(store.events_listen()) for store in (low, high)]
        await asyncio.sleep(0.2)

        async def waiter(store: RedisStateStore, name: str, reservation: Any) -> None:
            if await store.wait(reservation=reservation, timeout_s=5.0):
                order.append(name)
                await asyncio.sleep(0.1)
                await store.release(reservation=reservation, prompt_tokens=5, completion_tokens=1)

        tasks = [asyncio.create_task(waiter(low, "relaxed", first.reservation)),
                 asyncio.create_task(waiter(high, "urgent", second.reservation))]
        await asyncio.sleep(0.1)
        await holder.release(reservation=held.reservation, prompt_tokens=5, completion_tokens=1)
        await asyncio.wait_for(asyncio.gather(*tasks), 4.0)  # well before the 30 s poll could wake anyone
        for listener in listeners:
            listener.cancel()
        return order

    # Notices arrive over pub/sub; the slow poll makes sure they, not polling, woke the waiters.
    original = RedisStateStore.poll_s
    RedisStateStore.poll_s = 30.0
    try:
        assert with_stores(redis_url, 3, body, config=AdmissionConfig(wait_timeout_s=5.0)) == ["urgent", "relaxed"]
    finally:
        RedisStateStore.poll_s = original


def test_a_waiter_of_another_store_expires_and_holds_nothing(redis_url: str) -> None:
    async def body(holder: RedisStateStore, other: RedisStateStore) -> tuple[bool, int]:
        cheap = limits("cheap", service_class="spot", concurrency=1)
        batch = limits("batch", service_class="elastic", concurrency=2, tokens_per_second=None)
        p = pool("p", 1, cheap, batch)
        held = await holder.offer(limits=cheap, pool=p, request=request())
        waiting = await other.offer(limits=batch, pool=p, request=request())
        assert held.state == "running" and waiting.reservation is not None
        started = await other.wait(reservation=waiting.reservation, timeout_s=0.3)
        return started, (await holder.entitlement_usage(limits=batch, pool="p")).in_flight

    assert with_stores(redis_url, 2, body, config=AdmissionConfig(wait_timeout_s=0.3)) == (False, 0)


def test_rejections_leave_no_reservation(redis_url: str) -> None:
    async def body(store: RedisStateStore) -> None:
        ent = limits("e", tokens_per_second=0.001, token_bucket_seconds=10_000.0)  # a 10-token bucket
        offer = await store.offer(limits=ent, pool=pool("p"), request=request(max_tokens=100))
        assert offer.reservation is None and offer.state == "rejected"
        assert offer.decision.reason == "rate_limit_exceeded"
        assert not offer.decision.retryable
        assert (await store.entitlement_usage(limits=ent, pool="p")).in_flight == 0

    with_stores(redis_url, 1, body)


def test_unreachable_redis_raises_state_store_unavailable() -> None:
    async def scenario() -> None:
        store = RedisStateStore(url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2)
        try:
            with pytest.raises(StateStoreUnavailable):
                await store.offer(limits=limits("x"), pool=pool("p"), request=request())
        finally:
            await store.close()

    asyncio.run(scenario())


def test_reservations_of_a_dead_process_are_reaped_once_their_lease_runs_out(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}:"

    async def scenario() -> tuple[int, int, int, int]:
        # The dead process's lease is already over when it admits; the live one renews its own.
        dead = RedisStateStore(url=redis_url, prefix=prefix, lease_s=0.0)
        alive = RedisStateStore(url=redis_url, prefix=prefix)
        try:
            ent, p = limits("e"), pool("p")
            kept = await alive.offer(limits=ent, pool=p, request=request())
            lost = await dead.offer(limits=ent, pool=p, request=request())
            assert kept.reservation is not None and lost.reservation is not None
            before = (await alive.entitlement_usage(limits=ent, pool="p")).in_flight
            await alive.leases_renew(pool="p", request_ids=[kept.reservation.request_id])
            reaped = await alive.leases_reap(pool="p")
            after = (await alive.entitlement_usage(limits=ent, pool="p")).in_flight
            again = await alive.leases_reap(pool="p")
            return before, reaped, after, again
        finally:
            await dead.close()
            await alive.close()

    assert asyncio.run(scenario()) == (2, 1, 1, 0)


def test_the_budget_is_a_check_of_the_shared_machine_and_a_dead_processs_room_comes_back(redis_url: str) -> None:
    """Two processes on one pool with a dispatch budget of 1: the second's higher-priority request waits in the
    machine's room (no queue of its own) and starts when the reaper releases the dead first process's request; a
    lower priority waits too while the budget (not the capacity) is full, and starts once a larger budget makes
    room."""
    prefix = f"t{uuid.uuid4().hex}:"

    async def scenario() -> tuple[str, str, str | None, list[str]]:
        store = RedisStateStore(url=redis_url, prefix=prefix)
        dying = RedisStateStore(url=redis_url, prefix=prefix, lease_s=0.0)
        try:
            # No reservations (they would hold the budget's room idle): two elastic ones, urgent and relaxed.
            gold = limits("gold", service_class="elastic", concurrency=10, slo_target_ms=100.0)
            cheap = limits("cheap", service_class="elastic", concurrency=10, slo_target_ms=5000.0)
            p = pool("p", 100, gold, cheap)
            await store.pool_budgets_set(budgets={"p": 1})
            assert await store.pool_budget(pool="p") == 1
            lost = await dying.offer(limits=cheap, pool=p, request=request())
            waiter = await store.offer(limits=gold, pool=p, request=request())
            assert waiter.reservation is not None and lost.reservation is not None
            assert await store.leases_reap(pool="p") == 1
            state = await store.request_state(reservation=waiter.reservation)
            # Below the running one's priority, it still waits: the budget, not the capacity, is full.
            second = await store.offer(limits=cheap, pool=p, request=request())
            assert second.state == "waiting"
            started = await store.pool_budgets_set(budgets={"p": 2})
            for offer in (waiter, second):
                assert offer.reservation is not None
                await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=1)
            return lost.state, waiter.state, state, started
        finally:
            await store.close()
            await dying.close()

    lost_state, waiter_state, after_reap, started = asyncio.run(scenario())
    assert (lost_state, waiter_state, after_reap) == ("running", "waiting", "running")
    assert len(started) == 1


def test_usage_is_counted_by_the_release_once_and_claimed_once(redis_url: str) -> None:
    from apps.gateway.state import UsageKey

    async def body(store: RedisStateStore, other: RedisStateStore) -> None:
        ent = limits("e", concurrency=4, tokens_per_second=1000.0)
        cheap = limits("cheap", service_class="preemptible", concurrency=1)
        p = pool("p", 4, ent, cheap)
        served = [await store.offer(limits=ent, pool=p, request=request()) for _ in range(3)]
        victim = await store.offer(limits=cheap, pool=p, request=request())
        first, second, unserved = (offer.reservation for offer in served)
        assert first and second and unserved and victim.reservation
        # The pool is full: a guaranteed request evicts the preemptible one; its process then stops it and
        # records what it had served.
        urgent = await store.offer(limits=ent, pool=p, request=request())
        assert urgent.evicted == (victim.reservation.request_id,) and urgent.reservation is not None
        evicted = await store.release(reservation=victim.reservation, prompt_tokens=5, completion_tokens=2,
                                      usage=UsageKey(tenant_id=9, minute=29_000_000))
        assert evicted.outcome == "unknown"
        key = UsageKey(tenant_id=4, minute=29_000_000)
        await store.release(reservation=first, prompt_tokens=5, completion_tokens=7, usage=key)
        # The same release again (its first answer was lost in a Redis outage): nothing counted twice.
        again = await store.release(reservation=first, prompt_tokens=5, completion_tokens=7, usage=key)
        assert again.outcome == "unknown"
        await store.release(reservation=second, prompt_tokens=5, completion_tokens=3, usage=key)
        await store.release(reservation=unserved, prompt_tokens=0, completion_tokens=0)  # never reached a backend
        await store.release(reservation=urgent.reservation)

        claims = await store.usage_claim(pool="p", token="t1", lease_s=0.3)
        assert claims == {"t1": {"4|e|29000000|r": "2", "4|e|29000000|p": "10", "4|e|29000000|c": "10",
                                 "9|cheap|29000000|r": "1", "9|cheap|29000000|p": "5", "9|cheap|29000000|c": "2"}}
        # Not said done (the flusher died before writing it): nobody else takes it while its lease runs ...
        assert await other.usage_claim(pool="p", token="t2", lease_s=30) == {}
        await asyncio.sleep(0.4)
        # ... then another flusher takes it over, under its own token (the database applies a token once).
        assert list(await other.usage_claim(pool="p", token="t3", lease_s=30)) == ["t1"]
        await other.usage_done(pool="p", token="t1")
        assert await store.usage_claim(pool="p", token="t4", lease_s=30) == {}

    with_stores(redis_url, 2, body)


def test_a_dead_processs_queued_request_is_reaped_and_the_queue_goes_on(redis_url: str) -> None:
    """A request waiting in its entitlement's queue holds a lease like any other: when its process dies, the
    reaper takes it out of the queue, and the next one in line starts on the next release."""
    prefix = f"t{uuid.uuid4().hex}:"

    async def scenario() -> tuple[str, str, int, tuple[str, ...]]:
        store = RedisStateStore(url=redis_url, prefix=prefix)
        dying = RedisStateStore(url=redis_url, prefix=prefix, lease_s=0.0)
        try:
            ent = limits("e", concurrency=1, queue_max=2, queue_max_wait_ms=60_000.0)
            p = pool("p", 8, ent)
            running = await store.offer(limits=ent, pool=p, request=request())
            lost = await dying.offer(limits=ent, pool=p, request=request())
            waiter = await store.offer(limits=ent, pool=p, request=request())
            assert running.reservation is not None and waiter.reservation is not None
            reaped = await store.leases_reap(pool="p")
            released = await store.release(reservation=running.reservation, prompt_tokens=5, completion_tokens=1)
            await store.release(reservation=waiter.reservation, prompt_tokens=5, completion_tokens=1)
            return lost.decision.reason, waiter.decision.reason, reaped, released.started
        finally:
            await store.close()
            await dying.close()

    lost_reason, waiter_reason, reaped, started = asyncio.run(scenario())
    assert (lost_reason, waiter_reason, reaped) == ("queued", "queued", 1)
    assert len(started) == 1  # the live waiter, not the reaped one


def test_a_call_waits_for_a_pooled_connection_and_is_busy_only_past_the_pool_timeout(redis_url: str) -> None:
    """The connection pool's fast path (a free connection taken without a timer) keeps the blocking pool's
    promise: with every connection taken a call waits, gets the connection a release hands over, and only a
    wait past the pool timeout is `StateStoreBusy` (503 state_store_busy, never failed open). (The scripts'
    calls share one connection of their own, apps.gateway.resp; the pool serves the other commands.)"""
    from apps.gateway.state import StateStoreBusy

    async def scenario() -> tuple[bool, int, float]:
        store = RedisStateStore(url=redis_url, prefix=f"t{uuid.uuid4().hex}:", max_connections=1,
                                pool_timeout_s=0.3, socket_timeout_s=5.0)
        try:
            holder = asyncio.create_task(store.redis.blpop([f"{store.prefix}nothing"], 1))  # holds the connection 1 s
            await asyncio.sleep(0.05)
            began = time.monotonic()
            try:
                await store.scripts.guarded(store.redis.llen(f"{store.prefix}empty"))
                busy = False
            except StateStoreBusy:
                busy = True
            waited = time.monotonic() - began
            await holder
            holder = asyncio.create_task(store.redis.blpop([f"{store.prefix}nothing"], 0.1))  # now 0.1 s only
            await asyncio.sleep(0.02)
            handed = await store.scripts.guarded(store.redis.llen(f"{store.prefix}empty"))  # waits for that release
            await holder
            return busy, handed, waited
        finally:
            await store.close()

    busy, running, waited = asyncio.run(scenario())
    assert busy and 0.25 <= waited < 1.0
    assert running == 0
