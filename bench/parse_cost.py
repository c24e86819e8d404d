"""What the gateway's parse step costs per request (`python -m bench.parse_cost`): `json.loads` alone, then
`parse_json` (the decoder that refuses non-finite numbers, the bracket count and, for bodies with more brackets
than GATEWAY_MAX_JSON_DEPTH, the level-by-level depth walk) and `parse_request`, on a typical 2 KB chat body and
on a 40-message one (the walk's case). Best of 7 runs of 20,000 calls, one core. Figures are printed, never
asserted."""

from __future__ import annotations

import functools
import json
import timeit
from collections.abc import Callable

from apps.gateway.parse import CHAT, parse_json, parse_request

CALLS, RUNS = 20_000, 7


def chat_body(turns: int, words: int) -> bytes:
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 12}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": "Tell me about token pools. " * words}
                 for i in range(turns)]
    return json.dumps({"model": "tiny", "max_tokens": 128, "temperature": 0.7, "top_p": 0.95, "stream": True,
                       "stream_options": {"include_usage": True}, "messages": messages}).encode()


def best_us(call: Callable[[], object]) -> float:
    return min(timeit.repeat(call, number=CALLS, repeat=RUNS)) / CALLS * 1e6


def main() -> None:
    for label, body in (("typical chat", chat_body(5, 11)), ("40-message chat", chat_body(40, 1))):
        print(f"{label} body, {len(body):,} bytes:")
        print(f"  json.loads                  {best_us(functools.partial(json.loads, body)):6.2f} us")
        print(f"  parse_json                  {best_us(functools.partial(parse_json, body)):6.2f} us")
        print(f"  parse_json + parse_request  {best_us(functools.partial(_parse_both, body)):6.2f} us")


def _parse_both(body: bytes) -> object:
    return parse_request(CHAT, parse_json(body), max_tokens_limit=10**6)


if __name__ == "__main__":
    main()
