"""The gateway's store view at scale: a pool of many entitlements is read a slice at a time, those with
requests in flight every time, the others keeping their last reading."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from apps.gateway import store_view
from apps.gateway.app import Gateway
from apps.gateway.memory_state import MemoryStateStore
from apps.policy import EntitlementLimits


def test_a_large_pool_is_read_a_slice_at_a_time_and_busy_entitlements_every_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_view, "STORE_VIEW_IDLE_READS", 2)
    loops = Gateway(store=MemoryStateStore()).loops
    pool = SimpleNamespace(name="p", entitlements=[
        EntitlementLimits(entitlement_id=f"e{i}", service_class="spot") for i in range(5)])

    def read(busy: set[str]) -> set[str]:
        return {limits.entitlement_id for limits in loops.view.entitlements_to_read(pool, dict.fromkeys(busy, 1))}

    assert read(set()) == {"e0", "e1"}
    assert read(set()) == {"e2", "e3"}
    assert read({"e2"}) == {"e4", "e0", "e2"}  # e4 and (wrapping) e0 are the slice; e2 is busy
    assert read({"e3"}) == {"e1", "e2", "e3"}


def test_the_store_view_keeps_the_last_reading_of_entitlements_it_does_not_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_view, "STORE_VIEW_IDLE_READS", 2)
    monkeypatch.setattr(store_view, "STORE_VIEW_READS_PER_TURN", 1)
    gateway = Gateway(store=MemoryStateStore())
    pool = SimpleNamespace(name="p", mean_slo_ms=1000.0, entitlements=[
        EntitlementLimits(entitlement_id=f"e{i}", service_class="spot") for i in range(5)])
    snapshot = SimpleNamespace(pools={"p": pool}, keys={})
    monkeypatch.setattr(gateway.snapshots, "current", snapshot)
    seen: list[set[str]] = []
    for _ in range(3):
        asyncio.run(gateway.loops.store_view())
        seen.append({key[1] for key in gateway.loops.view.dynamics})
    assert seen == [{"e0", "e1"}, {"e0", "e1", "e2", "e3"}, {f"e{i}" for i in range(5)}]
    pool.entitlements = pool.entitlements[1:]  # a new snapshot without e0: its reading goes
    monkeypatch.setattr(gateway.snapshots, "current", SimpleNamespace(pools={"p": pool}, keys={}))
    asyncio.run(gateway.loops.store_view())
    assert {key[1] for key in gateway.loops.view.dynamics} == {f"e{i}" for i in range(1, 5)}


def test_the_in_flight_view_counts_the_busy_entitlements_and_lists_the_others_at_zero(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store is asked for its busy entitlements only; every entitlement of the snapshot is listed, at 0 when
    it holds nothing, so that a gauge falls to 0 rather than vanishes."""
    from apps.gateway.snapshot import PoolInfo
    from apps.policy import AdmissionRequest

    store = MemoryStateStore()
    gateway = Gateway(store=store)
    entitlements = tuple(EntitlementLimits(entitlement_id=f"e{i}", service_class="spot", concurrency=2)
                         for i in range(3))
    pool = PoolInfo(name="p", model_name="m", replica_urls=("http://x",), concurrency_capacity=4, kv_capacity=1e12,
                    kv_bytes_per_token=0, context_window=4096, entitlements=entitlements)
    monkeypatch.setattr(gateway.snapshots, "current", SimpleNamespace(pools={"p": pool}, keys={}))

    async def run() -> list[dict[tuple[str, ...], float]]:
        await store.sync_pool(pool=pool)
        views = []
        offer = await store.offer(limits=entitlements[1], pool=pool,
                                  request=AdmissionRequest("r1", input_tokens=5, max_tokens=5))
        await gateway.loops.store_view()
        views.append(dict(gateway.loops.view.in_flight))
        assert offer.reservation is not None
        await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=5)
        await gateway.loops.store_view()
        views.append(dict(gateway.loops.view.in_flight))
        return views

    busy, after = asyncio.run(run())
    assert busy == {("p", "e0"): 0.0, ("p", "e1"): 1.0, ("p", "e2"): 0.0}
    assert after == {("p", "e0"): 0.0, ("p", "e1"): 0.0, ("p", "e2"): 0.0}
    assert {key[1] for key in gateway.loops.view.dynamics} == {"e0", "e1", "e2"}


def test_a_store_view_cut_short_by_an_outage_leaves_the_last_whole_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """The view is applied in place once every pool was read: a store that goes away halfway changes nothing
    (neither pool's counts go to 0), and the first view after it is whole again."""
    from apps.gateway.snapshot import PoolInfo
    from apps.gateway.state import StateStoreUnavailable
    from apps.policy import AdmissionRequest

    class FailingSecondPool(MemoryStateStore):
        failing = False

        async def in_flight(self, *, pool: PoolInfo) -> dict[str, int]:
            if self.failing and pool.name == "q":
                raise StateStoreUnavailable("away")
            return await super().in_flight(pool=pool)

    store = FailingSecondPool()
    gateway = Gateway(store=store)
    limits = {name: EntitlementLimits(entitlement_id=name, service_class="spot", concurrency=2) for name in "ab"}
    pools = {name: PoolInfo(name=name, model_name=name, replica_urls=("http://x",), concurrency_capacity=4,
                            kv_capacity=1e12, kv_bytes_per_token=0, context_window=4096, entitlements=(limits[ent],))
             for name, ent in (("p", "a"), ("q", "b"))}
    monkeypatch.setattr(gateway.snapshots, "current", SimpleNamespace(pools=pools, keys={}))

    async def run() -> list[dict[tuple[str, ...], float]]:
        offers = []
        for name, ent in (("p", "a"), ("q", "b")):
            await store.sync_pool(pool=pools[name])
            offers.append(await store.offer(limits=limits[ent], pool=pools[name],
                                            request=AdmissionRequest(f"r-{name}", input_tokens=5, max_tokens=5)))
        views = []
        await gateway.loops.store_view()
        views.append(dict(gateway.loops.view.in_flight))
        for offer in offers:
            assert offer.reservation is not None
            await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=5)
        store.failing = True
        await gateway.loops.store_view()  # p is read (now idle), then q fails: nothing is applied
        views.append(dict(gateway.loops.view.in_flight))
        store.failing = False
        await gateway.loops.store_view()
        views.append(dict(gateway.loops.view.in_flight))
        return views

    busy, cut_short, whole = asyncio.run(run())
    assert busy == cut_short == {("p", "a"): 1.0, ("q", "b"): 1.0}
    assert whole == {("p", "a"): 0.0, ("q", "b"): 0.0}
