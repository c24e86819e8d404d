"""vLLM's OpenAI-compatible HTTP surface for our engine, as a plain ASGI app served by uvicorn.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming and
`stream_options.include_usage`), GET /v1/models, POST /tokenize, POST /detokenize, GET /health,
GET /metrics. The tenant comes from the `x-tokenpools-tenant` header the gateway sets, so the engine's
per-tenant quotas apply per tenant; without it requests run as tenant "default".

    python -m backends.engine --model var/models/tiny --policy token-pd --kv-budget-mib 8 --port 8100
    python -m backends.engine.server ...          (the same)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from backends.engine.scheduler import (
    AdmissionRejectedEvent,
    CompletedEvent,
    CompletionReason,
    PrefillStrategy,
    QuotaKind,
    RejectionReason,
    SamplingParams,
    SchedulerEvent,
    TenantConfig,
    TokenEvent,
)
from backends.engine.service import Engine, EngineSettings, RequestStream
from backends.vllm_wire import METRICS_CONTENT_TYPE, TOKENIZE_PATH, error_body, tokenize_response

TENANT_HEADER = b"x-tokenpools-tenant"
# Without our gateway's header, llm-d's fairness id (the same notion: who shares fairly) names the tenant.
FALLBACK_TENANT_HEADER = b"x-llm-d-inference-fairness-id"
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.error_type = error_type
        self.headers = headers or {}


def rejection_error(event: AdmissionRejectedEvent) -> HttpError:
    retry = {"retry-after": "1", "retry-after-ms": "1000"}
    if event.reason is RejectionReason.QUEUE_FULL:
        return HttpError(
            429, f"engine queue is full: {event.detail}", "pool_contended", "rate_limit_error", retry
        )
    if event.reason is RejectionReason.TENANT_QUOTA_EXCEEDED:
        code = (
            "kv_cache_limit_exceeded" if event.quota is QuotaKind.KV_BLOCKS else "concurrency_limit_exceeded"
        )
        headers = dict(retry)
        if event.quota is QuotaKind.KV_BLOCKS and "needs" in event.detail:
            headers["x-should-retry"] = "false"  # the request alone is bigger than the tenant's KV quota
        return HttpError(
            429,
            f"tenant quota exceeded ({event.quota.value if event.quota else ''}): {event.detail}",
            code,
            "rate_limit_error",
            headers,
        )
    return HttpError(400, event.detail or event.reason.value, event.reason.value)


FINISH_REASON = {
    CompletionReason.END_OF_SEQUENCE: "stop",
    CompletionReason.MAX_TOKENS_REACHED: "length",
    CompletionReason.CANCELLED: "abort",
    CompletionReason.EVICTED: "abort",
    CompletionReason.ENGINE_ERROR: "error",
}


class IncrementalText:
    """Turns generated token ids into text deltas, holding back incomplete UTF-8 and possible stop strings."""

    def __init__(self, engine: Engine, stop: list[str]) -> None:
        self.engine = engine
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.engine.decode(self.ids)
        for stop in self.stop:
            at = text.find(stop)
            if at != -1:
                self.stopped = True
                delta, self.emitted = text[self.emitted : at], at
                return delta
        # Hold back an incomplete UTF-8 character and any suffix that could still grow into a stop string.
        settled = text.rstrip("\ufffd")
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(settled)), 0, -1):
                if settled.endswith(stop[:k]):
                    held = max(held, k)
                    break
        safe = len(settled) - held
        delta = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self.engine.decode(self.ids)
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta


class EngineApp:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        # Servers run without lifespan events (uvicorn's lifespan="off", httpx's ASGITransport) still work.
        self.engine.start()
        path = scope["path"]
        method = scope["method"]
        try:
            if method == "GET" and path == "/health":
                await self._send_bytes(send, 200, b"", "text/plain")
            elif method == "GET" and path == "/v1/models":
                await self._send_json(send, 200, self._models())
            elif method == "GET" and path == "/metrics":
                await self._send_bytes(send, 200, self.engine.metrics_text().encode(), METRICS_CONTENT_TYPE)
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                body = await self._read_json(receive)
                await self._generate(scope, receive, send, body, chat=path.endswith("chat/completions"))
            elif method == "POST" and path == TOKENIZE_PATH:
                await self._send_json(send, 200, self._tokenize(await self._read_json(receive)))
            elif method == "POST" and path == "/detokenize":
                body = await self._read_json(receive)
                await self._send_json(send, 200, {"prompt": self.engine.decode(list(body.get("tokens", [])))})
            else:
                raise HttpError(404, f"no route for {method} {path}", "not_found")
        except HttpError as error:
            await self._send_json(
                send,
                error.status,
                error_body(error.message, error_type=error.error_type, code=error.code),
                error.headers,
            )

    # ---- plumbing ----------------------------------------------------------------------------------
    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.engine.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.engine.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @staticmethod
    async def _read_json(receive: Receive) -> dict:
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HttpError(400, "client disconnected", "disconnected")
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            body = json.loads(b"".join(chunks) or b"{}")
        except json.JSONDecodeError as exc:
            raise HttpError(400, f"body is not JSON: {exc}", "invalid_json") from None
        if not isinstance(body, dict):
            raise HttpError(400, "body must be a JSON object", "invalid_json")
        return body

    @staticmethod
    async def _send_bytes(
        send: Send, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        raw_headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
        raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": raw_headers})
        await send({"type": "http.response.body", "body": body})

    async def _send_json(
        self, send: Send, status: int, payload: dict, headers: dict[str, str] | None = None
    ) -> None:
        await self._send_bytes(send, status, json.dumps(payload).encode(), "application/json", headers)

    # ---- endpoints ---------------------------------------------------------------------------------
    def _models(self) -> dict:
        engine = self.engine
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.model_name,
                    "object": "model",
                    "created": engine.created,
                    "owned_by": "tokenpools",
                    "root": engine.settings.model_dir,
                    "parent": None,
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    def _tokenize(self, body: dict) -> dict:
        if "messages" in body:
            ids = self.engine.encode(self.engine.render_chat(body["messages"]))
        elif isinstance(body.get("prompt"), str):
            ids = self.engine.encode(body["prompt"])
        else:
            raise HttpError(400, "tokenize needs 'prompt' (a string) or 'messages'", "invalid_request")
        return tokenize_response(ids, max_model_len=self.engine.max_model_len)

    @staticmethod
    def _tenant(scope: Scope) -> str:
        headers = dict(scope.get("headers", []))
        for header in (TENANT_HEADER, FALLBACK_TENANT_HEADER):
            if header in headers:
                tenant = headers[header].decode("latin-1").strip()
                if not TENANT_PATTERN.match(tenant):
                    raise HttpError(400, f"invalid {header.decode()} header", "invalid_tenant")
                return tenant
        return "default"

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "'messages' must be a non-empty list", "invalid_request")
            for message in messages:
                content = message.get("content")
                if isinstance(content, list):  # OpenAI content parts: keep the text ones
                    message["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return self.engine.encode(self.engine.render_chat(messages))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.engine.encode(prompt)
            bos = self.engine.model_config.bos_token_id
            return ids if ids or bos is None else [bos]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if max(prompt) >= self.engine.model_config.vocab_size or min(prompt) < 0:
                raise HttpError(400, "token id out of the vocabulary", "invalid_request")
            return list(prompt)
        raise HttpError(
            400,
            "'prompt' must be a string, a list of token ids, or a list with one of those",
            "invalid_request",
        )

    def _sampling(self, body: dict, prompt_len: int, chat: bool) -> tuple[SamplingParams, list[str]]:
        if body.get("n", 1) != 1:
            raise HttpError(400, "only n=1 is supported", "invalid_request")
        key = (
            "max_completion_tokens"
            if chat and body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        max_tokens = body.get(key)
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - prompt_len) if chat else 16
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise HttpError(400, "max_tokens must be a positive integer", "invalid_request")
        if prompt_len + max_tokens > self.engine.max_model_len:
            raise HttpError(
                400,
                f"This model's maximum context length is {self.engine.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                f"{max_tokens} in the "
                "completion).",
                "context_length_exceeded",
            )
        temperature = body.get("temperature")
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if body.get("top_p") is None else float(body["top_p"]),
            seed=body.get("seed"),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
        return sampling, list(stop)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, body: dict, chat: bool) -> None:
        engine = self.engine
        tenant = self._tenant(scope)
        prompt_ids = self._prompt_ids(body, chat)
        sampling, stop = self._sampling(body, len(prompt_ids), chat)
        loop = asyncio.get_running_loop()
        submitted = await asyncio.to_thread(engine.submit, tenant, prompt_ids, sampling, loop)
        if isinstance(submitted, AdmissionRejectedEvent):
            raise rejection_error(submitted)
        assert isinstance(submitted, RequestStream)
        stream = submitted
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        text = IncrementalText(engine, stop)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        finished = False
        watcher = asyncio.create_task(self._cancel_on_disconnect(receive, stream.request_id))
        try:
            if body.get("stream"):
                finished = await self._stream(send, stream, text, response_id, created, chat, include_usage)
            else:
                finished = await self._collect(send, stream, text, response_id, created, chat)
        finally:
            watcher.cancel()
            if not finished:
                await asyncio.to_thread(engine.cancel, stream.request_id)

    async def _cancel_on_disconnect(self, receive: Receive, request_id: str) -> None:
        """A client that goes away frees its batch slot and quota at once, not when generation ends."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                await asyncio.to_thread(self.engine.cancel, request_id)
                return

    async def _collect(
        self,
        send: Send,
        stream: RequestStream,
        text: IncrementalText,
        response_id: str,
        created: int,
        chat: bool,
    ) -> bool:
        pieces: list[str] = []
        completion_tokens = 0
        while True:
            event = await stream.queue.get()
            if isinstance(event, AdmissionRejectedEvent):
                raise rejection_error(event)
            if isinstance(event, TokenEvent):
                completion_tokens += 1
                pieces.append(text.push(event.token))
                if text.stopped:
                    await asyncio.to_thread(self.engine.cancel, stream.request_id)
                    finish = "stop"
                    break
                continue
            if isinstance(event, CompletedEvent):
                if event.reason is CompletionReason.ENGINE_ERROR:
                    await self._send_json(
                        send, 500, error_body(event.detail, error_type="internal_error", code="engine_error")
                    )
                    return True
                pieces.append(text.flush())
                finish = FINISH_REASON[event.reason]
                completion_tokens = max(completion_tokens, event.completion_tokens)
                break
        content = "".join(pieces)
        usage = {
            "prompt_tokens": stream.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": stream.prompt_tokens + completion_tokens,
        }
        model = self.engine.model_name
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": None,
                "finish_reason": finish,
            }
            payload = {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
            payload = {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        await self._send_json(send, 200, payload, {"x-request-id": stream.request_id})
        return True

    async def _stream(
        self,
        send: Send,
        stream: RequestStream,
        text: IncrementalText,
        response_id: str,
        created: int,
        chat: bool,
        include_usage: bool,
    ) -> bool:
        model = self.engine.model_name
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> bytes:
            if chat:
                delta_obj: dict[str, Any] = {}
                if role:
                    delta_obj["role"] = "assistant"
                if delta is not None:
                    delta_obj["content"] = delta
                choice = {"index": 0, "delta": delta_obj, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            payload = {
                "id": response_id,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if include_usage:
                payload["usage"] = None
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        first = await stream.queue.get()
        if isinstance(first, AdmissionRejectedEvent):
            raise rejection_error(first)
        headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-request-id", stream.request_id.encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        if chat:
            await write(chunk("", None, role=True))
        completion_tokens = 0
        event: SchedulerEvent = first
        pending: SchedulerEvent | None = None  # an event read ahead while merging tokens
        finish: str | None = None
        while True:
            if isinstance(event, AdmissionRejectedEvent):  # cannot follow admission; kept for safety
                rejection = rejection_error(event)
                payload = error_body(rejection.message, error_type=rejection.error_type, code=rejection.code)
                await write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                finish = "error"
                break
            if isinstance(event, TokenEvent):
                # Tokens that queued up while this stream waited for the event loop go out as one chunk,
                # as vLLM's front end does when it falls behind: a chunk per token would cost the server
                # and every client a JSON body and a write each, and the backlog would only grow.
                pieces = []
                while True:
                    completion_tokens += 1
                    pieces.append(text.push(event.token))
                    if text.stopped or stream.queue.empty():
                        break
                    following = stream.queue.get_nowait()
                    if not isinstance(following, TokenEvent):
                        pending = following
                        break
                    event = following
                delta = "".join(pieces)
                if text.stopped:
                    if delta:
                        await write(chunk(delta, None))
                    await asyncio.to_thread(self.engine.cancel, stream.request_id)
                    finish = "stop"
                    break
                if delta:
                    await write(chunk(delta, None))
            elif isinstance(event, CompletedEvent):
                if event.reason is CompletionReason.ENGINE_ERROR:
                    error = error_body(event.detail, error_type="internal_error", code="engine_error")
                    await write(b"data: " + json.dumps(error).encode() + b"\n\n")
                    finish = "error"
                    break
                tail = text.flush()
                if tail:
                    await write(chunk(tail, None))
                finish = FINISH_REASON[event.reason]
                completion_tokens = max(completion_tokens, event.completion_tokens)
                break
            if pending is not None:
                event, pending = pending, None
            else:
                event = await stream.queue.get()
        if finish != "error":
            await write(chunk(None if chat else "", finish))
        if include_usage:
            usage = {
                "prompt_tokens": stream.prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": stream.prompt_tokens + completion_tokens,
            }
            payload = {
                "id": response_id,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return True


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    from backends.engine.eviction import POLICIES
    from backends.engine.model import DTYPES

    parser.add_argument(
        "--model", required=True, help="folder with config.json, *.safetensors, tokenizer.json"
    )
    parser.add_argument("--policy", default="token-pd", choices=sorted(POLICIES))
    parser.add_argument(
        "--kv-budget-mib", type=float, default=64.0, help="the KV budget M shared by all sequences"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="max batch size (vLLM's name)")
    parser.add_argument("--max-pending", type=int, default=256)
    parser.add_argument("--prefill", choices=[s.value for s in PrefillStrategy], default="chunked")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=256)
    parser.add_argument("--tenant-max-concurrent", type=int, default=16)
    parser.add_argument("--tenant-max-blocks", type=int, default=1_000_000)
    parser.add_argument("--tenant-weight", type=float, default=1.0)
    parser.add_argument(
        "--tenants-file",
        default=None,
        help='JSON {"tenant-id": {"max_concurrent": 2, "max_blocks": 512, "weight": 2.0}, ...}',
    )
    parser.add_argument(
        "--over-quota",
        choices=["queue", "reject"],
        default="queue",
        help="a request finding its tenant at quota waits in the engine queue, or gets a 429",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="weights, activations and KV cache (bfloat16 halves the cache and, on CPUs with "
        "AVX512-BF16, runs the matmuls about 3x faster; vLLM picks it for float32 models on CPU)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--served-model-name", default=None)


def tenants_from_file(path: str | None) -> tuple[TenantConfig, ...]:
    if not path:
        return ()
    with open(path, encoding="utf-8") as handle:
        raw = json.load(handle)
    return tuple(
        TenantConfig(
            tenant_id,
            int(quota.get("max_concurrent", 16)),
            int(quota.get("max_blocks", 1_000_000)),
            float(quota.get("weight", 1.0)),
        )
        for tenant_id, quota in raw.items()
    )


def settings_from_arguments(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(
        model_dir=args.model,
        policy=args.policy,
        kv_budget_mib=args.kv_budget_mib,
        max_batch_size=args.max_num_seqs,
        max_pending_prompts=args.max_pending,
        prefill_strategy=PrefillStrategy(args.prefill),
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        device=args.device,
        dtype=args.dtype,
        served_model_name=args.served_model_name,
        default_tenant=TenantConfig(
            "default", args.tenant_max_concurrent, args.tenant_max_blocks, args.tenant_weight
        ),
        tenants=tenants_from_file(args.tenants_file),
        over_quota=args.over_quota,
    )


def serve(settings: EngineSettings, host: str, port: int, threads: int = 0) -> None:
    import uvicorn

    if threads:
        import torch

        torch.set_num_threads(threads)

    app = EngineApp(Engine(settings))
    uvicorn.run(app, host=host, port=port, log_level="warning", lifespan="on")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m backends.engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    serve(settings_from_arguments(args), args.host, args.port, args.threads)


if __name__ == "__main__":
    main()
