"""Offers decided on a snapshot kept from the last reply (apps.gateway.redis_snapshot), on a real Redis: one
call instead of two when nothing changed, and the decision READ's snapshot would give whenever something did
(another process took room or freed it, a tick moved the debt, the bucket's limits shrank, the id is a
duplicate). That the outcomes are the ledger's in every scenario is tests/conformance's job; these are the
cases where a kept snapshot is out of date."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.redis_snapshot import MARK, KeptSnapshots, fingerprint
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.snapshot import PoolInfo
from apps.policy import AdmissionRequest, EntitlementLimits
from tests.gateway.test_redis_state import limits, pool, request
from tests.gateway.test_redis_state import with_stores as with_stores_of

pytestmark = pytest.mark.redis


class CountingStore(RedisStateStore):
    """The Redis store, counting its script calls by name."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: Counter[str] = Counter()
        self.shortcuts: list[int] = []  # per committed COMMIT: 1 when the change mark confirmed a kept snapshot

    async def _call(self, name: str, keys: list[str], args: Any) -> Any:
        self.calls[name] += 1
        raw = await super()._call(name, keys, args)
        if name == "commit" and int(raw[0]) == 1:
            self.shortcuts.append(int(raw[6]))
        return raw


def with_stores(redis_url: str, count: int, body: Any) -> Any:
    return with_stores_of(redis_url, count, body, store_class=CountingStore)


async def served_once(store: CountingStore, ent: EntitlementLimits, p: PoolInfo) -> None:
    """The pool synced, one request of `ent` offered and released: the store keeps the snapshot after it."""
    await store.sync_pool(pool=p)
    offer = await store.offer(limits=ent, pool=p, request=request())
    assert offer.reservation is not None
    await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=10)


def test_an_offer_after_a_reply_about_its_entitlement_is_one_call(redis_url: str) -> None:
    async def body(store: CountingStore) -> list[Counter[str]]:
        ent = limits("e")
        p = pool("p", 100, ent)
        await store.sync_pool(pool=p)
        seen = []
        for _ in range(3):
            store.calls.clear()
            offer = await store.offer(limits=ent, pool=p, request=request())
            assert offer.state == "running" and offer.reservation is not None
            seen.append(Counter(store.calls))
            await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=10)
        return seen

    first, second, third = with_stores(redis_url, 1, body)
    assert first == Counter(read=1, commit=1)  # nothing kept yet
    assert second == third == Counter(commit=1)


def test_an_offer_right_after_a_begun_release_decides_on_that_release_s_snapshot(redis_url: str) -> None:
    """The end of an answer does not wait for the release's reply (apps.gateway.account): a client's next
    request may come before it. Its offer waits for that reply rather than decide on the snapshot kept from
    before the release, which COMMIT would turn down (a second call)."""
    async def body(store: CountingStore) -> list[Counter[str]]:
        ent = limits("e", concurrency=1)
        p = pool("p", 100, ent)
        await store.sync_pool(pool=p)
        offer = await store.offer(limits=ent, pool=p, request=request())
        seen = []
        for _ in range(3):
            assert offer.reservation is not None
            release = asyncio.ensure_future(store.release(reservation=offer.reservation, prompt_tokens=5,
                                                          completion_tokens=10))
            await asyncio.sleep(0)  # begun, as the account step leaves it
            store.calls.clear()
            offer = await store.offer(limits=ent, pool=p, request=request())
            assert offer.state == "running"
            seen.append(Counter(store.calls))
            await release
        return seen

    assert with_stores(redis_url, 1, body) == [Counter(commit=1)] * 3


def test_concurrent_starts_on_a_kept_snapshot_wait_for_no_one(redis_url: str) -> None:
    """Offers of one process that start on the snapshot it kept do not wait for each other's replies: each sends
    its COMMIT at once, and COMMIT confirms the start where `admit` would take it now (`still_admitted`), though
    the others' starts moved the snapshot: one call each."""
    async def body(store: CountingStore) -> tuple[Counter[str], list[int]]:
        ent = limits("e", concurrency=10)
        p = pool("p", 100, ent)
        await served_once(store, ent, p)
        store.calls.clear()
        store.shortcuts.clear()
        offers = await asyncio.gather(*(store.offer(limits=ent, pool=p, request=request()) for _ in range(4)))
        assert [offer.state for offer in offers] == ["running"] * 4
        return Counter(store.calls), store.shortcuts

    calls, shortcuts = with_stores(redis_url, 1, body)
    # The first found the kept snapshot's mark standing; the others' marks had moved, their starts still stood.
    assert calls == Counter(commit=4), calls
    assert shortcuts == [1, 2, 2, 2], shortcuts


def test_concurrent_starts_on_a_kept_snapshot_stop_at_the_limit_as_the_ledger_does(redis_url: str) -> None:
    """Six concurrent offers decided on one kept snapshot with room for all, against a concurrency of 3: the
    fourth's start no longer stands when it reaches Redis, and it is decided again on READ's snapshot. The
    outcomes are the in-process store's for the same offers."""
    def outcome(offers: list[Any]) -> list[tuple[str, str]]:
        return sorted((offer.state, offer.decision.reason) for offer in offers)

    ent = limits("e", concurrency=3)  # guaranteed: no burst beyond it
    p = pool("p", 100, ent)

    async def body(store: CountingStore) -> tuple[list[tuple[str, str]], list[int]]:
        await served_once(store, ent, p)
        store.shortcuts.clear()
        offers = await asyncio.gather(*(store.offer(limits=ent, pool=p, request=request()) for _ in range(6)))
        return outcome(offers), store.shortcuts

    async def in_process() -> list[tuple[str, str]]:
        store = MemoryStateStore()
        await served_once(store, ent, p)  # type: ignore[arg-type]
        return outcome([await store.offer(limits=ent, pool=p, request=request()) for _ in range(6)])

    on_redis, shortcuts = with_stores(redis_url, 1, body)
    assert on_redis == asyncio.run(in_process())
    assert sorted(state for state, _ in on_redis) == ["rejected"] * 3 + ["running"] * 3
    assert shortcuts == [1, 2, 2], shortcuts


def test_a_kept_snapshot_whose_mark_stands_is_not_read_again(redis_url: str) -> None:
    async def body(store: CountingStore, other: CountingStore) -> list[int]:
        ent, quiet = limits("e"), limits("quiet")
        p = pool("p", 100, ent, quiet)
        await store.sync_pool(pool=p)
        for _ in range(3):
            offer = await store.offer(limits=ent, pool=p, request=request())
            assert offer.reservation is not None
            await store.release(reservation=offer.reservation, prompt_tokens=5, completion_tokens=10)
        # Another process writes to the pool (another entitlement's request): the mark moves, so the next start
        # on the kept snapshot stands by what `admit` would decide now (`still_admitted`), not by the mark.
        held = await other.offer(limits=quiet, pool=p, request=request())
        assert held.reservation is not None
        await other.release(reservation=held.reservation, prompt_tokens=5, completion_tokens=10)
        offer = await store.offer(limits=ent, pool=p, request=request())
        assert offer.state == "running"
        return store.shortcuts

    # READ's snapshot first, then the one from each RELEASE's reply: the mark each carries stands.
    assert with_stores(redis_url, 2, body) == [1, 1, 1, 2]


def test_a_mark_is_new_after_the_pool_s_keys_are_lost(redis_url: str) -> None:
    """A Redis restarted without its data (or a failover that lost the last writes) starts its counter again:
    the mark carries Redis's time too, so no later mark equals one kept from before."""
    async def body(store: CountingStore, other: CountingStore) -> tuple[str, str, list[int]]:
        ent = limits("e", concurrency=1)
        p = pool("p", 100, ent)
        await served_once(store, ent, p)
        kept = store._kept.get("p", "e")
        assert kept is not None
        base = store._base("p")
        await store.redis.delete(*[key async for key in store.redis.scan_iter(match=base + "*")])  # all lost
        await other.sync_pool(pool=p)
        taken = await other.offer(limits=ent, pool=p, request=request())  # the entitlement's one slot
        assert taken.state == "running"
        # The counter brought to the kept mark's own by the next save (a refusal counted).
        await store.redis.set(base + "marks", int(kept[MARK].split(".")[-1]) - 1)
        refused = await other.offer(limits=ent, pool=p, request=request())
        assert refused.state == "rejected"
        assert str(await store.redis.get(base + "marks")) == kept[MARK].split(".")[-1]
        late = await store.offer(limits=ent, pool=p, request=request())
        assert late.state == "rejected"  # the kept snapshot (nothing in flight) is not taken for the truth
        return kept[MARK], str(await store.redis.get(base + "mark")), store.shortcuts

    kept_mark, mark_now, shortcuts = with_stores(redis_url, 2, body)
    assert kept_mark and mark_now and kept_mark != mark_now
    assert shortcuts == [1]  # the first start, on READ's snapshot; the late offer started nothing


def test_room_another_process_took_meanwhile_is_seen(redis_url: str) -> None:
    async def body(first: CountingStore, second: CountingStore) -> tuple[str, str | None, Counter[str]]:
        ent = limits("e", concurrency=1)
        p = pool("p", 100, ent)
        await first.sync_pool(pool=p)
        done = await first.offer(limits=ent, pool=p, request=request())
        assert done.reservation is not None
        await first.release(reservation=done.reservation, prompt_tokens=5, completion_tokens=10)  # keeps 0 of 1
        taken = await second.offer(limits=ent, pool=p, request=request())  # the entitlement's one slot
        assert taken.state == "running"
        first.calls.clear()
        late = await first.offer(limits=ent, pool=p, request=request())
        return late.state, late.decision.reason, Counter(first.calls)

    state, reason, calls = with_stores(redis_url, 2, body)
    assert (state, reason) == ("rejected", "concurrency_limit_exceeded")
    # The kept snapshot (0 in flight of 1) started it; COMMIT refused that and brought READ's snapshot (1 of 1),
    # on which it was refused (and the refusal counted in the demand window): no READ of its own.
    assert calls == Counter(commit=1, refuse=1)


def test_room_another_process_freed_meanwhile_is_seen(redis_url: str) -> None:
    async def body(first: CountingStore, second: CountingStore) -> str:
        ent = limits("e", concurrency=1)
        p = pool("p", 100, ent)
        await first.sync_pool(pool=p)
        held = await first.offer(limits=ent, pool=p, request=request())
        assert held.reservation is not None
        # first keeps READ's snapshot of a refusal: at the limit
        assert (await first.offer(limits=ent, pool=p, request=request())).state == "rejected"
        await second.release(reservation=held.reservation, prompt_tokens=5, completion_tokens=10)
        # A release moves no version: only the kept snapshot's refusal sends this offer back to READ.
        return (await first.offer(limits=ent, pool=p, request=request())).state

    assert with_stores(redis_url, 2, body) == "running"


def test_a_tick_that_moved_the_debt_meanwhile_sets_the_priority(redis_url: str) -> None:
    async def body(first: CountingStore, second: CountingStore, fresh: CountingStore) -> tuple[float, ...]:
        ent = limits("e")
        p = pool("p", 100, ent)
        await first.sync_pool(pool=p)
        before = await first.offer(limits=ent, pool=p, request=request())
        assert before.reservation is not None
        await first.release(reservation=before.reservation, prompt_tokens=5, completion_tokens=10)
        # Another process's EWMA tick writes a debt (the DYNAMICS transition the tick ends with).
        await second._call("dynamics", [second._base("p")], ["e", "40.0", "0.0"])
        after = await first.offer(limits=ent, pool=p, request=request())
        read = await fresh.offer(limits=ent, pool=p, request=request())  # decided on READ's snapshot
        assert after.reservation is not None and read.reservation is not None
        return before.reservation.priority, after.reservation.priority, read.reservation.priority

    before, after, read = with_stores(redis_url, 3, body)
    assert after == read != before


def test_a_bucket_shrunk_below_the_charge_is_seen(redis_url: str) -> None:
    async def body(store: CountingStore) -> tuple[str, str | None]:
        wide = limits("e", tokens_per_second=1.0, token_bucket_seconds=100.0)  # 100 tokens
        p = pool("p", 100, wide)
        await store.sync_pool(pool=p)
        first = await store.offer(limits=wide, pool=p, request=request())  # 15 tokens, all used: 85 left
        assert first.reservation is not None
        await store.release(reservation=first.reservation, prompt_tokens=5, completion_tokens=10)  # kept: 85
        narrow = limits("e", tokens_per_second=1.0, token_bucket_seconds=10.0)  # 10 tokens: under a charge
        store.calls.clear()
        offer = await store.offer(limits=narrow, pool=pool("p", 100, narrow), request=request())
        assert store.calls["commit"] == 1 and store.calls["read"] == 0  # refused on what COMMIT brought back
        return offer.state, offer.decision.reason

    assert with_stores(redis_url, 1, body) == ("rejected", "rate_limit_exceeded")


def test_a_duplicate_id_is_refused_on_a_kept_snapshot_too(redis_url: str) -> None:
    async def body(store: CountingStore) -> tuple[str, str | None, int]:
        ent = limits("e")
        p = pool("p", 100, ent)
        await store.sync_pool(pool=p)
        offered = AdmissionRequest("same-id", input_tokens=5, max_tokens=10)
        assert (await store.offer(limits=ent, pool=p, request=offered)).state == "running"
        other = await store.offer(limits=ent, pool=p, request=request())
        assert other.reservation is not None
        await store.release(reservation=other.reservation, prompt_tokens=5, completion_tokens=10)  # kept
        store.calls.clear()
        again = await store.offer(limits=ent, pool=p, request=offered)
        assert store.calls == Counter(commit=1)  # on the kept snapshot; COMMIT saw the id in flight
        in_flight = (await store.entitlement_usage(limits=ent, pool="p")).in_flight
        return again.state, again.decision.reason, in_flight

    assert with_stores(redis_url, 1, body) == ("rejected", "invalid_request", 1)


def test_kept_snapshots_are_bounded_and_forgotten_with_their_pool() -> None:
    kept = KeptSnapshots(limit=2)
    kept.keep("p", "a", "1 2")
    kept.keep("q", "b", "3 4")
    assert kept.get("p", "a") == ["1", "2"]
    kept.forget("p")
    assert kept.get("p", "a") is None and kept.get("q", "b") == ["3", "4"]
    kept.keep("q", "c", "5 6")
    kept.keep("q", "d", "7 8")  # a third entry: the bound starts the shortcuts again
    assert kept.get("q", "b") is None and kept.get("q", "d") == ["7", "8"]
    kept.keep("q", "e", "")  # nothing to keep
    assert kept.get("q", "e") is None


def test_a_fingerprint_leaves_out_the_level_the_oldest_start_the_duplicate_flag_and_the_mark() -> None:
    fields = [str(i) for i in range(21)]
    changed = list(fields)
    changed[4], changed[17], changed[19], changed[20] = "99", "98", "1", "96"
    assert fingerprint(fields) == fingerprint(changed)
    changed[5] = "97"  # the debt
    assert fingerprint(fields) != fingerprint(changed)
