"""The relay step: pass the backend's answer to the client, a whole body or Server-Sent Events chunk by
chunk, learning on the way what was served (usage, or the chunks counted) and when the first token came.

The account step runs (`ctx.run_finish`) before the last byte goes out: a client that sees `[DONE]` may
send its next request at once, and its slot must be free by then.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable

import httpx

from apps.gateway.admission import PREEMPTED
from apps.gateway.context import RequestContext, Served
from apps.gateway.errors import GatewayError, error_body, rejected
from apps.gateway.parse import ParsedRequest

logger = logging.getLogger(__name__)


async def relay(ctx: RequestContext, response: httpx.Response, parsed: ParsedRequest,
                observe_ttft: Callable[[float], None]) -> None:
    ctx.proxied = True
    if parsed.stream and response.status_code < 400:
        await _relay_stream(ctx, response, parsed, observe_ttft)
    else:
        await _relay_whole(ctx, response, observe_ttft)


async def _relay_whole(ctx: RequestContext, response: httpx.Response, observe_ttft: Callable[[float], None]) -> None:
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
    served.first_chunk_at = time.perf_counter()
    observe_ttft(served.first_chunk_at - ctx.started)
    content_type = response.headers.get("content-type", "application/json").encode("latin-1")
    await ctx.run_finish()
    await ctx.respond(response.status_code, data, [(b"content-type", content_type)])


async def _relay_stream(ctx: RequestContext, response: httpx.Response, parsed: ParsedRequest,
                        observe_ttft: Callable[[float], None]) -> None:
    ctx.upstream_answered = time.perf_counter()
    ctx.response_started = True
    await ctx.send({"type": "http.response.start", "status": 200, "headers": ctx.headers(
        [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")])})
    served = ctx.served
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
            await ctx.run_finish()
            body = b"data: " + error_body("The backend stream failed.", "server_error", "upstream_error")
            await ctx.send({"type": "http.response.body", "body": body + b"\n\ndata: [DONE]\n\n", "more_body": False})
            return
        pending += chunk
        out: list[bytes] = []
        while True:
            end = pending.find(b"\n\n")
            if end < 0:
                break
            event, pending = pending[: end + 2], pending[end + 2:]
            if inspect_event(event, served, parsed.client_wants_usage):
                out.append(event)
        if out:
            if served.first_chunk_at is None:
                served.first_chunk_at = time.perf_counter()
                observe_ttft(served.first_chunk_at - ctx.started)
            if out[-1].startswith(b"data: [DONE]"):
                await ctx.run_finish()
            await ctx.send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
    await ctx.run_finish()
    await ctx.send({"type": "http.response.body", "body": pending, "more_body": False})


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
