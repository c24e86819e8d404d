"""The transport of every backend call: HTTP/1.1 over asyncio protocols, parsed by httptools (uvicorn's parser),
behind httpx's transport interface.

httpx's own transport (httpcore over anyio) cost more of the gateway's CPU than anything the gateway does
itself: about a quarter of a request's time went to its connection pool, its anyio streams and its h11 state
machine, where a backend call needs one keep-alive connection, one write and a parser fed from the socket. This
transport keeps httpx's interface (requests, responses, streams, exceptions), so the client (tokenize, health
probes) and the proxy step (`apps.gateway.upstream`) use it as they used httpcore:
- idle connections per backend, most recently used first, dropped after `keepalive_expiry` (before the
  backend drops them) or when the backend closed them; no limit on connections (the admission state machine
  bounds what runs);
- the timeouts of the request's `timeout` extension: connect, and read (per wait for the answer's head and
  for each piece of its body);
- errors as httpx raises them: `ConnectError`/`ConnectTimeout` (nothing was sent), `ReadError` (the connection
  broke), `RemoteProtocolError` (not HTTP), `ReadTimeout`;
- a response closed before its end closes its connection (the backend sees its client go); a finished one goes
  back to the idle connections when the backend keeps it alive.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httptools
import httpx

# Body bytes read ahead of the relay before the socket stops being read (a slow client slows its backend down).
READ_AHEAD_BYTES = 256 * 1024
DEFAULT_PORTS = {"http": 80, "https": 443}


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to a backend: one request at a time, its answer parsed as bytes arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.headers_read = False
        self.waiter: asyncio.Future[None] | None = None

    # --- asyncio's side ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"the backend's answer is not HTTP/1.1: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if self.headers_read and not self._framed():
            self.complete = True  # an answer delimited by the end of the connection
            self._wake()
            return
        self._fail(httpx.ReadError("the backend closed the connection"))

    # --- httptools' side ------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_read = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > READ_AHEAD_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # --- the request's side ---------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(data)

    async def wait(self, timeout_s: float | None, what: str) -> None:
        """Until more of the answer (or its end, or a failure) arrived; `ReadTimeout` after `timeout_s`."""
        if self.error is not None:
            raise self.error
        waiter = self.waiter = self.loop.create_future()
        timer = None if timeout_s is None else self.loop.call_later(timeout_s, _time_out, waiter, what)
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def take(self) -> bytes | None:
        """The next piece of the body read so far, or None."""
        if not self.chunks:
            return None
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= READ_AHEAD_BYTES // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _framed(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" in names or b"transfer-encoding" in names

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _time_out(waiter: asyncio.Future[None], what: str) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout(f"no {what} from the backend in time"))


class UpstreamStream(httpx.AsyncByteStream):
    """The body of one answer, as it arrives; closing it gives its connection back or closes it."""

    def __init__(self, transport: UpstreamTransport, key: tuple[str, str, int], connection: UpstreamConnection,
                 read_timeout_s: float | None) -> None:
        self.transport = transport
        self.key = key
        self.connection = connection
        self.read_timeout_s = read_timeout_s
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self.connection
        while True:
            chunk = connection.take()
            if chunk is not None:
                yield chunk
                continue
            if connection.complete:
                return
            await connection.wait(self.read_timeout_s, "answer")

    async def aclose(self) -> None:
        if self.done:
            return
        self.done = True
        connection = self.connection
        if connection.complete and connection.keep_alive and not connection.closed:
            self.transport.give_back(self.key, connection)
        else:
            connection.close()  # cut short, or not to be reused: the backend sees its client go


class UpstreamTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, keepalive_connections: int, keepalive_expiry: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.keepalive_connections = keepalive_connections
        self.keepalive_expiry = keepalive_expiry
        self._ssl_context = ssl_context
        self.idle: dict[tuple[str, str, int], list[UpstreamConnection]] = {}
        self.opened = 0  # connections made, for tests and the curious
        # A backend's base URL -> (its connection key, its Host header, its path prefix).
        self._origins: dict[str, tuple[tuple[str, str, int], bytes, bytes]] = {}

    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:  # only for https backends: loading the CA bundle takes tens of ms
            self._ssl_context = httpx.create_ssl_context()
        return self._ssl_context

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()  # already read for the bytes every caller sends
        return await self._exchange(_key(request.url), _head(request, len(body)) + body,
                                    request.extensions.get("timeout") or {})

    async def post(self, base_url: str, path: str, body: bytes, headers: Mapping[str, str],
                   timeout: Mapping[str, float | None]) -> httpx.Response:
        """POST `body` to `base_url` + `path` (the proxy's call): the same exchange without an `httpx.Request`,
        whose URL parsing and header normalisation cost a tenth of a proxied request's CPU for a backend URL
        that never changes (parsed once here)."""
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = _origin(base_url)
        key, host, prefix = origin
        lines = b"".join([_header_line(name, value) for name, value in headers.items()])
        head = b"POST %s%s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n" % (
            prefix, path.encode(), host, lines, len(body))
        return await self._exchange(key, head + body, timeout)

    async def _exchange(self, key: tuple[str, str, int], data: bytes,
                        timeout: Mapping[str, float | None]) -> httpx.Response:
        connection = self._idle_connection(key) or await self._connect(key, timeout.get("connect"))
        try:
            connection.send(data)
            while not connection.headers_read:
                await connection.wait(timeout.get("read"), "answer")
        except BaseException:
            connection.close()
            raise
        return httpx.Response(connection.status, headers=connection.headers,
                              stream=UpstreamStream(self, key, connection, timeout.get("read")),
                              extensions={"http_version": b"HTTP/1.1"})

    def _idle_connection(self, key: tuple[str, str, int]) -> UpstreamConnection | None:
        idle = self.idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self.keepalive_expiry:
                return connection
            connection.close()
        return None

    async def _connect(self, key: tuple[str, str, int], timeout_s: float | None) -> UpstreamConnection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        tls: dict[str, Any] = {"ssl": self.ssl_context(), "server_hostname": host} if scheme == "https" else {}
        try:
            async with asyncio.timeout(timeout_s):
                _, connection = await loop.create_connection(lambda: UpstreamConnection(loop), host, port, **tls)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} in time") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        self.opened += 1
        return connection

    def give_back(self, key: tuple[str, str, int], connection: UpstreamConnection) -> None:
        idle = self.idle.setdefault(key, [])
        if len(idle) >= self.keepalive_connections:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def aclose(self) -> None:
        for idle in self.idle.values():
            for connection in idle:
                connection.close()
        self.idle.clear()


def _key(url: httpx.URL) -> tuple[str, str, int]:
    """The idle connections `url` may use: its scheme, host and port."""
    if url.scheme not in DEFAULT_PORTS:
        raise httpx.UnsupportedProtocol(f"no {url.scheme!r} backends: http or https")
    return url.scheme, url.host, url.port or DEFAULT_PORTS[url.scheme]


def _origin(base_url: str) -> tuple[tuple[str, str, int], bytes, bytes]:
    url = httpx.URL(base_url)
    return _key(url), url.netloc, url.raw_path.rstrip(b"/")  # netloc: the Host header, with the port it has


def _header_line(name: str, value: str) -> bytes:
    line = f"{name}: {value}\r\n".encode()
    if line.count(b"\r") != 1 or line.count(b"\n") != 1:  # a header must not smuggle another one in
        raise ValueError(f"header {name!r} holds a line break")
    return line


def _head(request: httpx.Request, length: int) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (request.method.encode(), request.url.raw_path)]
    for name, value in request.headers.raw:
        if name.lower() not in (b"content-length", b"transfer-encoding"):
            lines.append(name + b": " + value)
    lines.append(b"content-length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"
