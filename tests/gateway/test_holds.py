"""Every hold is settled (issue 22): clients that leave at any moment (while their tokens are counted, while
they are offered, before the upstream answers, mid-answer) and a store that stalls longer than its socket
timeout leave nothing reserved once a lease has passed: no quota reserved, nothing in flight, no KV bytes,
nothing queued. A client that leaves before the first byte makes the gateway cancel the upstream request.
On the in-process store and on Redis; the lease is kept short (GATEWAY_LEASE_S) so that a test waits one."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
import uuid
from typing import Any

import pytest

from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.state import GatewayStateStore
from tests.gateway.upstream import prompt_tokens_of
from tests.support.services import PrivateRedis

pytestmark = [pytest.mark.django_db]

LEASE_S = 1.0
CONFIG = {"lease_s": LEASE_S, "lease_renew_s": 0.3, "tokenize": True}
BODY = {"model": "tiny-model", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 400}
QUOTA = {"quota_tokens": 100_000, "quota_window": "day", "concurrency": 64}
POOL = {"slots_per_replica": 64}
# The delays, and one long enough (on this 2-core machine a burst of 60 takes ~300 ms to reach the
# backend) that clients leave while their requests wait for the first byte or stream.
LEAVE_AFTER_MS = (0, 1, 5, 10, 50, 400)
PER_DELAY = 60
# What the test backend reports as the prompt (3 words and the chat template's 2): a served request is charged
# this plus what it produced.
PROMPT_TOKENS = prompt_tokens_of(BODY)


def _store(kind: str, request: pytest.FixtureRequest, **options: Any) -> GatewayStateStore | None:
    if kind == "memory":
        return None
    url = request.getfixturevalue("redis_url")
    return RedisStateStore(url=url, prefix=f"t{uuid.uuid4().hex}:", lease_s=LEASE_S, **options)


def _raw_request(secret: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + secret.encode() + b"\r\nContent-Length: " + str(len(data)).encode()
            + b"\r\n\r\n" + data)


async def _send_and_leave(port: int, payload: bytes, after_s: float, wait: Any = None) -> None:
    """Send a whole request, then close the connection `after_s` later (or once `wait()` returns) without
    reading the answer."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    await asyncio.sleep(after_s)
    if wait is not None:
        await wait()
    writer.close()


async def _held(gateway: Any) -> dict[str, float]:
    """What the store holds for the entitlement: quota reserved (and used), in flight, KV, queued requests."""
    store = gateway.store
    snapshot = gateway.snapshots.current
    entry = next(iter(snapshot.keys.values()))
    usage = await store.entitlement_usage(limits=entry.limits, pool=entry.pool_name)
    charges = [rule.charge_at(dt.datetime.now(dt.UTC)) for rule in entry.quotas]
    standings = await store.quota_standings(scope=str(entry.tenant_id), charges=charges)
    held = {"quota_reserved": sum(s.reserved for s in standings), "quota_used": sum(s.used for s in standings),
            "in_flight": usage.in_flight, "kv_bytes": usage.kv_bytes_in_flight,
            "process_in_flight": sum(1 for _ in gateway.in_flight.contexts()),
            "pending_releases": len(gateway.accountant.pending)}
    if isinstance(store, RedisStateStore):
        held["queued"] = int(float((await store.record_fields(pool=entry.pool_name, field="queued",
                                                              records=["pool"]))[0] or 0))
        holds = await store.redis.hkeys(store._quotas.key(str(entry.tenant_id)))
        held["quota_holds"] = sum(1 for key in holds if key.startswith("h:"))
    return held


def _settled(h: Any, within_s: float) -> dict[str, float]:
    deadline = time.monotonic() + within_s
    while True:
        held = h.server.call(_held(h.gateway))
        if all(value == 0 for key, value in held.items() if key != "quota_used"):
            return held
        assert time.monotonic() < deadline, f"still held after {within_s:g} s: {held}"
        time.sleep(0.1)


@pytest.mark.parametrize("kind", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_clients_that_leave_at_any_moment_leave_nothing_held(
    kind: str, request: pytest.FixtureRequest, gateway_factory: Any, upstream_factory: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Answers take 300 ms to start and 10 ms a token: clients leave while counted, offered, before the first
    # byte and mid-answer.
    upstream, _ = upstream_factory(first_token_delay_s=0.3, token_delay_s=0.01, max_output=20)
    h = gateway_factory(upstreams=[upstream], store=_store(kind, request), entitlement=QUOTA,
                        pool=POOL, config=CONFIG)
    payload = _raw_request(h.secret, BODY)

    async def attack() -> None:
        for after_ms in LEAVE_AFTER_MS:
            await asyncio.gather(*(_send_and_leave(h.server.port, payload, after_ms / 1000)
                                   for _ in range(PER_DELAY)))
        # And a group that leaves once the backend has some of its requests (however loaded the machine).
        at_backend = len(upstream.received)

        async def reached() -> None:
            deadline = time.monotonic() + 10
            while len(upstream.received) == at_backend and time.monotonic() < deadline:
                await asyncio.sleep(0.01)

        await asyncio.gather(*(_send_and_leave(h.server.port, payload, 0.0, wait=reached)
                               for _ in range(PER_DELAY)))

    started = time.monotonic()
    asyncio.run(attack())
    held = _settled(h, within_s=LEASE_S + 5.0)
    elapsed = time.monotonic() - started
    reached = len(upstream.received)
    with capsys.disabled():
        print(f"\n[{kind}] {PER_DELAY * (len(LEAVE_AFTER_MS) + 1)} requests, clients closing {LEAVE_AFTER_MS} ms "
              f"after sending, and once the backend had some: {reached} reached the backend, {upstream.cancelled} cancelled there; after "
              f"{elapsed:.2f} s held: {held}")
    assert reached > 0, "no client stayed long enough to reach the backend: the test proves nothing"
    # What was charged is at most what reached a backend (its prompt + 20 produced at most): nothing reserved
    # for requests that never ran stays counted as used.
    assert held["quota_used"] <= reached * (PROMPT_TOKENS + 20), held


@pytest.mark.redis
@pytest.mark.slow
def test_a_redis_stall_longer_than_the_socket_timeout_leaves_nothing_held(
    gateway_factory: Any, upstream_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Redis frozen (SIGSTOP, as `DEBUG SLEEP` does: the commands sent meanwhile run once it is back, though
    their callers timed out) for 3 socket timeouts while requests are offered. The lease is longer than the
    stall here: a hold whose lease lapses counts as spent in full (README), so with a 1 s lease a request served
    just before the stall, whose release waited out the stall, was charged its whole reservation (a loaded run
    served 7 before the stall and charged 2,845 tokens)."""
    lease_s = 3.0
    redis = PrivateRedis()
    redis.start()
    try:
        upstream, _ = upstream_factory(max_output=5)
        store = RedisStateStore(url=redis.url, prefix="t:", lease_s=lease_s, socket_timeout_s=0.5)
        h = gateway_factory(upstreams=[upstream], store=store, entitlement=QUOTA, pool=POOL,
                            config={**CONFIG, "lease_s": lease_s})
        payload = _raw_request(h.secret, BODY)

        async def offer_during_stall() -> list[int]:
            async def one() -> int:
                reader, writer = await asyncio.open_connection("127.0.0.1", h.server.port)
                writer.write(payload)
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), 30)
                writer.close()
                return int(line.split()[1])

            tasks = [asyncio.create_task(one()) for _ in range(10)]
            await asyncio.sleep(0.05)
            redis.pause()
            tasks += [asyncio.create_task(one()) for _ in range(20)]
            await asyncio.sleep(1.5)
            redis.resume()
            return list(await asyncio.gather(*tasks))

        codes = asyncio.run(offer_during_stall())
        held = _settled(h, within_s=lease_s + 5.0)
        with capsys.disabled():
            print(f"\nRedis frozen 1.5 s (socket timeout 0.5 s) while 30 requests were offered: answers "
                  f"{ {c: codes.count(c) for c in sorted(set(codes))} }; then held: {held}")
        assert set(codes) <= {200, 503}, codes
        assert 503 in codes, codes  # the stall was met
        served = codes.count(200)
        assert held["quota_used"] <= served * (PROMPT_TOKENS + 5), held
    finally:
        redis.remove()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_client_that_leaves_before_the_first_byte_cancels_the_upstream_request(
    kind: str, stream: bool, request: pytest.FixtureRequest, gateway_factory: Any, upstream_factory: Any
) -> None:
    upstream, _ = upstream_factory(first_token_delay_s=3.0, max_output=5)
    h = gateway_factory(upstreams=[upstream], store=_store(kind, request), entitlement=QUOTA, pool=POOL,
                        config=CONFIG)
    payload = _raw_request(h.secret, {**BODY, "stream": stream})

    async def leave_once_it_reached_the_backend() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", h.server.port)
        writer.write(payload)
        await writer.drain()
        deadline = time.monotonic() + 10
        while not upstream.received:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        writer.close()

    asyncio.run(leave_once_it_reached_the_backend())
    deadline = time.monotonic() + 2.0
    while upstream.cancelled < 1:
        assert time.monotonic() < deadline, "the backend never saw its request cancelled"
        time.sleep(0.02)
    held = _settled(h, within_s=2.0)
    assert held["quota_used"] == 0, held  # nothing was produced: nothing is charged


class _CancellationLosingStore(MemoryStateStore):
    """A store whose offer keeps its reply when a cancellation comes in with it and drops the cancellation, as
    Python 3.11's asyncio.wait_for does (redis-py's socket timeout; CPython gh-86296). Under load that race was
    seen on Redis; here it is made to happen every time."""

    offered = False

    async def offer(self, **kwargs: Any) -> Any:
        offer = await super().offer(**kwargs)
        self.offered = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1.0)  # the client leaves meanwhile
        return offer


def test_a_client_gone_while_its_cancellation_was_lost_is_not_sent_to_a_backend(
    gateway_factory: Any, upstream_factory: Any
) -> None:
    upstream, _ = upstream_factory(max_output=5)
    store = _CancellationLosingStore()
    h = gateway_factory(upstreams=[upstream], store=store, entitlement=QUOTA, pool=POOL, config=CONFIG)

    async def offered() -> None:
        deadline = time.monotonic() + 10
        while not store.offered:
            assert time.monotonic() < deadline, "the request was never offered"
            await asyncio.sleep(0.01)

    asyncio.run(_send_and_leave(h.server.port, _raw_request(h.secret, BODY), 0.0, wait=offered))
    held = _settled(h, within_s=3.0)
    time.sleep(0.5)  # what a lost cancellation would have let through has reached the backend by now
    assert upstream.received == [], "a request whose client had gone was sent to the backend"
    assert held["quota_used"] == 0, held
