"""Input token counts: the pool's own tokenizer when the backend offers `/tokenize`, else an estimate.

Whether a pool's backend tokenizes is learnt on first use and cached per pool (re-probed after
`RETRY_UNSUPPORTED_S`); counts are cached per pool and prompt so repeated prompts cost no round trip. Once a
pool has tokenized a kind of request, a refusal of one request's input (a 4xx other than "no such route")
is that input's problem, not the pool's: that request is estimated and the pool keeps tokenizing, so a client
cannot switch every tenant of a pool to estimates by sending what the tokenizer refuses.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

import httpx

from apps.gateway.routing import ReplicaSet
from backends.vllm_wire import TOKENIZE_PATH, read_tokenize_response, tokenize_request

RETRY_UNSUPPORTED_S = 60.0
# The answers that say the backend has no /tokenize at all (rather than refusing one input).
NO_ROUTE_STATUSES = frozenset({404, 405, 501})
CACHE_ENTRIES = 4096
# Roughly four characters per token for English text (OpenAI's rule of thumb), plus the per-message
# framing a chat template adds.
CHARS_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict)
                       and isinstance(part.get("text", ""), str))
    return ""


def estimate_tokens(kind: str, payload: dict[str, Any]) -> int:
    if kind == "chat":
        total = 2
        for message in payload.get("messages") or ():
            if isinstance(message, dict):
                total += CHAT_TOKENS_PER_MESSAGE + len(_text_of(message.get("content"))) // CHARS_PER_TOKEN
        return total
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return max(1, len(prompt) // CHARS_PER_TOKEN)
    if isinstance(prompt, list):
        if all(isinstance(item, int) for item in prompt):
            return len(prompt)
        total = 0
        for item in prompt:
            total += len(item) if isinstance(item, list) else max(1, len(str(item)) // CHARS_PER_TOKEN)
        return total
    return 1


class TokenCounter:
    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._unsupported_until: dict[tuple[str, str], float] = {}
        # (pool, kind) whose backend has tokenized at least once: it does support this kind.
        self._supported: set[tuple[str, str]] = set()
        self._cache: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        # max_model_len as the backend reports it, per pool (None until a /tokenize answered).
        self.max_model_len: dict[str, int] = {}

    def _key(self, pool: str, kind: str, payload: dict[str, Any]) -> tuple[str, bytes]:
        source = payload.get("messages") if kind == "chat" else payload.get("prompt")
        digest = hashlib.blake2b(json.dumps(source, sort_keys=True, default=str).encode(), digest_size=16).digest()
        return pool, digest

    async def count(
        self, *, client: httpx.AsyncClient | None, pool: str, model: str, replicas: ReplicaSet, kind: str,
        payload: dict[str, Any],
    ) -> int:
        """The prompt's tokens, asked (only when the count is not cached) of the first of the pool's
        `replicas` in routing order."""
        if (not self.enabled or client is None
                or self._unsupported_until.get((pool, kind), 0.0) > time.monotonic()):
            return estimate_tokens(kind, payload)
        key = self._key(pool, kind, payload)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        urls = tuple(replicas.candidates()) or replicas.urls
        if not urls:
            return estimate_tokens(kind, payload)
        if kind == "chat":
            body = tokenize_request(model=model, messages=payload.get("messages"))
        else:
            body = tokenize_request(model=model, prompt=payload.get("prompt"))
        try:
            response = await client.post(urls[0] + TOKENIZE_PATH, json=body, timeout=2.0)
        except httpx.HTTPError:
            return estimate_tokens(kind, payload)
        if response.status_code != 200:
            # No /tokenize, or none for this kind (a model without a chat template cannot tokenize
            # messages): stop asking for a while rather than pay a failing round trip per request.
            if (pool, kind) not in self._supported or response.status_code in NO_ROUTE_STATUSES:
                self._unsupported_until[(pool, kind)] = time.monotonic() + RETRY_UNSUPPORTED_S
            return estimate_tokens(kind, payload)
        try:
            result = read_tokenize_response(response.json())
        except ValueError:
            result = None
        if result is None:
            return estimate_tokens(kind, payload)
        count = result.count
        self._supported.add((pool, kind))
        if result.max_model_len is not None:
            self.max_model_len[pool] = result.max_model_len
        self._cache[key] = count
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return count
