"""Validation of `/v1/*` request bodies: everything the gateway relies on, checked before admission.

Anything the gateway does not interpret passes through to the backend untouched; what it does
interpret (model, max_tokens, stream, stream_options, n, messages/prompt) must be well-formed, so a
malformed body is a 400 here and never reaches the state store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from apps.gateway.errors import invalid_request

CHAT = "chat"
COMPLETION = "completion"


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: str
    payload: dict[str, Any]
    model: str
    max_tokens: int | None
    stream: bool
    client_wants_usage: bool


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise invalid_request("We could not parse the JSON body of your request.") from None
    if not isinstance(payload, dict):
        raise invalid_request("The request body must be a JSON object.")
    return payload


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
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_int(p) and p >= 0 for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt):
            return
    raise invalid_request("'prompt' must be a string, an array of strings or an array of token ids.", param="prompt")


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
    """The body sent to the backend: its model name, the reserved max_tokens, usage asked on streams."""
    body = dict(parsed.payload)
    body["model"] = model
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = max_tokens
    if parsed.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return json.dumps(body).encode()
