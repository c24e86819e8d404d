"""Routing over replicas, health, retries, disconnects and preemption, through real HTTP."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.upstream import UPSTREAM_KEEPALIVE_S
from apps.gateway.upstream_http import UpstreamTransport
from apps.policy import ManualClock
from tests.support.services import free_port

pytestmark = pytest.mark.django_db

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for something the server does after the client is done (not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def test_connect_failure_is_retried_on_another_replica(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory()
    dead = f"http://127.0.0.1:{free_port()}"
    h = gateway_factory(upstreams=[upstream], replica_urls=[dead, upstream.url], config={"tokenize": False})
    for _ in range(3):
        assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    assert len(upstream.received) == 3
    assert h.gateway.replicas["tiny"].healthy[dead] is False


def test_no_healthy_replica_is_503_and_releases(gateway_factory: Any) -> None:
    h = gateway_factory(upstreams=[], replica_urls=[f"http://127.0.0.1:{free_port()}"], config={"tokenize": False})
    response = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_replica"
    assert response.headers["x-tokenpools-reject-reason"] == "no_healthy_replica"
    assert h.usage().in_flight == 0
    again = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
    assert again.status_code == 503


class FirstConnectTimesOut(UpstreamTransport):
    """The fault behind a CI failure: a gateway loop stalled past the connect timeout by a burst of a
    thousand arrivals saw its only replica's connect "time out". A stall that long cannot be provoked on cue."""

    def __init__(self) -> None:
        super().__init__(keepalive_connections=8, keepalive_expiry=UPSTREAM_KEEPALIVE_S)
        self.timeouts_left = 1

    async def _connect(self, key: tuple[str, str, int], timeout_s: float | None) -> Any:
        if self.timeouts_left:
            self.timeouts_left -= 1
            raise httpx.ConnectTimeout("stalled past the connect timeout")
        return await super()._connect(key, timeout_s)


def test_a_connect_timeout_on_the_only_replica_is_tried_once_more_not_a_503(gateway_factory: Any,
                                                                            upstream_factory: Any) -> None:
    upstream, _ = upstream_factory()
    h = gateway_factory(upstreams=[upstream], config={"tokenize": False})
    h.gateway.transport = transport = FirstConnectTimesOut()
    response = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
    assert response.status_code == 200, response.text
    assert (transport.timeouts_left, transport.opened, len(upstream.received)) == (0, 1, 1)
    assert h.gateway.replicas["tiny"].healthy[upstream.url] is True
    assert h.usage().in_flight == 0


def test_a_replica_that_never_answers_a_connect_is_tried_twice_then_503(gateway_factory: Any) -> None:
    silent = socket.socket()  # listens, accepts nothing, and its backlog is full: SYNs go unanswered
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    filler = socket.create_connection(silent.getsockname(), timeout=5)  # listen(0) queues one connection
    try:
        h = gateway_factory(upstreams=[], replica_urls=[url], config={"tokenize": False, "connect_timeout_s": 0.2})
        started = time.monotonic()
        response = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth(), timeout=10)
        elapsed = time.monotonic() - started
    finally:
        filler.close()
        silent.close()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_replica"
    assert elapsed >= 0.4  # two connect timeouts of 0.2 s, one after the other
    assert h.gateway.replicas["tiny"].timeouts[url] == 2  # counted, not yet down (three in a row are)
    assert h.usage().in_flight == 0


def test_health_probe_takes_a_replica_out_and_back(gateway_factory: Any, upstream_factory: Any) -> None:
    sick, _ = upstream_factory()
    well, _ = upstream_factory()
    h = gateway_factory(upstreams=[sick, well], config={"tokenize": False})
    sick.healthy = False
    h.server.call(h.gateway.loops.health_check())
    for _ in range(4):
        assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    assert (len(sick.received), len(well.received)) == (0, 4)
    sick.healthy = True
    h.server.call(h.gateway.loops.health_check())
    assert h.gateway.replicas["tiny"].healthy[sick.url] is True


def test_least_outstanding_spreads_concurrent_requests(gateway_factory: Any, upstream_factory: Any) -> None:
    first, _ = upstream_factory(first_token_delay_s=0.3)
    second, _ = upstream_factory(first_token_delay_s=0.3)
    h = gateway_factory(upstreams=[first, second], config={"tokenize": False})

    async def fire() -> list[int]:
        async with httpx.AsyncClient(timeout=10) as client:
            responses = await asyncio.gather(*(client.post(h.url + "/v1/chat/completions", json=BODY,
                                                           headers=h.auth()) for _ in range(4)))
        return [r.status_code for r in responses]

    assert asyncio.run(fire()) == [200] * 4
    assert (len(first.received), len(second.received)) == (2, 2)


def test_client_disconnect_mid_stream_releases_and_charges_what_was_generated(
    gateway_factory: Any, upstream_factory: Any
) -> None:
    upstream, _ = upstream_factory(token_delay_s=0.05)
    h = gateway_factory(upstreams=[upstream], store=MemoryStateStore(clock=ManualClock(100.0)),
                        config={"tokenize": False})
    body = {**BODY, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", h.url + "/v1/chat/completions", json=body, headers=h.auth()) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    eventually(lambda: h.running() == 0)
    usage = h.usage()
    assert usage.in_flight == 0
    eventually(lambda: upstream.active == 0)
    spent = 60_000 - usage.tokens_available
    # Charged the prompt and the tokens generated before the disconnect, not the 400 reserved.
    assert 1 <= spent < 300


def test_preemptible_streams_are_cancelled_for_higher_priority_work(
    gateway_factory: Any, upstream_factory: Any
) -> None:
    upstream, _ = upstream_factory(token_delay_s=0.05)
    h = gateway_factory(
        upstreams=[upstream],
        pool={"slots_per_replica": 2},
        entitlement={"concurrency": 1},
        extra_entitlements={"acme-batch": {"service_class": "preemptible", "concurrency": 2, "slo_target_ms": 5000}},
        config={"tokenize": False},
    )

    async def scenario() -> tuple[list[str], int]:
        async with httpx.AsyncClient(timeout=20) as client:
            batch_body = {**BODY, "max_tokens": 100, "stream": True}
            streams = []
            for _ in range(2):
                request = client.build_request("POST", h.url + "/v1/chat/completions", json=batch_body,
                                               headers=h.auth(h.secrets["acme-batch"]))
                response = await client.send(request, stream=True)
                assert response.status_code == 200
                streams.append(response)
            readers = [response.aiter_lines() for response in streams]
            for lines in readers:  # both are generating
                while not (await anext(lines)).startswith("data: "):
                    pass
            urgent = await client.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
            tails = []
            for response, lines in zip(streams, readers, strict=True):
                tails.append("".join([line async for line in lines]))
                await response.aclose()
            return tails, urgent.status_code

    tails, status = asyncio.run(scenario())
    assert status == 200
    # The state machine evicts just what makes room: one slot for the urgent request, one victim.
    preempted = [tail for tail in tails if '"code": "preempted"' in tail]
    assert len(preempted) == 1, tails
    assert all(tail.rstrip().endswith("[DONE]") for tail in tails)
    eventually(lambda: h.running() == 0)
    assert h.usage("acme-batch").in_flight == 0


def test_vllm_metrics_are_parsed_into_an_instance_snapshot() -> None:
    from apps.gateway.routing import parse_vllm_metrics

    text = ("# HELP vllm:num_requests_waiting x\n"
            'vllm:num_requests_running{engine="0",model_name="tiny"} 16.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.4\n'
            'vllm:cache_config_info{kv_cache_size_tokens="524288"} 1.0\n')
    snapshot = parse_vllm_metrics(text)
    assert snapshot is not None
    assert (snapshot.queue_depth, snapshot.kv_utilization, snapshot.batch_size) == (3.0, 0.4, 16.0)
    assert parse_vllm_metrics("other_metric 1\n") is None


def test_saturated_replicas_make_the_pool_contended(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory(waiting=10)
    h = gateway_factory(upstreams=[upstream], config={"tokenize": False}, entitlement={"service_class": "elastic"},
                        extra_entitlements={"acme-reserved": {"service_class": "guaranteed", "concurrency": 2,
                                                              "tokens_per_second": 100}})
    h.server.call(h.gateway.loops.health_check())
    busy = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth())
    assert busy.status_code == 429
    assert busy.json()["error"]["code"] == "pool_contended"
    # A backend queue alone does not turn away guaranteed work within its reserved baseline.
    reserved = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth(h.secrets["acme-reserved"]))
    assert reserved.status_code == 200, reserved.text
    assert 'flow_control_pool_saturation{pool="tiny"} 2' in httpx.get(h.url + "/metrics").text
    upstream.waiting = 0
    h.server.call(h.gateway.loops.health_check())
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    assert h.usage().in_flight == 0


def test_backend_failing_mid_stream_ends_the_stream_with_an_error_event(
    gateway_factory: Any, upstream_factory: Any
) -> None:
    upstream, _ = upstream_factory(fail_after=2)
    h = gateway_factory(upstreams=[upstream], config={"tokenize": False})
    response = httpx.post(h.url + "/v1/chat/completions", json={**BODY, "max_tokens": 10, "stream": True},
                          headers=h.auth())
    assert response.status_code == 200
    events = [line for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert '"code": "upstream_error"' in events[-2]
    assert events[-1] == "data: [DONE]"
    assert h.usage().in_flight == 0


def test_client_leaving_while_queued_releases_its_reservation(gateway_factory: Any, upstream_factory: Any) -> None:
    upstream, _ = upstream_factory(token_delay_s=0.05)
    h = gateway_factory(upstreams=[upstream], config={"tokenize": False, "acquire_timeout_s": 30.0})
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    assert h.gateway.store is not None
    h.server.call(h.gateway.store.pool_budgets_set(budgets={"tiny": 1}))  # as if AIMD had cut it to one
    with httpx.stream("POST", h.url + "/v1/chat/completions", json={**BODY, "max_tokens": 40, "stream": True},
                      headers=h.auth()) as holder:
        lines = holder.iter_lines()  # kept referenced: a collected iterator closes the stream
        assert next(lines).startswith("data: ")
        with pytest.raises(httpx.ReadTimeout):  # queued behind the holder, then the client gives up
            httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth(), timeout=0.5)
        eventually(lambda: h.usage().in_flight == 1)  # the queued one released its reservation
        assert h.running() == 1
        assert [line for line in lines if line][-1] == "data: [DONE]"
    eventually(lambda: h.usage().in_flight == 0)
    eventually(lambda: h.running() == 0 and h.gateway.admitter.waiting.get("acme-chat", 0) == 0)


def test_a_late_health_answer_counts_but_only_repeated_silence_takes_a_replica_out(upstream_factory: Any) -> None:
    """A refused connection or a 5xx /health is a definite no; a probe that times out is not, until
    UNHEALTHY_AFTER_TIMEOUTS of them in a row (a busy backend on a loaded CPU answers late now and then)."""
    from apps.gateway.routing import UNHEALTHY_AFTER_TIMEOUTS, ReplicaSet, probe_replicas

    slow, _ = upstream_factory(health_delay_s=1.0)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused at once
    replicas = ReplicaSet((slow.url, dead))

    async def probe_once() -> None:
        async with httpx.AsyncClient() as client:
            await probe_replicas(client, [replicas], timeout_s=0.2)

    asyncio.run(probe_once())
    assert replicas.healthy == {slow.url: True, dead: False}
    for _ in range(UNHEALTHY_AFTER_TIMEOUTS - 2):
        asyncio.run(probe_once())
    assert replicas.healthy[slow.url], "taken out before its timeouts ran out"
    asyncio.run(probe_once())
    assert not replicas.healthy[slow.url]
    assert replicas.candidates() == []

    slow.health_delay_s = 0.0  # one answer in time brings it back and clears the count
    asyncio.run(probe_once())
    assert replicas.healthy[slow.url] and replicas.timeouts[slow.url] == 0
    slow.health_delay_s = 1.0
    asyncio.run(probe_once())
    assert replicas.healthy[slow.url]

    slow.health_delay_s, slow.healthy = 0.0, False  # a backend that says it is unhealthy is believed at once
    asyncio.run(probe_once())
    assert not replicas.healthy[slow.url]


class _ClosingBackend:
    """A raw HTTP/1.1 backend that closes the connection on the first `drops` completion requests without
    a byte of answer (what a keep-alive connection being closed by the server looks like), then answers."""

    ANSWER = (b'{"id": "c", "object": "chat.completion", "created": 1, "model": "tiny", "choices": [{"index": 0, '
              b'"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}], '
              b'"usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}')

    def __init__(self, drops: int) -> None:
        import threading

        self.drops, self.completions = drops, 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith(b"POST"):
                    if self.drops > 0:
                        self.drops -= 1
                        writer.close()
                        return
                    self.completions += 1
                    body = self.ANSWER
                else:
                    body = b"{}"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def stop(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def test_a_connection_closed_before_any_answer_is_sent_once_more(gateway_factory: Any) -> None:
    """A backend closing a keep-alive connection as the gateway sends on it: the request goes once more on
    a fresh connection (not a 502, and the replica stays in); a second such failure is a 502."""
    backend = _ClosingBackend(drops=1)
    try:
        h = gateway_factory(upstreams=[], replica_urls=[backend.url], config={"tokenize": False})
        response = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth(), timeout=10)
        assert response.status_code == 200, response.text
        assert backend.completions == 1
        assert h.gateway.replicas["tiny"].healthy[backend.url] is True

        backend.drops = 2
        response = httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth(), timeout=10)
        assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error"
        assert h.usage().in_flight == 0
    finally:
        backend.stop()
