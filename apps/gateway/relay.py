"""The relay step: pass the backend's answer to the client, a whole body or Server-Sent Events chunk by
chunk, learning on the way what was served (usage, or the chunks counted) and when the first token came.

The end of the answer (the whole body, or the stream's last events up to `[DONE]`) is not sent here: `relay`
returns it as an `Ending` and the request path runs the account step before it `deliver`s it, since a client
that sees `[DONE]` may send its next request at once and its slot must be free by then.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from apps.gateway.admission import PREEMPTED
from apps.gateway.context import Headers, RequestContext, Served
from apps.gateway.errors import GatewayError, error_body, rejected
from apps.gateway.parse import ParsedRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Ending:
    """The end of the answer, held back until the request's hold is given back: a whole response (`status`
    set), or the stream's last body; `rest` is what the backend may still send after `[DONE]` (relayed after
    the end: a backend may keep a finished stream open a while)."""

    body: bytes
    status: int | None = None
    headers: Headers | None = None
    rest: AsyncIterator[bytes] | None = None


async def relay(ctx: RequestContext, response: httpx.Response, parsed: ParsedRequest,
                observe_ttft: Callable[[float], None]) -> Ending:
    """Relay all but the end of the answer; the end comes back to the caller, to `deliver` after the account."""
    ctx.proxied = True
    if parsed.stream and response.status_code < 400:
        return await _relay_stream(ctx, response, parsed, observe_ttft)
    return await _relay_whole(ctx, response, observe_ttft)


async def deliver(ctx: RequestContext, ending: Ending) -> None:
    """Send the end of the answer, then whatever the backend still sends before it closes its stream."""
    if ending.status is not None:
        await ctx.respond(ending.status, ending.body, ending.headers or [])
        return
    if ending.rest is None:
        await ctx.send({"type": "http.response.body", "body": ending.body, "more_body": False})
        return
    await ctx.send({"type": "http.response.body", "body": ending.body, "more_body": True})
    tail = b""
    with contextlib.suppress(httpx.HTTPError):  # past [DONE] a broken stream loses nothing
        async for chunk in ending.rest:
            tail += chunk
    await ctx.send({"type": "http.response.body", "body": tail, "more_body": False})


async def _relay_whole(ctx: RequestContext, response: httpx.Response, observe_ttft: Callable[[float], None]) -> Ending:
    try:
        data = await response.aread()
    except httpx.HTTPError as exc:
        raise GatewayError(502, "upstream_error", f"The backend failed: {type(exc).__name__}.",
                           error_type="server_error") from None
    ctx.upstream_answered = time.perf_counter()
    served = ctx.served
    if response.status_code < 400:
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            usage = json.loads(data).get("usage") or {}
            served.prompt_tokens = int(usage["prompt_tokens"]) if "prompt_tokens" in usage else None
            served.completion_tokens = int(usage["completion_tokens"]) if "completion_tokens" in usage else None
        if ctx.service_tier and data.startswith(b"{"):  # a JSON object (as vLLM writes it)
            data = with_field(data, tier_field(ctx.service_tier))
    served.first_chunk_at = time.perf_counter()
    observe_ttft(served.first_chunk_at - ctx.started)
    content_type = response.headers.get("content-type", "application/json").encode("latin-1")
    return Ending(data, response.status_code, [(b"content-type", content_type)])


async def _relay_stream(ctx: RequestContext, response: httpx.Response, parsed: ParsedRequest,
                        observe_ttft: Callable[[float], None]) -> Ending:
    ctx.upstream_answered = time.perf_counter()
    ctx.response_started = True
    ctx.status = 200
    await ctx.send({"type": "http.response.start", "status": 200, "headers": ctx.headers(
        [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")])})
    served = ctx.served
    tier = tier_field(ctx.service_tier) if ctx.service_tier else b""
    pending = b""
    chunks = response.aiter_raw()
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            break
        except httpx.HTTPError as exc:
            # The backend broke off mid-stream: end the client's stream with an error event.
            logger.warning("backend stream of %s failed: %s", ctx.request_id, type(exc).__name__)
            served.broken = type(exc).__name__
            body = b"data: " + error_body("The backend stream failed.", "server_error", "upstream_error")
            return Ending(body + b"\n\ndata: [DONE]\n\n")
        pending += chunk
        out: list[bytes] = []
        while True:
            end = pending.find(b"\n\n")
            if end < 0:
                break
            event, pending = pending[: end + 2], pending[end + 2:]
            if inspect_event(event, served, parsed.client_wants_usage):
                out.append(with_field(event, tier) if tier and event.startswith(b"data: {") else event)
        if out:
            if served.first_chunk_at is None:
                served.first_chunk_at = time.perf_counter()
                observe_ttft(served.first_chunk_at - ctx.started)
            if out[-1].startswith(b"data: [DONE]"):
                return Ending(b"".join(out) + pending, rest=chunks)
            await ctx.send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
    return Ending(pending)


def tier_field(tier: str) -> bytes:
    """The `service_tier` member to add to the answer's JSON objects (a class name: nothing to escape)."""
    return b',"service_tier":"' + tier.encode() + b'"'


def with_field(data: bytes, member: bytes) -> bytes:
    """`member` (`,"name":value`) added as the last member of the JSON object in `data` (a whole body, or an
    SSE event `data: {...}`), by bytes: no parse and re-serialise per chunk. Last, so that it is the value a
    client reads should the backend send a `service_tier` of its own (JSON readers keep a repeated key's last
    value)."""
    # An SSE event as vLLM writes it ends `}\n\n`: no search (a few hundred ns an event in all).
    end = len(data) - 3 if data.endswith(b"}\n\n") else data.rfind(b"}")
    if end < 0:
        return data
    if end and data[end - 1] == 0x7B:  # an empty object `{}`: no comma
        member = member[1:]
    return data[:end] + member + data[end:]


def inspect_event(event: bytes, served: Served, client_wants_usage: bool) -> bool:
    """Learn usage from an SSE event; False for the usage-only chunk the client did not ask for."""
    if b'"usage"' not in event or b'"usage":null' in event or b'"usage": null' in event:
        if b'"choices"' in event:
            served.chunks += 1
        return True
    start = event.find(b"{")
    try:
        data = json.loads(event[start:]) if start >= 0 else None
    except ValueError:
        return True
    if not isinstance(data, dict):
        return True
    usage = data.get("usage")
    if isinstance(usage, dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            served.prompt_tokens = int(usage["prompt_tokens"])
            served.completion_tokens = int(usage["completion_tokens"])
    if data.get("choices") == []:
        return client_wants_usage
    served.chunks += 1
    return True


async def send_preempted(ctx: RequestContext) -> None:
    """End a preempted request cleanly: an error event then [DONE] once streaming, else a 429."""
    message = "This preemptible request was cancelled to make room for higher-priority work."
    with contextlib.suppress(Exception):
        if ctx.response_started:
            body = b"data: " + error_body(message, "rate_limit_error", PREEMPTED) + b"\n\ndata: [DONE]\n\n"
            await ctx.send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await ctx.respond_error(rejected(PREEMPTED, message, retry_after_s=1.0, retryable=True))
