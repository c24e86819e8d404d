"""A virtual vLLM server: vLLM's OpenAI API and /metrics names, timed in real time by the instance model
the simulator runs in virtual time (continuous batching, KV blocks, preemption; roofline or fixed step
times). No model, no GPU. Started by `python -m backends.virtual_vllm` or `python manage.py virtual_vllm`
(flags in `backends.virtual_vllm.cli`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE streaming with `stream_options.include_usage`),
GET /v1/models, POST /tokenize, GET /health, GET /metrics, and GET /virtual/concurrency (not vLLM's: the completion
requests in flight now and the most at once since start, in total and per the body's `user` field, so that a
test can check a gateway's concurrency limits at the backend itself). Generated text is filler ("tok0 tok1 ..."); every
request produces exactly `max_tokens` tokens (as with `ignore_eos`). Prompt tokens are words and punctuation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from backends import vllm_wire
from backends.virtual_vllm.instance import Instance, SimRequest
from backends.virtual_vllm.spec import InstanceSpec, build_latency

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_WORDS = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> list[int]:
    """Stand-in tokenizer: one token per word or punctuation mark, ids from a stable hash."""
    return [sum(ord(ch) * 31**i for i, ch in enumerate(word[:8])) % 150_000 for word in _WORDS.findall(text)]


class RealTimeLoop:
    """The instance's loop interface (`time`, `at`, `after`) on asyncio: virtual seconds = real seconds
    times `time_scale` since start."""

    def __init__(self, time_scale: float = 1.0) -> None:
        self.aio = asyncio.get_running_loop()
        self.origin = self.aio.time()
        self.time_scale = time_scale

    @property
    def time(self) -> float:
        return (self.aio.time() - self.origin) * self.time_scale

    def now(self) -> float:
        return self.time

    def at(self, when: float, callback: Callable[..., Any], *args: Any, daemon: bool = False) -> None:
        self.aio.call_at(self.origin + when / self.time_scale, callback, *args)

    def after(self, delay: float, callback: Callable[..., Any], *args: Any, daemon: bool = False) -> None:
        self.at(self.time + delay, callback, *args)


# A stream waiting on an idle engine looks again this often; one waiting on a step looks this long after
# the step's end (the engine's step-end callback runs at that instant on the same event loop).
IDLE_POLL_S = 0.005
STEP_END_SLACK_S = 0.001


@dataclass
class ServerConfig:
    model: str = "virtual-vllm"
    max_model_len: int = 8192
    default_max_tokens: int = 128
    time_scale: float = 1.0
    instance: InstanceSpec = field(default_factory=lambda: InstanceSpec(latency_model="fixed", max_num_seqs=16))


@dataclass
class _Tracked:
    request: SimRequest
    done: asyncio.Event


class VirtualVllm:
    """The ASGI application. The instance is created on the first request, inside the server's event loop."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        latency, kv_blocks = build_latency(config.instance)
        self.latency = latency
        self.kv_blocks = kv_blocks
        self.instance: Instance | None = None
        self.loop: RealTimeLoop | None = None
        self.tracked: dict[int, _Tracked] = {}
        self.next_id = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.success_total = 0
        self.aborted_total = 0
        self.started = int(time.time())
        # Completion requests between their arrival and their answer's end: now and the most at once.
        self.in_flight: dict[str, int] = {}
        self.peak_in_flight: dict[str, int] = {}
        self.in_flight_total = 0
        self.peak_in_flight_total = 0

    def _ensure_instance(self) -> Instance:
        if self.instance is None:
            self.loop = RealTimeLoop(self.config.time_scale)
            spec = self.config.instance
            self.instance = Instance(
                0,
                self.loop,
                self.latency,
                max_num_seqs=spec.max_num_seqs,
                kv_blocks=self.kv_blocks,
                block_size=spec.block_size,
                max_batched_tokens=spec.max_batched_tokens,
                on_finish=self._finished,
                on_lost=self._lost,
            )
        return self.instance

    def _finished(self, request: SimRequest) -> None:
        self.success_total += 1
        self.generation_tokens_total += request.output_tokens
        tracked = self.tracked.get(request.rid)
        if tracked is not None:
            tracked.done.set()

    def _lost(self, request: SimRequest, reason: str) -> None:
        tracked = self.tracked.get(request.rid)
        if tracked is not None:
            tracked.done.set()

    # ---- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            if path == "/health" and method == "GET":
                await _respond(send, 200, b"", "text/plain")
            elif path == "/v1/models" and method == "GET":
                await _json(send, 200, self._models())
            elif path == "/virtual/concurrency" and method == "GET":
                await _json(send, 200, self.concurrency())
            elif path == "/metrics" and method == "GET":
                await _respond(send, 200, self.metrics_text().encode(), vllm_wire.METRICS_CONTENT_TYPE)
            elif path in ("/v1/completions", "/v1/chat/completions", vllm_wire.TOKENIZE_PATH) and method == "POST":
                body = await _read_body(receive)
                try:
                    payload = json.loads(body or b"{}")
                except json.JSONDecodeError as error:
                    await _error(send, 400, f"invalid JSON body: {error.msg}")
                    return
                if not isinstance(payload, dict):
                    await _error(send, 400, "the body must be a JSON object")
                    return
                if path == vllm_wire.TOKENIZE_PATH:
                    await self._tokenize(send, payload)
                else:
                    await self._generate(
                        scope, receive, send, payload, chat=path.endswith("chat/completions")
                    )
            elif path in (
                "/health",
                "/v1/models",
                "/metrics",
                "/virtual/concurrency",
                "/v1/completions",
                "/v1/chat/completions",
                vllm_wire.TOKENIZE_PATH,
            ):
                await _error(send, 405, f"method {method} not allowed on {path}", "MethodNotAllowed")
            else:
                await _error(send, 404, f"no route for {path}", "NotFoundError")
        except _ClientGone:
            return

    def _models(self) -> dict[str, Any]:
        model = self.config.model
        return {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": self.started,
                    "owned_by": "vllm",
                    "root": model,
                    "parent": None,
                    "max_model_len": self.config.max_model_len,
                }
            ],  # fmt: skip
        }

    def concurrency(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight_total, "peak": self.peak_in_flight_total,
                "in_flight_by_user": dict(self.in_flight), "peak_by_user": dict(self.peak_in_flight)}  # fmt: skip

    def _enter(self, user: str) -> None:
        self.in_flight_total += 1
        self.peak_in_flight_total = max(self.peak_in_flight_total, self.in_flight_total)
        self.in_flight[user] = self.in_flight.get(user, 0) + 1
        self.peak_in_flight[user] = max(self.peak_in_flight.get(user, 0), self.in_flight[user])

    def _leave(self, user: str) -> None:
        self.in_flight_total -= 1
        self.in_flight[user] -= 1

    def metrics_text(self) -> str:
        instance = self.instance
        spec = self.config.instance
        stats = vllm_wire.VllmStats(
            model_name=self.config.model,
            running=len(instance.running) if instance else 0,
            waiting=len(instance.waiting) if instance else 0,
            kv_usage=instance.kv_utilization if instance else 0.0,
            cache_config={"block_size": spec.block_size, "cache_dtype": "auto", "gpu_memory_utilization": "0.9",
                          "num_gpu_blocks": self.kv_blocks, "num_cpu_blocks": 0, "model_name": self.config.model},
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            preemptions=instance.preemptions if instance else 0,
            # Every request runs to max_tokens (as with ignore_eos), so every success is a "length" finish.
            success_by_reason={"length": self.success_total},
        )  # fmt: skip
        return vllm_wire.exposition(vllm_wire.vllm_metric_lines(stats))

    async def _tokenize(self, send: Send, payload: dict[str, Any]) -> None:
        text = _prompt_text(payload)
        if text is None:
            await _error(send, 400, "give 'prompt' (a string) or 'messages'")
            return
        await _json(send, 200, vllm_wire.tokenize_response(count_tokens(text), max_model_len=self.config.max_model_len))

    async def _generate(
        self, scope: Scope, receive: Receive, send: Send, payload: dict[str, Any], chat: bool
    ) -> None:
        model = payload.get("model", self.config.model)
        if model != self.config.model:
            await _error(send, 404, f"The model `{model}` does not exist.", "NotFoundError")
            return
        text = _prompt_text(payload, chat=chat)
        if text is None:
            await _error(
                send,
                400,
                "'messages' must be a list of {role, content}" if chat else "'prompt' must be a string",
            )
            return
        prompt_tokens = max(1, len(count_tokens(text)))
        max_tokens = payload.get(
            "max_completion_tokens", payload.get("max_tokens", self.config.default_max_tokens)
        )
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            await _error(send, 400, f"max_tokens must be a positive integer, got {max_tokens!r}")
            return
        if prompt_tokens + max_tokens > self.config.max_model_len:
            await _error(send, 400, f"This model's maximum context length is {self.config.max_model_len} tokens. "
                                    f"However, you requested {prompt_tokens + max_tokens} tokens "
                                    f"({prompt_tokens} in the messages, {max_tokens} in the completion).")  # fmt: skip
            return
        stream = bool(payload.get("stream", False))
        options = payload.get("stream_options") or {}
        include_usage = bool(options.get("include_usage", False)) if isinstance(options, dict) else False

        instance = self._ensure_instance()
        assert self.loop is not None
        self.next_id += 1
        request = SimRequest(
            self.next_id, str(payload.get("user", "")), prompt_tokens, max_tokens, self.loop.time
        )
        tracked = _Tracked(request, asyncio.Event())
        self.tracked[request.rid] = tracked
        self.prompt_tokens_total += prompt_tokens
        self._enter(request.tenant)
        instance.enqueue(request)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
        }
        try:
            if not stream:
                await self._wait_or_disconnect(tracked, receive)
                if request.finished_at is None:
                    await _error(
                        send, 503, "the request was dropped by the engine", "ServiceUnavailableError"
                    )
                    return
                content = _filler(0, max_tokens)
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": content, "tool_calls": []},
                              "logprobs": None, "finish_reason": "length", "stop_reason": None}  # fmt: skip
                else:
                    choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": "length",
                              "stop_reason": None}  # fmt: skip
                await _json(send, 200, {"id": ident, "object": "chat.completion" if chat else "text_completion",
                                        "created": created, "model": model, "choices": [choice], "usage": usage})  # fmt: skip
                return
            await self._stream(send, receive, tracked, ident, created, model, chat, include_usage, usage)
        finally:
            self._leave(request.tenant)
            self.tracked.pop(request.rid, None)
            if request.finished_at is None:
                self.aborted_total += 1
                instance.abort(request)

    async def _wait_or_disconnect(self, tracked: _Tracked, receive: Receive) -> None:
        waiter = asyncio.ensure_future(tracked.done.wait())
        listener = asyncio.ensure_future(_disconnected(receive))
        done, _ = await asyncio.wait({waiter, listener}, return_when=asyncio.FIRST_COMPLETED)
        for task in (waiter, listener):
            if task not in done:
                task.cancel()
        if listener in done:
            raise _ClientGone

    def _until_next_token(self, instance: Instance) -> float:
        """Real seconds to sleep before a stream looks for new tokens: until just after the step in progress
        ends. (Sleeping a whole step from whenever the stream last looked put each token out up to a step late,
        half a step on average for a request arriving at a random instant, which the simulator does not do.)"""
        assert self.loop is not None
        ends = instance.next_step_end()
        if ends is None:
            return IDLE_POLL_S
        return max(0.0, ends - self.loop.time) / self.config.time_scale + STEP_END_SLACK_S

    async def _stream(self, send: Send, receive: Receive, tracked: _Tracked, ident: str, created: int, model: str,
                      chat: bool, include_usage: bool, usage: dict[str, int]) -> None:  # fmt: skip
        instance = self.instance
        assert instance is not None
        request = tracked.request
        kind = "chat.completion.chunk" if chat else "text_completion"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})  # fmt: skip

        async def event(data: dict[str, Any] | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data)
            await send(
                {"type": "http.response.body", "body": f"data: {text}\n\n".encode(), "more_body": True}
            )

        def chunk(piece: str, finish: str | None, first: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = (
                    {"role": "assistant", "content": piece} if first else {"content": piece}
                )
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
            body: dict[str, Any] = {
                "id": ident,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if include_usage:
                body["usage"] = None
            return body

        disconnect = asyncio.ensure_future(_disconnected(receive))
        try:
            if chat:
                await event(chunk("", None, first=True))
            sent = 0
            total = request.output_tokens
            while sent < total:
                if disconnect.done():
                    raise _ClientGone
                produced = instance.tokens_generated(request)
                if produced > sent:
                    last = produced >= total
                    await event(chunk(_filler(sent, produced), "length" if last else None))
                    sent = produced
                    continue
                if tracked.done.is_set() and request.finished_at is None:
                    break  # dropped by the engine (e.g. a prompt larger than the KV cache)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(tracked.done.wait()), timeout=self._until_next_token(instance))
            if include_usage and sent >= total:
                await event({"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                             "usage": usage})  # fmt: skip
            await event("[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            disconnect.cancel()


class _ClientGone(Exception):
    pass


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _filler(start: int, stop: int) -> str:
    return "".join(f"tok{i % 1000} " for i in range(start, stop))


def _prompt_text(payload: dict[str, Any], chat: bool | None = None) -> str | None:
    if chat is not False and "messages" in payload:
        messages = payload["messages"]
        if not isinstance(messages, list):
            return None
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = message.get("content", "")
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role', 'user')}: {content}")
        return "\n".join(parts)
    if chat:
        return None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompt = " ".join(prompt)
    return prompt if isinstance(prompt, str) else None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes, content_type: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type.encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, payload: Any) -> None:
    await _respond(send, status, json.dumps(payload).encode(), "application/json")


async def _error(send: Send, status: int, message: str, kind: str = "BadRequestError") -> None:
    # As vLLM does: the HTTP status in `code`, the error's class name in `type`.
    await _json(send, status, vllm_wire.error_body(message, error_type=kind, code=status))
