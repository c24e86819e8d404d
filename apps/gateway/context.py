"""One request's context on its way through the pipeline, and how it answers the client.

Every step reads and writes this object instead of passing a dozen arguments along; the ASGI scope, the
`send` callable and the timing marks of `x-tokenpools-overhead-ms` live here, and so do the two ways a
request ends early: a client that went away (`disconnected`) and a preemption (`preempted`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from apps.gateway.errors import GatewayError
from apps.gateway.snapshot import KeyEntry
from apps.gateway.state import RateView
from apps.policy.quota import QuotaStanding

if TYPE_CHECKING:
    from apps.gateway.tracing import RequestTrace

JSON_TYPE = (b"content-type", b"application/json")
Headers = list[tuple[bytes, bytes]]


class ClientGone(Exception):
    """The client disconnected; nothing more can be sent."""


@dataclass(slots=True)
class Served:
    """What the backend served, as learnt from its answer (usage, or failing that the chunks counted)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    first_chunk_at: float | None = None
    # How the backend broke off mid-stream (httpx's exception name; the client got an error event), for the
    # request log: "" when it did not.
    broken: str = ""

    def counts(self, input_tokens: int) -> tuple[int, int]:
        """(prompt, completion) tokens to account: the backend's usage when it gave one; else the prompt as
        counted at admission once anything was generated, and one token per content chunk."""
        prompt = self.prompt_tokens if self.prompt_tokens is not None else (
            input_tokens if self.chunks or self.completion_tokens else 0)
        completion = self.completion_tokens if self.completion_tokens is not None else self.chunks
        return prompt, completion


@dataclass(slots=True)
class RequestContext:
    scope: dict[str, Any]
    receive: Callable[[], Awaitable[dict[str, Any]]]
    send: Callable[[dict[str, Any]], Awaitable[None]]
    request_id: str
    started: float = field(default_factory=time.perf_counter)
    entry: KeyEntry | None = None
    view: RateView | None = None
    # The binding quota after the offer (x-tokenpools-quota-* headers), on admissions and rejections alike.
    quota: QuotaStanding | None = None
    # The class that serves the request (its entitlement's, or a lower one: spilled over, demoted), once it
    # started: `x-tokenpools-service-tier` and the `service_tier` field of the answer (issue 24).
    service_tier: str = ""
    # Milliseconds the request waited in its entitlement's queue or the pool's waiting room (x-tokenpools-queue-ms).
    queue_ms: float = 0.0
    upstream_started: float | None = None
    upstream_answered: float | None = None
    task: asyncio.Task | None = None
    preempted: bool = False
    disconnected: bool = False
    served: Served = field(default_factory=Served)
    # A backend answered: the request counts in the usage records (queue timeouts and 503s do not).
    proxied: bool = False
    # The response has begun (a streamed one: its headers went out).
    response_started: bool = False
    # The status the response began with (0 until then): the request log tells a backend's error answer.
    status: int = 0
    # The request's hold is given back and the end of the answer about to go: a disconnect now is the normal
    # end of the exchange.
    finished: bool = False
    # Its spans when tracing is on (apps.gateway.tracing); None (the default) and the path calls nothing.
    trace: RequestTrace | None = None

    def header(self, name: bytes) -> str | None:
        for key, value in self.scope.get("headers") or ():
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    def overhead_ms(self) -> float:
        """Time the gateway itself added: entry to the upstream call, plus answer to our response."""
        now = time.perf_counter()
        if self.upstream_started is None:
            return (now - self.started) * 1000.0
        after = now - self.upstream_answered if self.upstream_answered is not None else 0.0
        return (self.upstream_started - self.started + after) * 1000.0

    def headers(self, extra: Headers) -> Headers:
        tier = [(b"x-tokenpools-service-tier", self.service_tier.encode())] if self.service_tier else []
        return [
            *extra,
            *tier,
            (b"x-request-id", self.request_id.encode()),
            (b"x-tokenpools-overhead-ms", f"{self.overhead_ms():.3f}".encode()),
            (b"x-tokenpools-queue-ms", f"{self.queue_ms:.3f}".encode()),
            *ratelimit_headers(self.view),
            *quota_headers(self.quota, time.time()),
        ]

    async def respond(self, status: int, body: bytes, extra: Headers) -> None:
        self.response_started = True
        self.status = status
        await self.send({"type": "http.response.start", "status": status, "headers": self.headers(extra)})
        await self.send({"type": "http.response.body", "body": body})

    async def respond_error(self, error: GatewayError) -> None:
        await self.respond(error.status, error.body(), [JSON_TYPE, *error.headers()])


def _quota_amount(value: float, unit: str) -> bytes:
    return (str(int(value)) if unit == "tokens" else f"{value:.6f}".rstrip("0").rstrip(".")).encode()


def quota_headers(standing: QuotaStanding | None, now_epoch: float) -> Headers:
    """The binding quota: its limit and what is left (in tokens or the currency), and whole seconds until
    its window resets."""
    if standing is None:
        return []
    charge = standing.charge
    return [
        (b"x-tokenpools-quota-limit", _quota_amount(charge.limit, charge.unit)),
        (b"x-tokenpools-quota-remaining", _quota_amount(standing.remaining, charge.unit)),
        (b"x-tokenpools-quota-reset", str(max(0, math.ceil(charge.reset_at - now_epoch))).encode()),
        (b"x-tokenpools-quota-unit", charge.unit.encode()),
    ]


def ratelimit_headers(view: RateView | None) -> Headers:
    if view is None:
        return []
    headers: Headers = []
    if view.limit_requests is not None:
        remaining = view.remaining_requests or 0
        headers += [
            (b"x-ratelimit-limit-requests", str(view.limit_requests).encode()),
            (b"x-ratelimit-remaining-requests", str(remaining).encode()),
            (b"x-ratelimit-reset-requests", b"0s" if remaining > 0 else b"1s"),
        ]
    if view.limit_tokens is not None and view.remaining_tokens is not None:
        headers += [
            (b"x-ratelimit-limit-tokens", str(int(view.limit_tokens)).encode()),
            (b"x-ratelimit-remaining-tokens", str(int(view.remaining_tokens)).encode()),
            (b"x-ratelimit-reset-tokens", f"{view.reset_tokens_s:.3f}s".encode()),
        ]
    return headers
