"""The scripts' shared connection to Redis (apps.gateway.resp) against a real Redis and real sockets: many
calls in flight on one connection each get their own reply, error replies are redis-py's classes, and a
connection that fails (refused, lost, silent past the timeout) fails its calls as redis-py's errors and is
opened again by the next call."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import redis
import uvloop
from redis.exceptions import ConnectionError, ReadOnlyError, ResponseError, TimeoutError

from apps.gateway.redis_calls import store_failure
from apps.gateway.redis_state import RedisStateStore
from apps.gateway.resp import MultiplexedRedis
from apps.gateway.state import StateStoreUnavailable
from tests.support.services import free_port, running_redis

pytestmark = pytest.mark.redis


def client(url: str, timeout_s: float = 2.0) -> MultiplexedRedis:
    calls = MultiplexedRedis.from_url(url, timeout_s=timeout_s)
    assert calls is not None
    return calls


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # the server runs on uvloop (uvicorn's default)
def test_many_calls_in_flight_on_one_connection_each_get_their_own_reply(redis_url: str, loop: str) -> None:
    key = f"resp:{uuid.uuid4().hex}"

    async def run() -> tuple[list[object], set[object]]:
        calls = client(redis_url)
        try:
            replies = await asyncio.gather(*(calls.call("ECHO", f"call-{i}") for i in range(300)),
                                           *(calls.call("RPUSH", key, i) for i in range(50)))
            ids = set(await asyncio.gather(*(calls.call("CLIENT", "ID") for _ in range(20))))
            return replies, ids
        finally:
            await calls.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop if loop == "uvloop" else None) as runner:
        replies, ids = runner.run(run())
    assert replies[:300] == [f"call-{i}" for i in range(300)]
    assert sorted(replies[300:]) == list(range(1, 51))  # RPUSH's lengths: every push counted once
    assert len(ids) == 1  # one connection carried them all
    assert redis.Redis.from_url(redis_url, decode_responses=True).lrange(key, 0, -1) == [str(i) for i in range(50)]


def test_error_replies_are_redis_pys_classes_and_the_connection_goes_on(redis_url: str) -> None:
    async def run() -> tuple[BaseException, BaseException, str]:
        calls = client(redis_url)
        try:
            with pytest.raises(ResponseError) as missing:
                await calls.call("FCALL", "no_such_function", 0)
            await calls.call("REPLICAOF", "127.0.0.1", str(free_port()))  # a replica: writes are refused
            try:
                with pytest.raises(ReadOnlyError) as readonly:
                    await calls.call("SET", f"resp:{uuid.uuid4().hex}", "x")
            finally:
                await calls.call("REPLICAOF", "NO", "ONE")
            return missing.value, readonly.value, await calls.call("PING")
        finally:
            await calls.aclose()

    missing, readonly, pong = asyncio.run(run())
    assert "function not found" in str(missing).lower()
    assert isinstance(store_failure(readonly), StateStoreUnavailable)  # a failover's read-only node: a 503
    assert pong == "PONG"


def test_a_refused_connection_is_connection_error() -> None:
    async def run() -> None:
        calls = client(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
        with pytest.raises(ConnectionError):
            await calls.call("PING")

    asyncio.run(run())


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP server that accepts connections and never answers (a Redis stopped by SIGSTOP, a black hole)."""
    accepted: list[int] = []
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writers.append(writer)
        with contextlib.suppress(ConnectionError, OSError):
            while await reader.read(65536):
                pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, accepted
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


def test_a_call_unanswered_past_the_timeout_is_timeout_error_and_the_next_call_reconnects() -> None:
    async def run() -> tuple[float, int, list[type[BaseException]]]:
        async with silent_server() as (port, accepted):
            calls = client(f"redis://127.0.0.1:{port}/0", timeout_s=0.3)
            began = time.monotonic()
            outcomes = await asyncio.gather(calls.call("PING"), calls.call("PING"), return_exceptions=True)
            waited = time.monotonic() - began
            with pytest.raises(TimeoutError):
                await calls.call("PING")  # a fresh connection, silent too
            await calls.aclose()
            return waited, len(accepted), [type(outcome) for outcome in outcomes]

    waited, connections, kinds = asyncio.run(run())
    assert kinds == [TimeoutError, TimeoutError]  # both calls in flight fail with the connection
    assert 0.25 <= waited < 2.0
    assert connections == 2


def test_a_connection_killed_under_a_call_fails_it_and_the_next_call_reconnects(redis_url: str) -> None:
    async def run() -> tuple[BaseException | None, str, int, int]:
        calls = client(redis_url, timeout_s=5.0)
        try:
            first = await calls.call("CLIENT", "ID")
            blocked = asyncio.ensure_future(calls.call("BLPOP", f"resp:{uuid.uuid4().hex}", 3))
            await asyncio.sleep(0.1)
            redis.Redis.from_url(redis_url).client_kill_filter(_id=first)
            failure = None
            try:
                await blocked
            except ConnectionError as exc:
                failure = exc
            return failure, await calls.call("PING"), first, await calls.call("CLIENT", "ID")
        finally:
            await calls.aclose()

    failure, pong, first, second = asyncio.run(run())
    assert isinstance(failure, ConnectionError)
    assert pong == "PONG" and second != first


def test_a_password_and_a_database_in_the_url_are_used() -> None:
    password = uuid.uuid4().hex
    with running_redis("--requirepass", password) as url:
        port = url.split(":")[2].split("/")[0]

        async def run() -> tuple[str, int]:
            calls = client(f"redis://:{password}@127.0.0.1:{port}/3")
            try:
                await calls.call("SET", "resp:db", "three")
                return await calls.call("GET", "resp:db"), await calls.call("CLIENT", "INFO")
            finally:
                await calls.aclose()

        value, info = asyncio.run(run())
        assert value == "three" and " db=3 " in f" {info} "
        assert redis.Redis(port=int(port), password=password, db=3, decode_responses=True).get("resp:db") == "three"

        async def refused() -> None:
            calls = client(f"redis://:wrong@127.0.0.1:{port}/0")
            with pytest.raises(ConnectionError) as wrong:  # redis-py's AuthenticationError: a 503, not a 500
                await calls.call("PING")
            assert isinstance(store_failure(wrong.value), StateStoreUnavailable)

        asyncio.run(refused())


def test_urls_it_does_not_speak_stay_with_redis_py(redis_url: str) -> None:
    assert MultiplexedRedis.from_url("redis://127.0.0.1:6379/0?socket_keepalive=true", timeout_s=1.0) is None
    assert MultiplexedRedis.from_url("unix:///tmp/redis.sock?db=2", timeout_s=1.0) is not None
    store = RedisStateStore(url=redis_url, cluster=False)
    assert store.scripts.shared is not None
    given = RedisStateStore(client=redis.asyncio.Redis.from_url(redis_url, decode_responses=True))
    assert given.scripts.shared is None
    asyncio.run(store.close())
    asyncio.run(given.close())


def test_a_call_from_another_event_loop_opens_a_connection_of_its_own(redis_url: str) -> None:
    """A store used from one `asyncio.run` and then another (a tick's own loop): the second loop's call does not
    touch the first loop's connection."""
    calls = client(redis_url)
    first = asyncio.run(calls.call("CLIENT", "ID"))
    second = asyncio.run(calls.call("CLIENT", "ID"))
    assert first != second
    assert asyncio.run(calls.call("PING")) == "PONG"


# A call that keeps Redis busy for ARGV[1] microseconds (Lua, on Redis's own clock), then answers.
BUSY_FOR = """local began = redis.call('TIME')
repeat local now = redis.call('TIME') until (now[1] - began[1]) * 1000000 + (now[2] - began[2]) >= tonumber(ARGV[1])
return ARGV[2]"""


def test_calls_queued_behind_others_past_the_timeout_are_answered_while_redis_keeps_answering(redis_url: str) -> None:
    """The timeout is Redis's silence, not a call's wait in line: a burst queues more work on the connection than
    Redis does in the timeout (the CI failure of 2026-11-28: a thousand concurrent admissions, their calls failed
    together as 'Redis unreachable', and failing open served 1,379 tokens against a quota of 250). Here 40 calls
    of 25 ms each, 1 s in all, against a timeout of 0.5 s. Redis answers a read's worth of commands at a time (it
    reads 16 KB), so each call carries 10 KB: the replies come one or two at a time, 25-50 ms apart."""
    pad = "x" * 10_000

    async def run() -> tuple[list[object], float]:
        calls = client(redis_url, timeout_s=0.5)
        try:
            began = time.monotonic()
            replies = await asyncio.gather(*(calls.call("EVAL", BUSY_FOR, 0, 25_000, f"call-{i}", pad)
                                             for i in range(40)))
            return replies, time.monotonic() - began
        finally:
            await calls.aclose()

    replies, took = asyncio.run(run())
    assert replies == [f"call-{i}" for i in range(40)]
    assert took >= 1.0  # they really queued past the timeout


class _Staller(asyncio.Protocol):
    """A peer of this process whose data it handles slowly: the loop stalls in an I/O callback."""

    def data_received(self, data: bytes) -> None:
        time.sleep(1.0)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_reply_that_came_while_this_process_stalled_is_read_not_timed_out(redis_url: str, loop: str) -> None:
    """This process stalls (a slow callback, a full collection) past the timeout, and Redis answers meanwhile: the
    reply is read, not timed out. uvloop runs due timers before it reads the sockets again, so a stall in an I/O
    callback left the reply unread when the deadline was checked (a 503, or an admission failing open)."""
    async def run() -> object:
        loop_ = asyncio.get_running_loop()
        server = await loop_.create_server(_Staller, "127.0.0.1", 0)
        _, staller = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        calls = client(redis_url, timeout_s=0.5)
        try:
            await calls.call("PING")  # connected
            pending = asyncio.ensure_future(calls.call("EVAL", BUSY_FOR, 0, 50_000, "answered"))
            await asyncio.sleep(0)  # sent: Redis answers in 50 ms
            staller.write(b"stall")  # read first, and handled for 1 s
            return await pending
        finally:
            staller.close()
            server.close()
            await calls.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop if loop == "uvloop" else None) as runner:
        assert runner.run(run()) == "answered"


class _TwoStalls(asyncio.Protocol):
    """A peer of this process whose data it handles slowly (0.3 s), and what the first stall then sets going."""

    after_first: Callable[[], None] | None = None

    def data_received(self, data: bytes) -> None:
        time.sleep(0.3)
        if data == b"first" and _TwoStalls.after_first is not None:
            _TwoStalls.after_first()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_reply_that_came_while_this_process_stalled_twice_is_read_not_timed_out(redis_url: str, loop: str) -> None:
    """A burst stalls this process turn after turn (a thousand requests' callbacks, a full collection): a check
    of the deadline found it past, the socket was read once more, and the next stall outlasted the timeout again
    while Redis answered (CI, 2026-11-28, a thousand concurrent admissions on one process: a 503 'Timeout reading
    from Redis' with Redis up). Against a timeout of 0.2 s: a call Redis answers in 50 ms, and a stall of 0.3 s in
    an I/O callback; as it ends, a second call (answered in 100 ms) and a second stall of 0.3 s, handled in the
    turn that reads the first reply, after it. The second reply comes during the second stall. A reply waiting in
    the socket is not silence."""
    async def run() -> list[object]:
        loop_ = asyncio.get_running_loop()
        server = await loop_.create_server(_TwoStalls, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, first = await asyncio.open_connection("127.0.0.1", port)
        _, second = await asyncio.open_connection("127.0.0.1", port)
        calls = client(redis_url, timeout_s=0.2)
        pending = []

        def after_first() -> None:
            # Sent before the next read of the sockets; Redis answers it alone (two calls sent together may be
            # read, run and answered together: the first reply would then come after the second call's 100 ms).
            pending.append(asyncio.ensure_future(calls.call("EVAL", BUSY_FOR, 0, 100_000, "second")))
            second.write(b"second")  # ready after Redis's first reply: handled after it, in the same turn

        _TwoStalls.after_first = after_first
        try:
            await calls.call("PING")  # connected
            pending.append(asyncio.ensure_future(calls.call("EVAL", BUSY_FOR, 0, 50_000, "first")))
            await asyncio.sleep(0)  # sent
            first.write(b"first")
            answered = [await pending[0]]  # read after the first stall, which made the second call as it ended
            return answered + [await pending[1]]
        finally:
            _TwoStalls.after_first = None
            first.close()
            second.close()
            server.close()
            await calls.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop if loop == "uvloop" else None) as runner:
        assert runner.run(run()) == ["first", "second"]
