"""The request log (issue 26, item 1): every request the gateway decides leaves one record (served, refused at
the offer or after a wait, a client gone), on the in-process store and on Redis; the flush writes them (with
Redis through a shared list another process can drain after this one died); retention deletes old rows;
`GATEWAY_REQUEST_LOG_DAYS=0` records nothing."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from apps.gateway.models import RequestLogRecord
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.request_log import Entry, RequestLog, request_log_prune, request_log_write

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "tiny-model", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4}


@pytest.fixture(params=["memory", "redis"])
def store_for(request: pytest.FixtureRequest) -> Callable[[], Any]:
    def make() -> Any:
        if request.param == "redis":
            return RedisStateStore(url=request.getfixturevalue("redis_url"), prefix=f"trl{uuid.uuid4().hex}:")
        return None  # the harness's in-process store

    return make


def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def fire(h: Any, count: int, body: dict[str, Any] | None = None) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:
            return await asyncio.gather(*(client.post(h.url + "/v1/chat/completions", json=body or BODY,
                                                      headers=h.auth()) for _ in range(count)))

    return asyncio.run(run())


def flushed(h: Any) -> list[RequestLogRecord]:
    """Records once the gateway's flush ran (it runs in the background every GATEWAY_USAGE_FLUSH_S)."""
    h.server.call(h.gateway.loops.request_log_flush())
    return list(RequestLogRecord.objects.order_by("arrived_at", "id"))


def test_a_served_request_is_recorded_in_full(gateway_factory: Any, store_for: Any) -> None:
    h = gateway_factory(store=store_for())
    before = time.time()
    response = httpx.post(h.url + "/v1/chat/completions", json={**BODY, "stream": True}, headers=h.auth())
    assert response.status_code == 200
    (record,) = flushed(h)
    assert record.request_id == response.headers["x-request-id"]
    assert (record.outcome, record.reason, record.stream) == ("served", "", True)
    assert (record.pool, record.entitlement, record.tenant_id) == ("tiny", "acme-chat", h.entitlement.tenant_id)
    assert (record.service_class, record.service_tier) == ("guaranteed", "guaranteed")
    assert (record.prompt_tokens, record.max_tokens, record.completion_tokens) == (5, 4, 4)
    assert record.queue_ms == 0.0
    assert record.ttft_ms is not None and 0 < record.ttft_ms <= record.duration_ms
    assert before - 0.002 <= record.arrived_at.timestamp() <= time.time()
    assert record.arrived_at.microsecond % 1000 == 0  # milliseconds


def test_refusals_are_recorded_with_their_reason(gateway_factory: Any, upstream_factory: Any,
                                                 store_for: Any) -> None:
    upstream, _ = upstream_factory(first_token_delay_s=0.4)
    h = gateway_factory(upstreams=[upstream], store=store_for(), entitlement={"concurrency": 1, "queue_max": 0})
    statuses = sorted(r.status_code for r in fire(h, 3))
    assert statuses == [200, 429, 429]
    records = flushed(h)
    assert sorted((r.outcome, r.reason) for r in records) == [
        ("rejected", "concurrency_limit_exceeded"), ("rejected", "concurrency_limit_exceeded"), ("served", "")]
    refused = [r for r in records if r.outcome == "rejected"]
    assert all(r.service_tier == "" and r.ttft_ms is None and r.completion_tokens == 0 for r in refused)
    assert all(r.prompt_tokens == 5 and r.max_tokens == 4 for r in records)


def test_a_quota_refusal_is_recorded(gateway_factory: Any, store_for: Any) -> None:
    h = gateway_factory(store=store_for(), entitlement={"quota_tokens": 12, "quota_window": "day"})
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    refused = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded"
    assert [(r.outcome, r.reason) for r in flushed(h)] == [("served", ""), ("rejected", "quota_exceeded")]


def test_a_request_that_waited_records_its_wait(gateway_factory: Any, upstream_factory: Any, store_for: Any) -> None:
    upstream, _ = upstream_factory(first_token_delay_s=0.3)
    h = gateway_factory(upstreams=[upstream], store=store_for(), entitlement={"concurrency": 1})
    assert [r.status_code for r in fire(h, 2)] == [200, 200]
    records = flushed(h)
    assert [r.outcome for r in records] == ["served", "served"]
    waited = max(records, key=lambda r: r.queue_ms)
    assert waited.queue_ms >= 200  # it waited for the first one's 0.3 s
    assert waited.ttft_ms is not None and waited.ttft_ms >= waited.queue_ms


def test_a_client_gone_mid_stream_is_recorded_cancelled(gateway_factory: Any, upstream_factory: Any,
                                                        store_for: Any) -> None:
    upstream, _ = upstream_factory(token_delay_s=0.05)
    h = gateway_factory(upstreams=[upstream], store=store_for(), config={"tokenize": False})
    with httpx.stream("POST", h.url + "/v1/chat/completions", json={**BODY, "max_tokens": 400, "stream": True},
                      headers=h.auth()) as response:
        assert next(response.iter_lines()).startswith("data: ")
    eventually(lambda: h.running() == 0)
    eventually(lambda: len(h.gateway.request_log.buffer) == 1)
    (record,) = flushed(h)
    assert (record.outcome, record.reason) == ("cancelled", "client_disconnected")
    assert 1 <= record.completion_tokens < 400
    assert record.ttft_ms is not None


def test_a_backend_that_does_not_answer_in_time_is_a_timeout(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory(first_token_delay_s=2.0)
    h = gateway_factory(upstreams=[upstream], config={"read_timeout_s": 0.3, "tokenize": False})
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 502
    assert [(r.outcome, r.reason) for r in flushed(h)] == [("timeout", "upstream_error")]


def test_a_preempted_stream_is_recorded_preempted(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory(token_delay_s=0.05)
    h = gateway_factory(upstreams=[upstream], pool={"slots_per_replica": 1}, entitlement={"concurrency": 1},
                        extra_entitlements={"acme-batch": {"service_class": "preemptible", "concurrency": 1,
                                                           "slo_target_ms": 5000}},
                        config={"tokenize": False})

    async def scenario() -> int:
        async with httpx.AsyncClient(timeout=20) as client:
            request = client.build_request("POST", h.url + "/v1/chat/completions",
                                           json={**BODY, "max_tokens": 100, "stream": True},
                                           headers=h.auth(h.secrets["acme-batch"]))
            batch = await client.send(request, stream=True)
            lines = batch.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            urgent = await client.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
            _ = [line async for line in lines]
            await batch.aclose()
            return urgent.status_code

    assert asyncio.run(scenario()) == 200
    eventually(lambda: len(h.gateway.request_log.buffer) == 2)
    by_entitlement = {r.entitlement: (r.outcome, r.reason) for r in flushed(h)}
    assert by_entitlement == {"acme-batch": ("preempted", "preempted"), "acme-chat": ("served", "")}


@pytest.mark.parametrize("kind", ["redis", pytest.param("cluster", marks=pytest.mark.redis)])
def test_records_pushed_to_redis_survive_their_process(kind: str, acme: Any, request: pytest.FixtureRequest) -> None:
    """With Redis (or a Redis Cluster), what a process pushed is drained by another (the first killed before
    its flush)."""
    import redis.asyncio as aioredis

    from apps.gateway import redis_cluster

    url = request.getfixturevalue("redis_url") if kind == "redis" else request.getfixturevalue("redis_cluster").url
    prefix = f"trl{uuid.uuid4().hex}:"
    entry = Entry("req_survivor", time.time(), acme.pk, "tiny", "acme-chat", "guaranteed", "guaranteed", False,
                  5, None, 3, "served", "", 0.0, 12.5, 20.0)

    async def scenario() -> tuple[int, int, int]:
        client = (aioredis.Redis.from_url(url, decode_responses=True) if kind == "redis"
                  else redis_cluster.cluster_client(url, socket_timeout_s=2.0, max_connections=8))
        try:
            dead, survivor = RequestLog(), RequestLog()
            dead.attach(client, prefix)
            survivor.attach(client, prefix)
            dead.record(entry)
            pushed = await dead.push()  # then SIGKILL: no flush of its own
            written = await survivor.flush()
            left = await client.llen(survivor.list_key)
            return pushed, written, left
        finally:
            await redis_cluster.close(client)

    assert asyncio.run(scenario()) == (1, 1, 0)
    record = RequestLogRecord.objects.get()
    assert (record.request_id, record.max_tokens, record.ttft_ms) == ("req_survivor", None, 12.5)


def test_a_stopping_gateways_flush_waits_for_a_drain_that_runs_now(acme: Any, redis_url: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain tick that holds the lock read the list before the stopping gateway's last push: the flush waits
    for it to end, then drains what it pushed (it once returned at once and left the record in Redis). A lock
    that is never given back (its holder killed) costs the flush `FLUSH_WAIT_S`, and the records stay in the list
    for the next tick."""
    import redis.asyncio as aioredis

    from apps.gateway import request_log

    monkeypatch.setattr(request_log, "FLUSH_WAIT_S", 1.0)
    prefix = f"trl{uuid.uuid4().hex}:"

    def entry(request_id: str) -> Entry:
        return Entry(request_id, time.time(), acme.pk, "tiny", "acme-chat", "guaranteed", "guaranteed", False,
                     5, 8, 3, "served", "", 0.0, 12.5, 20.0)

    async def scenario() -> tuple[int, int, int, int]:
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        log = RequestLog()
        log.attach(client, prefix)
        try:
            await client.set(log.lock_key, "a-tick-mid-drain", px=60_000)
            log.record(entry("req_waited"))
            flushing = asyncio.create_task(log.flush())
            await asyncio.sleep(0.3)
            waited = int(not flushing.done())
            await client.delete(log.lock_key)  # the tick's drain ends
            written = await flushing
            await client.set(log.lock_key, "a-holder-killed", px=60_000)
            log.record(entry("req_left"))
            abandoned = await log.flush()
            return waited, written, abandoned, await client.llen(log.list_key)
        finally:
            await client.delete(log.list_key, log.lock_key)
            await client.aclose()

    assert asyncio.run(scenario()) == (1, 1, 0, 1)
    assert list(RequestLogRecord.objects.values_list("request_id", flat=True)) == ["req_waited"]


def test_with_redis_the_drain_tick_writes_the_records_not_the_gateway(gateway_factory: Any, redis_url: str,
                                                                     settings: Any) -> None:
    """A gateway on Redis only pushes its records (its event loop never runs the batch INSERT); the
    `request_log_drain` tick, run where the ticks run, writes them. With the in-process store it has nothing to do."""
    import redis

    from apps.gateway.ticks import tick_request_log_drain

    h = gateway_factory(store=RedisStateStore(url=redis_url))  # the default prefix: the one the tick's store uses
    redis.Redis.from_url(redis_url).delete(h.gateway.request_log.list_key)  # nothing another test left
    assert all(r.status_code == 200 for r in fire(h, 3))
    eventually(lambda: len(h.gateway.request_log.buffer) == 3)
    assert h.server.call(h.gateway.request_log.push()) == 3
    assert not RequestLogRecord.objects.exists()
    settings.GATEWAY_STATE_BACKEND, settings.GATEWAY_REDIS_URL = "redis", redis_url
    assert tick_request_log_drain() == 3
    assert RequestLogRecord.objects.count() == 3
    assert tick_request_log_drain() == 0  # the list is trimmed by what was written
    settings.GATEWAY_STATE_BACKEND = "memory"
    assert tick_request_log_drain() == 0


@pytest.mark.postgres
def test_the_flush_writes_in_a_thread_of_lower_priority_than_the_process(acme: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows go to the database from the request log's own thread, nicer than the event loop's, so that on a
    shared core the loop gets the CPU back at once (`apps.gateway.background_thread`); `close` lets it go."""
    import os
    import threading

    from apps.gateway import request_log

    seen: list[tuple[str, int]] = []
    write = request_log._write_in_thread

    def watched(entries: list[Entry]) -> int:
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return write(entries)

    monkeypatch.setattr(request_log, "_write_in_thread", watched)
    log = RequestLog()
    for index in range(3):
        log.record(Entry(f"req_thread_{index}", time.time(), acme.pk, "tiny", "acme-chat", "guaranteed", "", False,
                         5, 8, 2, "served", "", 0.0, 1.0, 2.0))
    assert asyncio.run(log.flush()) == 3
    assert RequestLogRecord.objects.count() == 3
    process = os.getpriority(os.PRIO_PROCESS, 0)
    [(name, priority)] = seen
    assert name.startswith("gw-request-log") and (priority > process or process == 19)
    thread = next(t for t in threading.enumerate() if t.name == name)
    log.close()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_batch_written_twice_is_written_once(acme: Any) -> None:
    entry = Entry("req_twice", time.time(), acme.pk, "tiny", "acme-chat", "guaranteed", "", False, 5, 8, 0,
                  "rejected", "queue_timeout", 1000.0, None, 1001.0)
    request_log_write([entry])
    request_log_write([entry])
    assert RequestLogRecord.objects.count() == 1


@pytest.mark.postgres
def test_retention_deletes_records_older_than_the_setting(acme: Any, settings: Any) -> None:
    from workers.services import tick_request_log

    now = time.time()
    request_log_write([
        Entry(f"req_{age}", now - age * 86400, acme.pk, "tiny", "acme-chat", "guaranteed", "", False, 1, None, 0,
              "served", "", 0.0, None, 1.0)
        for age in (0, 6, 8)
    ])
    settings.GATEWAY_REQUEST_LOG_DAYS = 7
    assert tick_request_log() == 1
    assert sorted(RequestLogRecord.objects.values_list("request_id", flat=True)) == ["req_0", "req_6"]
    assert request_log_prune(days=1, now=dt.datetime.now(dt.UTC)) == 1
    assert request_log_prune(days=0) == 1  # the log turned off: what it kept goes too


def test_with_the_log_off_nothing_is_recorded(gateway_factory: Any, store_for: Any) -> None:
    h = gateway_factory(store=store_for(), config={"request_log_days": 0})
    assert h.gateway.request_log is None
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    assert h.server.call(h.gateway.loops.request_log_flush()) == 0
    assert not RequestLogRecord.objects.exists()
