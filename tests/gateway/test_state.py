"""The in-process store: a ledger per pool kept in step with the snapshot, the waiting room, evictions
handed to the gateway. (Every transition itself is the ledger's: tests/conformance holds the store to it.)"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.snapshot import PoolInfo
from apps.policy import AdmissionConfig, AdmissionRequest, EntitlementLimits, ManualClock


def limits(name: str, service_class: str = "elastic", **overrides: object) -> EntitlementLimits:
    fields: dict[str, object] = {"service_class": service_class, "concurrency": 2, "tokens_per_second": 10.0,
                                 "token_bucket_seconds": 10.0, "kv_bytes_per_token": 1.0}
    fields.update(overrides)
    return EntitlementLimits(entitlement_id=name, **fields)  # type: ignore[arg-type]


def pool(*entitlements: EntitlementLimits, slots: int = 4) -> PoolInfo:
    reserved = tuple((e.entitlement_id, e.concurrency or 0, float(e.kv_bytes or 0.0))
                     for e in entitlements if e.traits.reserved)
    return PoolInfo(name="p", model_name="m", replica_urls=("http://x",), concurrency_capacity=slots,
                    kv_capacity=1e9, kv_bytes_per_token=1, context_window=4096, reserved=reserved,
                    entitlements=entitlements)


def request(max_tokens: int = 10) -> AdmissionRequest:
    return AdmissionRequest(uuid.uuid4().hex, input_tokens=5, max_tokens=max_tokens)


def test_an_offer_charges_and_a_release_refunds_once() -> None:
    async def scenario() -> None:
        store = MemoryStateStore(clock=ManualClock(0.0))
        ent = limits("e")
        offer = await store.offer(limits=ent, pool=pool(ent), request=request(max_tokens=40))
        assert offer.state == "running" and offer.reservation is not None
        assert offer.view.remaining_tokens == 100 - 45
        assert offer.view.remaining_requests == 1
        usage = await store.entitlement_usage(limits=ent, pool="p")
        assert (usage.in_flight, usage.kv_bytes_in_flight) == (1, 45.0)
        first = await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=10)
        second = await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=10)
        assert (first.outcome, first.refunded_tokens, second.outcome) == ("completed", 30.0, "unknown")
        usage = await store.entitlement_usage(limits=ent, pool="p")
        assert (usage.in_flight, usage.kv_bytes_in_flight, usage.tokens_available) == (0, 0.0, 85.0)
        assert await store.pool_running(pool="p") == 0

    asyncio.run(scenario())


def test_idle_reservations_of_guaranteed_entitlements_are_withheld_from_elastic() -> None:
    async def scenario() -> list[str]:
        store = MemoryStateStore(clock=ManualClock(0.0))
        # 4 slots, 3 of them reserved by an idle guaranteed entitlement: elastic gets one.
        gold = limits("gold", "guaranteed", concurrency=3, tokens_per_second=1000.0)
        ent = limits("e", concurrency=4, tokens_per_second=1000.0)
        p = pool(gold, ent)
        outcomes = [(await store.offer(limits=ent, pool=p, request=request())).decision.reason for _ in range(2)]
        outcomes.append((await store.offer(limits=gold, pool=p, request=request())).decision.reason)
        return outcomes

    assert asyncio.run(scenario()) == ["admitted", "pool_contended", "admitted"]


def test_an_eviction_is_handed_to_the_gateway_and_the_evicting_request_starts() -> None:
    async def scenario() -> tuple[list[str], str, tuple[str, ...]]:
        store = MemoryStateStore(clock=ManualClock(0.0))
        evicted: list[str] = []
        store.on_evict = evicted.append
        batch = limits("batch", "preemptible", concurrency=2, tokens_per_second=1000.0, slo_target_ms=5000.0)
        gold = limits("gold", "guaranteed", concurrency=1, tokens_per_second=1000.0)
        p = pool(batch, gold, slots=2)
        victims = [(await store.offer(limits=batch, pool=p, request=request())).reservation for _ in range(2)]
        offer = await store.offer(limits=gold, pool=p, request=request())
        assert offer.decision.evict and offer.reservation is not None
        assert victims[1] is not None
        return evicted, offer.state, offer.started

    evicted, state, started = asyncio.run(scenario())
    # Newest dispatch first among equals, exactly one victim for one slot.
    assert len(evicted) == 1 and state == "running" and len(started) == 1


def test_a_waiter_is_started_by_a_release_or_expires_at_the_acquire_timeout() -> None:
    async def scenario() -> tuple[bool, bool, int]:
        store = MemoryStateStore(config=AdmissionConfig(wait_timeout_s=0.2))
        cheap = limits("cheap", "spot", concurrency=1)
        batch = limits("batch", concurrency=2)
        urgent = limits("urgent", concurrency=1, slo_target_ms=100.0)
        p = pool(cheap, batch, urgent, slots=1)
        holder = await store.offer(limits=cheap, pool=p, request=request())
        first = await store.offer(limits=batch, pool=p, request=request())
        assert holder.reservation is not None and first.reservation is not None and first.state == "waiting"

        async def release_soon() -> None:
            await asyncio.sleep(0.05)
            assert holder.reservation is not None
            await store.release(reservation=holder.reservation, prompt_tokens=5, completion_tokens=1)

        releaser = asyncio.create_task(release_soon())
        started = await store.wait(reservation=first.reservation, timeout_s=0.2)
        await releaser
        # A higher priority than the batch request now running: it waits, and nothing makes room.
        second = await store.offer(limits=urgent, pool=p, request=request())
        assert second.reservation is not None and second.state == "waiting"
        expired = await store.wait(reservation=second.reservation, timeout_s=0.2)
        usage = await store.entitlement_usage(limits=urgent, pool="p")
        return started, expired, usage.in_flight

    started, expired, in_flight = asyncio.run(scenario())
    assert started is True
    assert expired is False
    assert in_flight == 0  # the expired waiter holds nothing


def test_the_pool_follows_the_snapshot() -> None:
    async def scenario() -> tuple[str, bool, str]:
        store = MemoryStateStore(config=AdmissionConfig(wait_timeout_s=5.0))
        cheap = limits("cheap", "spot", concurrency=1)
        batch = limits("batch", concurrency=2)
        one_slot = pool(cheap, batch, slots=1)
        await store.offer(limits=cheap, pool=one_slot, request=request())
        waiting = await store.offer(limits=batch, pool=one_slot, request=request())
        assert waiting.reservation is not None and waiting.state == "waiting"
        # A replica comes back: the waiter starts at once.
        await store.sync_pool(pool=replace(one_slot, concurrency_capacity=2))
        started = await store.wait(reservation=waiting.reservation, timeout_s=1.0)
        # "batch" is deleted: its running request finishes, nothing new of it is admitted.
        without = replace(one_slot, concurrency_capacity=2, entitlements=(cheap,))
        await store.sync_pool(pool=without)
        refused = await store.offer(limits=store.ledger("p").limits("batch"), pool=without, request=request())  # type: ignore[union-attr,arg-type]
        finished = await store.release(reservation=waiting.reservation, prompt_tokens=5, completion_tokens=1)
        return refused.decision.reason, started, finished.outcome

    assert asyncio.run(scenario()) == ("entitlement_not_bound", True, "completed")
