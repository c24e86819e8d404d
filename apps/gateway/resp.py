"""The Redis store's calls on their hot path: one connection carrying many calls at once.

Every admission makes three calls to Redis (read, commit, release). Through redis-py's asyncio client each
call took a connection from the pool, armed a timeout (a task of its own), encoded its arguments one by one
in Python and gave the connection back: about 65 us of CPU a call on this machine, against about 20 us for
the same call written with hiredis's encoder on an asyncio protocol. Here the calls of every request share one
connection: a command is written as it comes, and replies, which Redis sends in the order of the commands,
settle the callers' futures in that order. Redis runs one command at a time whatever the number of connections,
so nothing waits longer than it would on a pool.

Failures read as redis-py's, so that `redis_calls.store_failure` maps them as it maps the pool's: a refused or
lost connection is `ConnectionError`, a connection silent for the socket timeout while calls wait `TimeoutError`
(the connection is dropped: a later reply could not be told from the next caller's), an error reply its redis-py
class (READONLY, LOADING, NOSCRIPT, a refused password, the rest `ResponseError`). Used for plain and TLS URLs and Unix sockets of
a single Redis; a cluster, or a client handed in, keeps redis-py (`RedisStateStore.__init__`).
"""

from __future__ import annotations

import asyncio
import collections
import select
import ssl
from typing import Any
from urllib.parse import urlsplit

import hiredis
from redis.asyncio.connection import parse_url
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ConnectionError,
    NoScriptError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TimeoutError,
)

# How soon a connection whose deadline passed with a reply waiting unread in its socket is looked at again
# (`_Protocol._check_deadline`): by then this process has read its sockets.
RECHECK_S = 0.01

# Error replies redis-py raises as classes of their own (the rest are `ResponseError`).
_ERROR_CLASSES = (("READONLY", ReadOnlyError), ("LOADING", BusyLoadingError), ("NOSCRIPT", NoScriptError),
                  ("WRONGPASS", AuthenticationError), ("NOAUTH", AuthenticationError))


def reply_error(message: str) -> RedisError:
    for prefix, kind in _ERROR_CLASSES:
        if message.startswith(prefix):
            return kind(message)
    return ResponseError(message)


class _Protocol(asyncio.Protocol):
    """One connection: commands out as they come, replies matched to their callers in order.

    The timeout is Redis's silence, not a call's wait: calls fail when none of them has been answered for the
    timeout, counted from the last reply or, if later, the oldest unanswered call's sending. A burst that queues
    more work on the connection than Redis does in the timeout is a busy Redis, not an unreachable one; measured
    per call, it failed every call in flight together as 'unreachable' (CI, 2026-11-28: a thousand concurrent
    admissions on one process, and failing open then served 1,379 tokens against a quota of 250). And it is the
    socket's silence, not this process's: a reply that waits unread in the socket when the deadline passes is
    Redis answering while this process was busy elsewhere."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()  # a connection serves the event loop that opened it only
        self.reader = hiredis.Reader(encoding="utf-8")
        self.waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.heard = 0.0  # when this process last read anything from Redis (the loop's clock)
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes

    def send(self, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        assert self.transport is not None
        self.transport.write(hiredis.pack_command(args))
        self.waiting.append((future, loop.time()))
        if self._timer is None:  # one timer for the connection, not one per call
            self._timer = loop.call_at(self._silent_since() + self.timeout_s, self._check_deadline)
        return future

    def _silent_since(self) -> float:
        """Since when nothing has come from Redis that a call waits for: its last reply or, if later, the oldest
        unanswered call's sending. Silent for the timeout, the connection fails."""
        return max(self.heard, self.waiting[0][1])

    def data_received(self, data: bytes) -> None:
        self.heard = self.loop.time()
        self.reader.feed(data)
        waiting = self.waiting
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(ConnectionError(f"Redis protocol error: {exc}"))
                return
            if reply is False:
                return
            if not waiting:  # a reply nobody asked for: the stream is out of step
                self._fail(ConnectionError("Redis sent a reply no call was waiting for"))
                return
            future, _ = waiting.popleft()
            if future.done():
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(reply_error(str(reply)))
            else:
                future.set_result(reply)

    def _check_deadline(self) -> None:
        self._timer = None
        if not self.waiting or self.transport is None:
            return
        loop = self.loop
        now, since = loop.time(), self._silent_since()
        deadline = since + self.timeout_s
        if now < deadline:
            self._timer = loop.call_at(deadline, self._check_deadline)
            return
        if self._unread():
            # Redis answered while this process was busy (turns of its loop longer than the timeout: a thousand
            # requests' callbacks, a full collection). uvloop runs due timers at the start of a turn, before it reads
            # the sockets, so a stall in I/O callbacks leaves replies that came meanwhile unread at the check, and a
            # second check after one more read is no cure: the next turn may stall as long. They are read first.
            self._timer = loop.call_at(now + RECHECK_S, self._check_deadline)
            return
        self._fail(TimeoutError(f"Timeout reading from Redis (nothing for {now - since:.2f} s, "
                                f"{len(self.waiting)} calls waiting)"))

    def _unread(self) -> bool:
        """Whether the socket holds what this process has not read yet: a reply, or the connection's end."""
        assert self.transport is not None
        sock = self.transport.get_extra_info("socket")  # looked at, never read
        if sock is None:
            return False
        poller = select.poll()  # not select.select: a busy process's descriptors pass FD_SETSIZE
        try:
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # closed under us: connection_lost says so
            return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self._fail(ConnectionError(f"Connection to Redis lost{f': {exc}' if exc else ''}"))

    def _fail(self, error: BaseException) -> None:
        """Every call in flight fails with `error`, and the connection goes (its replies can no longer be
        matched to their calls)."""
        if self.lost is None:
            self.lost = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.abort()


class MultiplexedRedis:
    """Calls to one Redis over one shared connection, opened on first use and again after it is lost."""

    def __init__(self, *, host: str = "localhost", port: int = 6379, path: str | None = None,
                 username: str | None = None, password: str | None = None, db: int = 0,
                 tls: ssl.SSLContext | None = None, timeout_s: float = 1.0) -> None:
        self.host, self.port, self.path = host, port, path
        self.username, self.password, self.db = username, password, db
        self.tls = tls
        self.timeout_s = timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float) -> MultiplexedRedis | None:
        """The connection `url` names, or None for what this does not speak (redis-py serves it then)."""
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            return None
        options = parse_url(url)
        if set(options) - {"host", "port", "db", "username", "password", "path", "connection_class"}:
            return None  # options in the query string (timeouts, TLS files...): redis-py reads them
        tls = ssl.create_default_context() if scheme == "rediss" else None
        return cls(host=options.get("host", "localhost"), port=int(options.get("port", 6379)),
                   path=options.get("path"), username=options.get("username"), password=options.get("password"),
                   db=int(options.get("db", 0) or 0), tls=tls, timeout_s=timeout_s)

    async def call(self, *args: Any) -> Any:
        protocol = self._protocol
        if protocol is None or protocol.lost is not None or protocol.loop is not asyncio.get_running_loop():
            protocol = await self._connect()
        return await protocol.send(args)

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        if self._connecting is None or self._connecting[0] is not loop:
            self._connecting = (loop, asyncio.Lock())
        async with self._connecting[1]:  # callers that find it lost together open one connection, not one each
            protocol = self._protocol
            if protocol is not None and protocol.lost is None and protocol.loop is loop:
                return protocol
            # A lost one was aborted when it was lost (`_Protocol._fail`); one of another event loop (a store
            # used from a fresh `asyncio.run`) is left to that loop.
            protocol = await self._open()
            self._protocol = protocol
            return protocol

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        protocol: _Protocol | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.path is not None:
                    _, protocol = await loop.create_unix_connection(lambda: _Protocol(self.timeout_s), self.path)
                else:
                    _, protocol = await loop.create_connection(
                        lambda: _Protocol(self.timeout_s), self.host, self.port, ssl=self.tls,
                        server_hostname=self.host if self.tls else None)  # asyncio sets TCP_NODELAY
                if self.password is not None:
                    auth = (self.username, self.password) if self.username else (self.password,)
                    await protocol.send(("AUTH", *auth))
                if self.db:
                    await protocol.send(("SELECT", self.db))
        except BaseException as exc:
            if protocol is not None and protocol.transport is not None:
                protocol.transport.abort()  # half set up (a refused password, a timeout): not kept
            if not isinstance(exc, (OSError, asyncio.TimeoutError)):
                raise
            raise ConnectionError(f"Error connecting to Redis at {self.path or f'{self.host}:{self.port}'}: "
                                  f"{exc or type(exc).__name__}") from exc
        return protocol

    async def aclose(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None and protocol.loop is asyncio.get_running_loop():
            protocol.transport.close()
