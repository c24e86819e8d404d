"""A minimal OpenAI-compatible backend for the gateway tests (what the gateway proxies to).

Plain ASGI, served by uvicorn on a free port (see `servers.py`). It answers completions and chat
completions (streaming with `stream_options.include_usage` as vLLM does), `/tokenize` (one token per
whitespace-separated word, vLLM's response shape), `/health`, and records what it received.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any


def prompt_tokens_of(payload: dict[str, Any]) -> int:
    """The prompt tokens this backend reports: one a word, and two more for a chat template."""
    if "messages" in payload:
        return sum(len(str(m.get("content") or "").split()) for m in payload["messages"]) + 2
    prompt = payload.get("prompt")
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, list) else 1 if isinstance(p, int) else len(p.split()) for p in prompt)
    return len(str(prompt or "").split())


@dataclass
class Upstream:
    name: str = "up"
    url: str = ""
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    healthy: bool = True
    # How long /health takes to answer (a busy backend that answers late).
    health_delay_s: float = 0.0
    tokenize: bool = True
    # /tokenize answers 400 for an input containing this word (as vLLM refuses input it cannot tokenize).
    tokenize_refuses: str | None = None
    max_model_len: int = 1024
    # Generate at most this many tokens whatever max_tokens says (like an early end-of-sequence).
    max_output: int | None = None
    # Break the connection after this many streamed tokens (a crashed backend).
    fail_after: int | None = None
    # What /metrics reports (vLLM's names); None serves no /metrics at all.
    waiting: int | None = None
    kv_usage: float = 0.0
    # Keep the response open this long after [DONE] (servers may close the stream a moment later).
    linger_after_done_s: float = 0.0
    # Answer every completion with this status, as an inference gateway that sheds it (llm-d's flow control),
    # with `x-llm-d-request-dropped-reason: shed_reason` when one is given.
    shed_status: int | None = None
    shed_reason: str | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    # The headers of each completion request received (names lower-case), in the order of `received`.
    received_headers: list[dict[str, str]] = field(default_factory=list)
    active: int = 0
    # The most requests it served at once (reset it by hand between phases of a test).
    peak: int = 0
    cancelled: int = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            await asyncio.sleep(self.health_delay_s)
            await self._json(send, 200 if self.healthy else 503, {})
            return
        if path == "/metrics":
            if self.waiting is None:
                await self._json(send, 404, {"detail": "Not Found"})
                return
            text = (f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {self.active}\n'
                    f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {self.waiting}\n'
                    f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {self.kv_usage}\n')
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": text.encode()})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        payload = json.loads(body) if body else {}
        if path == "/tokenize":
            if not self.tokenize:
                await self._json(send, 404, {"detail": "Not Found"})
                return
            try:
                count = prompt_tokens_of(payload)
                if self.tokenize_refuses is not None and self.tokenize_refuses in json.dumps(payload):
                    raise ValueError(self.tokenize_refuses)
            except (TypeError, AttributeError, ValueError):
                await self._json(send, 400, {"object": "error", "message": "malformed input"})
                return
            await self._json(send, 200, {"count": count, "max_model_len": self.max_model_len,
                                         "tokens": list(range(count))})
            return
        if path not in ("/v1/completions", "/v1/chat/completions"):
            await self._json(send, 404, {"detail": "Not Found"})
            return
        self.received.append(payload)
        self.received_headers.append({k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]})
        if self.shed_status is not None:
            headers = [(b"content-type", b"application/json")]
            if self.shed_reason is not None:
                headers.append((b"x-llm-d-request-dropped-reason", self.shed_reason.encode()))
            await send({"type": "http.response.start", "status": self.shed_status, "headers": headers})
            await send({"type": "http.response.body", "body": b'{"error": "shed"}'})
            return
        if not isinstance(payload.get("max_tokens"), int):
            await self._json(send, 400, {"object": "error", "message": "max_tokens required by this test backend"})
            return
        chat = path.endswith("chat/completions")
        try:
            prompt_tokens = prompt_tokens_of(payload)
        except (TypeError, AttributeError, ValueError):
            await self._json(send, 400, {"object": "error", "message": "malformed input"})
            return
        n = payload["max_tokens"] if self.max_output is None else min(payload["max_tokens"], self.max_output)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if payload.get("stream"):
                # Like vLLM, stop generating when the caller goes away.
                task = asyncio.current_task()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    if task is not None:
                        task.cancel()

                watcher = asyncio.create_task(watch())
                try:
                    await self._stream(send, receive, payload, chat, n, usage)
                finally:
                    watcher.cancel()
            else:
                # Like vLLM (`with_cancellation`), a non-streamed request is aborted when its caller goes away.
                task = asyncio.current_task()

                async def watch_plain() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    if task is not None:
                        task.cancel()

                watcher = asyncio.create_task(watch_plain())
                try:
                    await asyncio.sleep(self.first_token_delay_s + n * self.token_delay_s)
                finally:
                    watcher.cancel()
                text = " ".join(f"t{i}" for i in range(n))
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": text, "finish_reason": "length"})
                await self._json(send, 200, {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                                             "created": int(time.time()), "model": payload.get("model"),
                                             "choices": [choice], "usage": usage})
        except asyncio.CancelledError:
            self.cancelled += 1  # the caller went away (our own watcher cancelled the stream)
        finally:
            self.active -= 1

    async def _stream(self, send: Any, receive: Any, payload: dict[str, Any], chat: bool, n: int,
                      usage: dict[str, int]) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        await asyncio.sleep(self.first_token_delay_s)
        for i in range(n):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("backend crashed mid-stream (test)")
            if i:
                await asyncio.sleep(self.token_delay_s)
            delta = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None} if chat else {
                "index": 0, "text": f"t{i} ", "finish_reason": None}
            chunk = {"id": "c", "object": "chat.completion.chunk" if chat else "text_completion",
                     "model": payload.get("model"), "choices": [delta]}
            if include_usage:
                chunk["usage"] = None
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
        if include_usage:
            final: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "model": payload.get("model"), "choices": [],
                     "usage": usage}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(final).encode() + b"\n\n",
                        "more_body": True})
        if self.linger_after_done_s:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
            await asyncio.sleep(self.linger_after_done_s)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    @staticmethod
    async def _json(send: Any, status: int, data: dict[str, Any]) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(data).encode()})
