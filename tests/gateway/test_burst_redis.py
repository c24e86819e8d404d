"""503 only when Redis is really away (issue 22): 1,000 concurrent requests on one gateway process sharing
one blocking pool of Redis connections, and one connection for the scripts, get no 503 (waiting for a
connection, or for Redis to get through the calls ahead, is not an outage); with GATEWAY_FAIL_OPEN=1 and Redis
up, the quota and the concurrency limit hold exactly."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest

from apps.gateway.redis_state import RedisStateStore

pytestmark = [pytest.mark.django_db, pytest.mark.redis, pytest.mark.slow]

BODY = {"model": "tiny-model", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 2}
BURST = 1000


def _burst(url: str, secret: str) -> list[httpx.Response]:
    async def fire() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return list(await asyncio.gather(*(
                client.post(url + "/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {secret}"})
                for _ in range(BURST))))

    return asyncio.run(fire())


def _codes(answers: list[httpx.Response]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in answers:
        key = str(r.status_code) if r.status_code == 200 else f"{r.status_code} {r.json()['error']['code']}"
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("fail_open", [False, True])
def test_a_thousand_concurrent_requests_on_one_process_get_no_503_and_limits_hold(
    fail_open: bool, gateway_factory: Any, upstream_factory: Any, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream, _ = upstream_factory(first_token_delay_s=0.05)
    quota, concurrency = 250, 8
    # Few connections for many requests: before the blocking pool, 200 requests already ran out of 100. A short
    # socket timeout: the burst queues more calls on the scripts' one connection than Redis answers in it, and a
    # timeout is Redis's silence, not a call's wait in line (CI, 2026-11-28: timed per call, the calls in flight
    # failed together at 1 s, and failing open served 1,379 tokens against the quota of 250). Not shorter: at 0.2 s
    # CI then met a 503 once the silence was timed on the loop's clock (two long turns of it in a row with Redis's
    # replies unread, test_resp.py), and a real Redis starved of CPU for that long on a shared machine is no fault.
    store = RedisStateStore(url=redis_url, prefix=f"t{uuid.uuid4().hex}:", max_connections=16, socket_timeout_s=0.5)
    h = gateway_factory(upstreams=[upstream], store=store, pool={"slots_per_replica": 64},
                        entitlement={"quota_tokens": quota, "quota_window": "day", "concurrency": concurrency},
                        config={"tokenize": False, "fail_open": fail_open})
    started = time.monotonic()
    answers = _burst(h.url, h.secret)
    elapsed = time.monotonic() - started
    codes = _codes(answers)
    served = [r for r in answers if r.status_code == 200]
    tokens = sum(int(r.json()["usage"]["total_tokens"]) for r in served)
    with capsys.disabled():
        print(f"\n{BURST} concurrent requests, one process, Redis pool of 16 connections, fail_open={fail_open}: "
              f"{codes} in {elapsed:.1f} s; served {tokens} tokens against a quota of {quota}; peak in flight at "
              f"the backend {upstream.peak} against a concurrency of {concurrency}")
    assert not any(key.startswith("503") for key in codes), (codes, {r.json()["error"]["message"] for r in answers
                                                                 if r.status_code == 503})
    assert tokens <= quota
    assert upstream.peak <= concurrency
    assert served, codes
