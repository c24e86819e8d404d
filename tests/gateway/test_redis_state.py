"""The Redis store on a real Redis: exact limits across two stores (as two processes), idempotent
release with refunds, fail-closed errors and recovery."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.gateway.state import StateStoreUnavailable
from apps.policy import AdmissionRequest, EntitlementLimits
from tests.support.services import free_port

pytestmark = pytest.mark.redis


def limits(name: str, **overrides: object) -> EntitlementLimits:
    fields: dict[str, object] = {"service_class": "guaranteed", "concurrency": 3, "tokens_per_second": 1.0,
                                 "token_bucket_seconds": 100_000.0, "context_window": 4096}
    fields.update(overrides)
    return EntitlementLimits(entitlement_id=name, **fields)  # type: ignore[arg-type]


def pool(name: str) -> PoolInfo:
    return PoolInfo(name=name, model_name="m", replica_urls=("http://x",), concurrency_capacity=100,
                    kv_capacity=1e12, kv_bytes_per_token=0, context_window=4096)


def request(max_tokens: int = 10) -> AdmissionRequest:
    return AdmissionRequest(uuid.uuid4().hex, input_tokens=5, max_tokens=max_tokens)


def test_two_stores_enforce_one_concurrency_limit_exactly(redis_url: str) -> None:
    name, pool_name = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario() -> tuple[int, int, int]:
        first, second = RedisStateStore(url=redis_url), RedisStateStore(url=redis_url)
        try:
            ent, p = limits(name), pool(pool_name)
            results = await asyncio.gather(*(
                (first if i % 2 else second).admit(limits=ent, pool=p, request=request()) for i in range(24)
            ))
            admitted = [r for r in results if r.reservation is not None]
            reasons = {r.decision.reason for r in results if r.reservation is None}
            assert reasons <= {"concurrency_limit_exceeded"}
            in_flight = (await first.entitlement_usage(limits=ent)).in_flight
            running = await second.pool_running(pool=pool_name)
            for result in admitted:
                assert result.reservation is not None
                await first.release(reservation=result.reservation, prompt_tokens=5, completion_tokens=10)
            return len(admitted), in_flight, running
        finally:
            await first.close()
            await second.close()

    admitted, in_flight, running = asyncio.run(scenario())
    assert admitted == 3
    assert in_flight == 3
    assert running == 3


def test_release_is_idempotent_and_refunds_unused_tokens(redis_url: str) -> None:
    name, pool_name = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario() -> None:
        store = RedisStateStore(url=redis_url)
        try:
            ent, p = limits(name), pool(pool_name)
            before = (await store.entitlement_usage(limits=ent)).tokens_available
            result = await store.admit(limits=ent, pool=p, request=request(max_tokens=100))
            assert result.reservation is not None
            charged = (await store.entitlement_usage(limits=ent)).tokens_available
            # Refill is 1 token/s: allow for the seconds this test may take, nothing near the 105 charged.
            assert before - 105 <= charged <= before - 105 + 5
            assert await store.release(reservation=result.reservation, prompt_tokens=5, completion_tokens=20)
            assert not await store.release(reservation=result.reservation, prompt_tokens=5, completion_tokens=20)
            usage = await store.entitlement_usage(limits=ent)
            assert usage.in_flight == 0
            # 80 of the 105 reserved tokens came back exactly once.
            assert before - 25 <= usage.tokens_available <= before - 25 + 5
            assert await store.pool_running(pool=pool_name) == 0
            served = await store.served_drain(entitlement=name)
            assert (served.tokens, served.requests) == (25, 1)
            assert (await store.served_drain(entitlement=name)).requests == 0
        finally:
            await store.close()

    asyncio.run(scenario())


def test_rejections_leave_no_reservation(redis_url: str) -> None:
    name, pool_name = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario() -> None:
        store = RedisStateStore(url=redis_url)
        try:
            ent = limits(name, tokens_per_second=0.001, token_bucket_seconds=10_000.0)  # a 10-token bucket
            result = await store.admit(limits=ent, pool=pool(pool_name), request=request(max_tokens=100))
            assert result.reservation is None
            assert result.decision.reason == "rate_limit_exceeded"
            assert not result.decision.retryable
            assert (await store.entitlement_usage(limits=ent)).in_flight == 0
        finally:
            await store.close()

    asyncio.run(scenario())


def test_unreachable_redis_raises_state_store_unavailable() -> None:
    async def scenario() -> None:
        store = RedisStateStore(url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2)
        try:
            with pytest.raises(StateStoreUnavailable):
                await store.admit(limits=limits("x"), pool=pool("p"), request=request())
        finally:
            await store.close()

    asyncio.run(scenario())


def test_reservations_of_a_dead_process_are_reaped_once_their_lease_runs_out(redis_url: str) -> None:
    import apps.gateway.redis_state as redis_state

    name, pool_name, prefix = uuid.uuid4().hex, uuid.uuid4().hex, f"t{uuid.uuid4().hex}:"

    async def scenario() -> tuple[int, int, int, int]:
        dead, alive = RedisStateStore(url=redis_url, prefix=prefix), RedisStateStore(url=redis_url, prefix=prefix)
        try:
            ent, p = limits(name), pool(pool_name)
            kept = await alive.admit(limits=ent, pool=p, request=request())
            original = redis_state.LEASE_S
            redis_state.LEASE_S = 0.0  # the dead process's lease is already over
            try:
                lost = await dead.admit(limits=ent, pool=p, request=request())
            finally:
                redis_state.LEASE_S = original
            assert kept.reservation is not None and lost.reservation is not None
            before = (await alive.entitlement_usage(limits=ent)).in_flight
            await alive.leases_renew(request_ids=[kept.reservation.request_id])
            reaped = await alive.leases_reap()
            after = (await alive.entitlement_usage(limits=ent)).in_flight
            again = await alive.leases_reap()
            return before, reaped, after, again
        finally:
            await dead.close()
            await alive.close()

    assert asyncio.run(scenario()) == (2, 1, 1, 0)


def test_two_stores_share_one_token_bucket_exactly(redis_url: str) -> None:
    name, pool_name = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario() -> list[str]:
        first, second = RedisStateStore(url=redis_url), RedisStateStore(url=redis_url)
        try:
            # A 100-token bucket refilling at 0.001 token/s; each request costs 5 + 25 = 30.
            ent = limits(name, concurrency=50, tokens_per_second=0.001, token_bucket_seconds=100_000.0)
            results = await asyncio.gather(*(
                (first if i % 2 else second).admit(limits=ent, pool=pool(pool_name), request=request(max_tokens=25))
                for i in range(10)
            ))
            return sorted(r.decision.reason for r in results)
        finally:
            await first.close()
            await second.close()

    reasons = asyncio.run(scenario())
    assert reasons.count("admitted") == 3
    assert reasons.count("rate_limit_exceeded") == 7


def test_admission_takes_the_budget_slot_in_the_same_script_and_release_gives_it_back(redis_url: str) -> None:
    """`slot=` makes the COMMIT also take one of the pool's budget slots; RELEASE (and the reaper) free it."""
    import apps.gateway.redis_state as redis_state
    from apps.gateway.state import SlotRequest

    name, pool_name, prefix = uuid.uuid4().hex, uuid.uuid4().hex, f"t{uuid.uuid4().hex}:"

    async def scenario() -> None:
        store = RedisStateStore(url=redis_url, prefix=prefix)
        slots_key = store._slot_keys(pool_name)[0]
        try:
            ent, p = limits(name, concurrency=10), pool(pool_name)
            await store.pool_budgets_set(budgets={pool_name: 1})
            first = await store.admit(limits=ent, pool=p, request=request(), slot=SlotRequest(100, 60.0))
            assert first.reservation is not None and first.slot_taken
            assert await store.redis.zscore(slots_key, first.reservation.request_id) is not None
            # Budget 1 is held: the next request is admitted (its reservation stands) without a slot.
            second = await store.admit(limits=ent, pool=p, request=request(), slot=SlotRequest(100, 60.0))
            assert second.reservation is not None and not second.slot_taken
            assert await store.redis.zcard(slots_key) == 1
            # Without `slot=` no slot is asked for at all.
            third = await store.admit(limits=ent, pool=p, request=request())
            assert third.reservation is not None and not third.slot_taken

            await store.release(reservation=first.reservation, prompt_tokens=5, completion_tokens=1)
            assert await store.redis.zcard(slots_key) == 0
            await store.pool_budgets_set(budgets={pool_name: 5})
            original = redis_state.LEASE_S
            redis_state.LEASE_S = 0.0  # a process that dies holding a slot: the reaper frees both
            try:
                lost = await store.admit(limits=ent, pool=p, request=request(), slot=SlotRequest(100, 60.0))
            finally:
                redis_state.LEASE_S = original
            assert lost.reservation is not None and lost.slot_taken
            assert await store.leases_reap() == 1
            assert await store.redis.zscore(slots_key, lost.reservation.request_id) is None
            for result in (second, third):
                assert result.reservation is not None
                await store.release(reservation=result.reservation, prompt_tokens=5, completion_tokens=1)
        finally:
            await store.close()

    asyncio.run(scenario())
