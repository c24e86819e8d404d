"""uvicorn's HTTP protocol with deadlines on a slow client and a cap on header size (`serve` uses it).

uvicorn closes a kept-alive connection that stays idle after a response (`timeout_keep_alive`), but it
has no timer before the first request, while a request's headers or body arrive, nor while a response waits
for a client that does not read: a connection that sends nothing, trickles a header line every few seconds
(slowloris), trickles its body, or opens a stream and never reads it is held for ever (and with it whatever
the request holds: a slot of its pool, a quota hold), and with httptools nothing bounds the headers' size.
Here a connection is closed when
- a request's headers are not complete within `SERVER_HEADER_TIMEOUT_S`, counted from the connection (the
  first request) or from the request's first byte (the next ones), or exceed `MAX_HEADER_BYTES` (a 400);
- its body is not complete within `SERVER_BODY_TIMEOUT_S` of its headers;
- the response cannot be written for `SERVER_WRITE_TIMEOUT_S` (the transport's buffer stays above its high
  water mark: the client reads nothing).
The application then sees the client go (`http.disconnect`), and the gateway releases what it held.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

# What h11 allows by default is 16 KiB; browsers and proxies stay well within 64 KiB.
MAX_HEADER_BYTES = 64 * 1024


class Deadline:
    """One timer of a connection: armed (once) until disarmed; on expiry the connection is closed."""

    def __init__(self, protocol: GuardedHttpToolsProtocol, seconds: float, what: str) -> None:
        self.protocol, self.seconds, self.what = protocol, seconds, what
        self.timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self.timer is None:
            self.timer = self.protocol.loop.call_later(self.seconds, self._expired)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        transport = self.protocol.transport
        if not transport.is_closing():
            logger.info("closing %s: %s within %g s", self.protocol.client, self.what, self.seconds)
            # abort, not close: close would wait to flush a buffer the client is not reading.
            transport.abort()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_bytes = 0
        self.headers_deadline = Deadline(self, settings.SERVER_HEADER_TIMEOUT_S, "no complete request headers")
        self.body_deadline = Deadline(self, settings.SERVER_BODY_TIMEOUT_S, "no complete request body")
        self.write_deadline = Deadline(self, settings.SERVER_WRITE_TIMEOUT_S, "the client read nothing")

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.headers_deadline.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        for deadline in (self.headers_deadline, self.body_deadline, self.write_deadline):
            deadline.disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.header_bytes = 0
        self.headers_deadline.arm()  # the next request on a kept-alive connection: from its first byte

    def on_message_complete(self) -> None:
        self.body_deadline.disarm()
        super().on_message_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.write_deadline.arm()

    def resume_writing(self) -> None:
        self.write_deadline.disarm()
        super().resume_writing()

    def _count(self, size: int) -> None:
        self.header_bytes += size
        if self.header_bytes > MAX_HEADER_BYTES:
            # Raised inside httptools' callback, it stops the parse: uvicorn answers 400 and closes.
            raise ValueError(f"request line and headers above {MAX_HEADER_BYTES} bytes")

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.headers_deadline.disarm()
        self.body_deadline.arm()  # disarmed at once by on_message_complete for a request without a body
        super().on_headers_complete()
