"""Waiting is priority-ordered in the live gateway, as in the simulator: when the pool is full, a request
whose priority is above the admission threshold waits, and the next free slot goes to the highest priority
waiting, not to the one that came first. With the in-process store, and with Redis across two gateway
processes (the earlier, lower-priority request waiting in one, the later, higher-priority one in the other)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from apps.gateway.app import Gateway
from apps.gateway.redis_state import RedisStateStore
from apps.policy import AdmissionConfig
from tests.gateway.servers import ServerThread

BODY = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
ENTITLEMENTS = {
    "holder": {"service_class": "spot", "concurrency": 4},
    "relaxed": {"service_class": "elastic", "concurrency": 1, "slo_target_ms": 5000},
    "urgent": {"service_class": "elastic", "concurrency": 1, "slo_target_ms": 500},
}


def _order(h: Any, urls: dict[str, str]) -> list[str]:
    """Spot work takes the pool's 4 slots; `relaxed` then `urgent` arrive and wait; the backend's order of
    receipt after the spot requests end is the order they were started in."""
    upstream = h.upstreams[0]

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def send(name: str, **extra: Any) -> int:
                body = {**BODY, "messages": [{"role": "user", "content": name}], **extra}
                response = await client.post(urls[name] + "/v1/chat/completions", json=body,
                                             headers=h.auth(h.secrets[name]))
                return response.status_code

            holders = [asyncio.create_task(send("holder", max_tokens=20 + 5 * i)) for i in range(4)]
            while len(upstream.received) < 4:
                assert not any(h.done() for h in holders), "a spot request was not admitted"
                await asyncio.sleep(0.01)
            relaxed = asyncio.create_task(send("relaxed"))
            await asyncio.sleep(0.15)
            urgent = asyncio.create_task(send("urgent"))
            statuses = await asyncio.gather(*holders, relaxed, urgent)
            assert statuses == [200] * 6, statuses
        return [r["messages"][0]["content"] for r in upstream.received][3:]

    return asyncio.run(scenario())


def test_the_next_slot_goes_to_the_highest_priority_waiter(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory(token_delay_s=0.05)
    h = gateway_factory(upstreams=[upstream], pool={"slots_per_replica": 4}, entitlement={"concurrency": 1, "service_class": "elastic"},
                        extra_entitlements=ENTITLEMENTS,
                        config={"tokenize": False, "acquire_timeout_s": 10.0})
    assert _order(h, dict.fromkeys(ENTITLEMENTS, h.url)) == ["holder", "urgent", "relaxed"]


@pytest.mark.redis
def test_the_order_holds_across_gateway_processes_sharing_redis(gateway_factory: Any, upstream_factory: Any,
                                                                 redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}:"
    upstream, _ = upstream_factory(token_delay_s=0.05)
    waiting = AdmissionConfig(wait_timeout_s=10.0)
    h = gateway_factory(upstreams=[upstream], store=RedisStateStore(url=redis_url, prefix=prefix, config=waiting),
                        pool={"slots_per_replica": 4}, entitlement={"concurrency": 1, "service_class": "elastic"},
                        extra_entitlements=ENTITLEMENTS, config={"tokenize": False, "acquire_timeout_s": 10.0})
    # A second process: same snapshot, same Redis, its own memory; it hears the first one's releases.
    second = Gateway(config=h.gateway.config, snapshots=h.gateway.snapshots,
                     store=RedisStateStore(url=redis_url, prefix=prefix, config=waiting))
    server = ServerThread(second).start()
    try:
        urls = {"holder": h.url, "relaxed": h.url, "urgent": server.url}
        assert _order(h, urls) == ["holder", "urgent", "relaxed"]
    finally:
        server.call(second.stop())
        server.stop()
