"""The parse step: read the body, and validate everything the gateway relies on before admission.

Anything the gateway does not interpret passes through to the backend untouched; what it does
interpret (model, max_tokens, stream, stream_options, n, messages/prompt, and the llm-d headers) must be
well-formed, so a malformed request is a 400 here and never reaches the state store. Text that cannot be
encoded (a lone surrogate escaped as `\\ud800`) is malformed too: it could not be counted nor sent.

The body is bounded before anything is reserved: nesting deeper than `GATEWAY_MAX_JSON_DEPTH` (every later step
that walks or re-encodes the body recurses, and Python's recursion limit would make that a 500), non-finite
numbers (`NaN`, `Infinity`, `1e999`: not JSON, a backend would reject what we forwarded), and prompt batches
(a list of several prompts: admission reserves and charges one sequence per request, as for `n`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from apps.gateway.context import ClientGone, RequestContext
from apps.gateway.errors import body_too_large, invalid_request
from apps.policy import DEFAULT_SLO_PRIORITIES, known_slo_tier

CHAT = "chat"
COMPLETION = "completion"
DEFAULT_MAX_JSON_DEPTH = 32


class _NonFinite(ValueError):
    """A number JSON cannot carry (`NaN`, `Infinity`, or a literal too large for a float)."""


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(text)
    return value


# One decoder for every request (json.loads with hooks would build a new one per call). parse_float only runs
# for numbers with a fraction or exponent: a chat body has a few (temperature, top_p).
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: str
    payload: dict[str, Any]
    model: str
    max_tokens: int | None
    stream: bool
    client_wants_usage: bool


async def read_body(ctx: RequestContext, limit: int) -> bytes:
    declared = ctx.header(b"content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise body_too_large(limit)
        except ValueError:
            raise invalid_request("Invalid Content-Length header.") from None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await ctx.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def parse_json(body: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict[str, Any]:
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        payload = _DECODER.decode(text)
    except _NonFinite as exc:
        raise invalid_request(f"The JSON body contains the non-finite number {str(exc)[:20]}; "
                              "numbers must be finite.") from None
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError):
        raise invalid_request("We could not parse the JSON body of your request.") from None
    if not isinstance(payload, dict):
        raise invalid_request("The request body must be a JSON object.")
    # A body cannot nest deeper than it has brackets: counting them (C speed) spares ordinary bodies the walk.
    if body.count(b"[") + body.count(b"{") > max_depth and _deeper_than(payload, max_depth):
        raise _too_deep(max_depth)
    # JSON may escape a lone UTF-16 surrogate (\\ud800), which no UTF-8 text can hold: the gateway could
    # neither count it nor forward it. Only bodies that contain such an escape pay for the check.
    if b"\\u" in body and (b"\\ud" in body.lower()):
        _check_encodable(payload, "body")
    return payload


def _too_deep(max_depth: int) -> Exception:
    return invalid_request(f"The JSON body is nested too deeply: at most {max_depth} levels of arrays and "
                           "objects are accepted (GATEWAY_MAX_JSON_DEPTH).")


def _deeper_than(payload: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels (the body itself is level 1). Level by level,
    not recursive: the check itself cannot hit the recursion limit, and it is about twice as fast."""
    level: list[Any] = [payload]
    for _ in range(limit):
        deeper: list[Any] = []
        add = deeper.append
        for value in level:
            for child in (value.values() if type(value) is dict else value):
                kind = type(child)
                if kind is dict or kind is list:
                    add(child)
        if not deeper:
            return False
        level = deeper
    return True


def _check_encodable(value: Any, where: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid_request(f"{where} contains text that is not valid Unicode (a lone surrogate).",
                                  param=where.split("[")[0].split(".")[0] if where != "body" else None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key, where)
            _check_encodable(item, str(key) if where == "body" else f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_encodable(item, f"{where}[{index}]")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array.", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid_request(f"messages[{index}] must be an object with a string 'role'.", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise invalid_request(f"messages[{index}].content must be a string or an array.", param="messages")


def _check_prompt(prompt: Any) -> None:
    """One prompt: a string, token ids, or a list holding one of those. A batch of several prompts is refused
    like `n` other than 1: the reservation and the charge are sized for one sequence per request."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(_is_int(p) and p >= 0 for p in prompt):
            return
        if all(isinstance(p, str) for p in prompt) or all(
            isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt
        ):
            if len(prompt) == 1:
                return
            raise invalid_request(
                f"'prompt' holds {len(prompt)} prompts; this gateway takes one prompt per request "
                "(send one request for each).", param="prompt", code="unsupported_parameter")
    raise invalid_request("'prompt' must be a string, an array of token ids, or an array holding one of those.",
                          param="prompt")


def parse_request(kind: str, payload: dict[str, Any], *, max_tokens_limit: int) -> ParsedRequest:
    model = payload.get("model")
    if model is None:
        raise invalid_request("You must provide a model parameter.", param="model")
    if not isinstance(model, str) or not model.strip():
        raise invalid_request("'model' must be a non-empty string.", param="model")
    if kind == CHAT:
        _check_messages(payload.get("messages"))
    else:
        _check_prompt(payload.get("prompt"))

    max_tokens: int | None = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = payload.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise invalid_request(f"'{name}' must be a positive integer.", param=name, code="max_tokens_invalid")
        if value > max_tokens_limit:
            raise invalid_request(
                f"'{name}' must be at most {max_tokens_limit}.", param=name, code="max_tokens_invalid"
            )
        max_tokens = value if max_tokens is None else min(max_tokens, value)

    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid_request("'stream' must be a boolean.", param="stream")
    options = payload.get("stream_options")
    wants_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid_request("'stream_options' must be an object.", param="stream_options")
        include = options.get("include_usage", False)
        if include is not None and not isinstance(include, bool):
            raise invalid_request("'stream_options.include_usage' must be a boolean.", param="stream_options")
        wants_usage = bool(include)
    # One choice per request: the reservation and the accounting are sized for one sequence.
    for name in ("n", "best_of"):
        value = payload.get(name)
        if value is not None and (not _is_int(value) or value != 1):
            raise invalid_request(f"'{name}' other than 1 is not supported by this gateway.", param=name,
                                  code="unsupported_parameter")
    return ParsedRequest(kind, payload, model, max_tokens, stream, wants_usage)


def upstream_body(parsed: ParsedRequest, *, model: str, max_tokens: int) -> bytes:
    """The body sent to the backend: its model name, the reserved max_tokens, usage asked on streams, and no
    client `priority`."""
    body = dict(parsed.payload)
    body["model"] = model
    # vLLM's own scheduler orders by `priority` under --scheduling-policy priority: a client must not pick its
    # place there either (nothing a client sends raises its standing; the gateway has already ordered it).
    body.pop("priority", None)
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = max_tokens
    if parsed.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return json.dumps(body).encode()


def slo_hints(ctx: RequestContext) -> tuple[float | None, str | None]:
    """The llm-d headers a client may set for itself: a TTFT target (`x-llm-d-slo-ttft-ms`, ignored when
    not a positive number) and an objective tier (`x-llm-d-inference-objective`, a 400 when unknown). Both
    can only relax what the entitlement grants (`apps.policy.admission.admit`): a looser target, a tier of
    no higher priority; a tighter ask counts for nothing."""
    slo_ms: float | None = None
    raw = ctx.header(b"x-llm-d-slo-ttft-ms")
    if raw is not None:
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        slo_ms = value if 0 < value < 1e9 else None
    tier = ctx.header(b"x-llm-d-inference-objective")
    if tier is None or not tier.strip():
        return slo_ms, None
    known = known_slo_tier(tier)
    if known is None:
        raise invalid_request(f"Unknown x-llm-d-inference-objective {tier.strip()[:40]!r}; known objectives: "
                              f"{', '.join(DEFAULT_SLO_PRIORITIES)}.", param="x-llm-d-inference-objective")
    return slo_ms, known
