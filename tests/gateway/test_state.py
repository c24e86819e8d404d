"""The in-process state store: reservations, refunds, idempotent release, the pool view the policy sees."""

from __future__ import annotations

import asyncio
import uuid

from apps.gateway.snapshot import PoolInfo
from apps.gateway.state import MemoryStateStore
from apps.policy import AdmissionRequest, EntitlementLimits


def limits(name: str, service_class: str = "elastic", **overrides: object) -> EntitlementLimits:
    fields: dict[str, object] = {"service_class": service_class, "concurrency": 2, "tokens_per_second": 10.0,
                                 "token_bucket_seconds": 10.0, "kv_bytes_per_token": 1.0}
    fields.update(overrides)
    return EntitlementLimits(entitlement_id=name, **fields)  # type: ignore[arg-type]


def pool(slots: int = 4, reserved: tuple[tuple[str, int, float], ...] = ()) -> PoolInfo:
    return PoolInfo(name="p", model_name="m", replica_urls=("http://x",), concurrency_capacity=slots,
                    kv_capacity=1e9, kv_bytes_per_token=1, context_window=4096, reserved=reserved)


def request(max_tokens: int = 10) -> AdmissionRequest:
    return AdmissionRequest(uuid.uuid4().hex, input_tokens=5, max_tokens=max_tokens)


def test_admit_charges_release_refunds_once() -> None:
    async def scenario() -> None:
        store = MemoryStateStore(clock=lambda: 0.0)
        ent = limits("e")
        result = await store.admit(limits=ent, pool=pool(), request=request(max_tokens=40))
        assert result.reservation is not None
        assert result.view.remaining_tokens == 100 - 45
        assert result.view.remaining_requests == 1
        usage = await store.entitlement_usage(limits=ent)
        assert (usage.in_flight, usage.kv_bytes_in_flight) == (1, 45.0)
        assert await store.release(reservation=result.reservation, prompt_tokens=5, completion_tokens=10)
        assert not await store.release(reservation=result.reservation, prompt_tokens=5, completion_tokens=10)
        usage = await store.entitlement_usage(limits=ent)
        assert (usage.in_flight, usage.kv_bytes_in_flight, usage.tokens_available) == (0, 0.0, 85.0)
        assert await store.pool_running(pool="p") == 0
        served = await store.served_drain(entitlement="e")
        assert (served.tokens, served.requests) == (15, 1)

    asyncio.run(scenario())


def test_idle_reservations_of_guaranteed_entitlements_are_withheld_from_elastic() -> None:
    async def scenario() -> list[str]:
        store = MemoryStateStore(clock=lambda: 0.0)
        # 4 slots, 3 of them reserved by an idle guaranteed entitlement: elastic gets one.
        p = pool(slots=4, reserved=(("gold", 3, 1e6),))
        ent = limits("e", concurrency=4, tokens_per_second=1000.0)
        outcomes = [(await store.admit(limits=ent, pool=p, request=request())).decision.reason for _ in range(2)]
        gold = limits("gold", "guaranteed", concurrency=3, tokens_per_second=1000.0)
        outcomes.append((await store.admit(limits=gold, pool=p, request=request())).decision.reason)
        return outcomes

    first, second, gold = asyncio.run(scenario())
    assert first == "admitted"
    assert second in {"queued", "pool_contended"}  # the pool's free room is reserved for "gold"
    assert gold == "admitted"


def test_evictable_work_is_visible_to_the_policy_and_eviction_is_offered() -> None:
    async def scenario() -> tuple[bool, bool]:
        store = MemoryStateStore(clock=lambda: 0.0)
        p = pool(slots=2)
        batch = limits("batch", "preemptible", concurrency=2, tokens_per_second=1000.0, slo_target_ms=5000.0)
        for _ in range(2):
            assert (await store.admit(limits=batch, pool=p, request=request())).reservation is not None
        gold = limits("gold", "guaranteed", concurrency=1, tokens_per_second=1000.0)
        decision = (await store.admit(limits=gold, pool=p, request=request())).decision
        return decision.queued, decision.evict

    assert asyncio.run(scenario()) == (True, True)


def test_rejections_count_unmet_demand() -> None:
    async def scenario() -> tuple[int, int]:
        store = MemoryStateStore()
        await store.record_rejection(entitlement="e", token_cost=30)
        drained = await store.served_drain(entitlement="e")
        return drained.rejected, drained.demand_tokens

    assert asyncio.run(scenario()) == (1, 30)
