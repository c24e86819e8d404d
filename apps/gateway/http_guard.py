"""uvicorn's HTTP protocol with a deadline on request headers and a cap on their size (`serve` uses it).

uvicorn closes a kept-alive connection that stays idle after a response (`timeout_keep_alive`), but it
has no timer before the first request nor while a request's headers arrive: a connection that sends
nothing, or trickles a header line every few seconds (slowloris), is held for ever, and with httptools
nothing bounds the headers' size. Here a connection must complete each request's headers within
`SERVER_HEADER_TIMEOUT_S`, counted from the connection (the first request) or from the request's first
byte (the next ones), and they may not exceed `MAX_HEADER_BYTES` (a 400); otherwise it is closed.

Not covered: a request body trickled after its headers (the application reads it; the gateway's own
read of a body is its concern) and a response read slowly (uvicorn's flow control pauses the writer).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
# What h11 allows by default is 16 KiB; browsers and proxies stay well within 64 KiB.
MAX_HEADER_BYTES = 64 * 1024


def header_timeout_s() -> float:
    try:
        from django.conf import settings

        return float(settings.SERVER_HEADER_TIMEOUT_S)
    except Exception:  # settings not configured (a protocol built outside the site): the default
        return DEFAULT_HEADER_TIMEOUT_S


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timer: asyncio.TimerHandle | None = None
        self.header_bytes = 0
        self.header_timeout_s = header_timeout_s()

    def _arm(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_too_slow(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing():
            logger.debug("closing %s: no complete request headers within %g s", self.client, self.header_timeout_s)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.header_bytes = 0
        self._arm()  # the next request on a kept-alive connection: its deadline starts at its first byte

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
        self._disarm()
        super().on_headers_complete()
