"""The key/entitlement snapshot: built from the ORM off the request path, refreshed when data changes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from apps.gateway.config import GatewayConfig
from apps.gateway.snapshot import EntitlementIndex, SnapshotCache, snapshot_load
from apps.policy import EntitlementLimits
from apps.pools.services import entitlement_update
from apps.tenancy.services import apikey_create, apikey_revoke
from tests.pools.factories import make_entitlement, make_pool

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def bound_key(admin: Any, acme: Any) -> tuple[Any, str]:
    pool = make_pool(admin, name="tiny", model_name="tiny-model", tokens_per_second_per_replica=100_000,
                     replicas=[{"url": "http://127.0.0.1:9"}])
    ent = make_entitlement(admin, acme, pool, "acme-chat", tokens_per_second=1000, concurrency=4)
    key, secret = apikey_create(actor=admin, entitlement=ent)
    return key, secret


@pytest.mark.django_db
def test_snapshot_maps_key_hash_to_limits_and_pool(bound_key: tuple[Any, str]) -> None:
    key, secret = bound_key
    snapshot = snapshot_load(config=GatewayConfig(default_max_tokens=99))
    entry = snapshot.key_for(secret, time.time())
    assert entry is not None
    assert entry.limits.entitlement_id == "acme-chat"
    assert entry.limits.concurrency == 4
    assert entry.limits.default_max_tokens == 99
    assert str(entry.limits.state) == "bound"
    assert entry.pool_name == "tiny"
    pool = snapshot.pools["tiny"]
    assert pool.concurrency_capacity == 16
    assert pool.reserved == (("acme-chat", 4, float(2 * 1024**3)),)
    assert snapshot.pool_for_model("tiny-model") is pool
    assert snapshot.key_for(secret + "x", time.time()) is None


@pytest.mark.django_db(transaction=True)
def test_refresh_reloads_only_when_the_marker_moves(bound_key: tuple[Any, str], admin: Any) -> None:
    key, secret = bound_key

    async def scenario() -> list[bool]:
        cache = SnapshotCache(config=GatewayConfig())
        try:
            first = await cache.refresh()
            unchanged = await cache.refresh()
            await asyncio.get_running_loop().run_in_executor(None, lambda: apikey_revoke(actor=admin, key=key))
            changed = await cache.refresh()
            gone = cache.current is not None and cache.current.key_for(secret, time.time()) is None
            return [first, unchanged, changed, gone]
        finally:
            cache.close()

    assert asyncio.run(scenario()) == [True, False, True, True]


@pytest.mark.django_db(transaction=True)
def test_revoked_key_and_changed_entitlement_take_effect_on_a_running_gateway(
    admin: Any, acme: Any, upstream_factory: Any
) -> None:
    from apps.gateway.app import Gateway
    from apps.gateway.memory_state import MemoryStateStore
    from tests.gateway.servers import ServerThread

    upstream, _ = upstream_factory()
    pool = make_pool(admin, name="tiny", model_name="tiny-model", tokens_per_second_per_replica=100_000,
                     replicas=[{"url": upstream.url}])
    ent = make_entitlement(admin, acme, pool, "acme-chat", tokens_per_second=1000, concurrency=4)
    key, secret = apikey_create(actor=admin, entitlement=ent)
    config = GatewayConfig(snapshot_poll_s=0.1, tokenize=False, aimd_tick_s=60, health_interval_s=60,
                           usage_flush_s=60)
    gateway = Gateway(config=config, store=MemoryStateStore())
    server = ServerThread(gateway).start()
    try:
        auth = {"Authorization": f"Bearer {secret}"}
        first = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers=auth)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-requests"] == "4"

        entitlement_update(actor=admin, entitlement=ent, concurrency=3)
        assert _eventually(lambda: httpx.post(server.url + "/v1/chat/completions", json=BODY, headers=auth)
                           .headers.get("x-ratelimit-limit-requests") == "3")

        apikey_revoke(actor=admin, key=key)
        assert _eventually(lambda: httpx.post(server.url + "/v1/chat/completions", json=BODY,
                                              headers=auth).status_code == 401)
    finally:
        server.call(gateway.stop())
        server.stop()


def _eventually(check: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.django_db
def test_key_and_entitlement_expiry_are_judged_per_request(admin: Any, acme: Any) -> None:
    import datetime as dt

    from django.utils import timezone

    pool = make_pool(admin, name="tiny", tokens_per_second_per_replica=100_000, replicas=[{"url": "http://127.0.0.1:9"}])
    soon = timezone.now() + dt.timedelta(hours=1)
    ent = make_entitlement(admin, acme, pool, "acme-chat", tokens_per_second=1000, expires_at=soon)
    _, secret = apikey_create(actor=admin, entitlement=ent, expires_at=soon + dt.timedelta(hours=1))
    snapshot = snapshot_load(config=GatewayConfig())
    now = time.time()
    entry = snapshot.key_for(secret, now)
    assert entry is not None
    assert str(entry.limits_at(now).state) == "bound"
    later = soon.timestamp() + 1
    assert str(entry.limits_at(later).state) == "expired"  # before any tick marks it Expired
    assert snapshot.key_for(secret, soon.timestamp() + 3601) is None


@pytest.mark.django_db
def test_the_entitlements_queue_reaches_the_policy_and_blank_takes_the_class_default(
        bound_key: tuple[Any, str], admin: Any) -> None:
    key, secret = bound_key
    config = GatewayConfig()

    def entry() -> Any:
        found = snapshot_load(config=config).key_for(secret, time.time())
        assert found is not None
        return found

    blank = entry()
    assert (blank.limits.queue_max, blank.limits.queue_max_wait_ms) == (None, None)
    assert (blank.limits.own_queue_max, blank.limits.own_queue_wait_s) == (8, 1.0)  # guaranteed's default
    entitlement_update(actor=admin, entitlement=key.entitlement, queue_max=0, queue_max_wait_ms=250)
    none = entry()
    assert (none.limits.queue_max, none.limits.queue_max_wait_ms) == (0, 250.0)
    assert (none.limits.own_queue_max, none.limits.own_queue_wait_s) == (0, 0.25)
    assert snapshot_load(config=config).pools["tiny"].entitlements[0].own_queue_max == 0  # the pool's view too
    entitlement_update(actor=admin, entitlement=key.entitlement, queue_max=3)
    assert entry().limits.own_queue_max == 3


def test_entitlement_index_is_built_again_only_for_a_new_sequence_of_the_pool_s_entitlements() -> None:
    index = EntitlementIndex()
    first = (EntitlementLimits("a", service_class="spot"), EntitlementLimits("b", service_class="guaranteed"))
    by_id = index.of("tiny", first)
    assert {name: limits.service_class.value for name, limits in by_id.items()} == {"a": "spot", "b": "guaranteed"}
    assert index.of("tiny", first) is by_id  # the same snapshot's sequence: not built again
    assert index.of("other", ()) == {}  # pools are kept apart
    second = (EntitlementLimits("c", service_class="elastic"),)
    assert list(index.of("tiny", second)) == ["c"]  # a new snapshot's sequence: built again
