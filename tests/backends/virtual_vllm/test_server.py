"""The virtual vLLM server, started in a subprocess on a free port and driven with httpx."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backends.virtual_vllm",
            "--port",
            str(port),
            "--max-num-seqs",
            "2",
            "--latency-model",
            "fixed",
            "--prefill-ms-per-token",
            "1",
            "--decode-ms-per-token",
            "10",
            "--served-model-name",
            "tiny",
        ],  # fmt: skip
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(
                f"virtual vLLM did not start: {process.stdout.read().decode() if process.stdout else ''}"
            )
        time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(timeout=10)


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def test_models_health_and_tokenize(server):
    models = httpx.get(f"{server}/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    tokens = httpx.post(f"{server}/tokenize", json={"model": "tiny", "prompt": "hello, world"}).json()
    assert tokens["count"] == 3 and len(tokens["tokens"]) == 3


def test_completion_returns_max_tokens_with_usage_and_takes_the_modelled_time(server):
    started = time.monotonic()
    body = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "one two three", "max_tokens": 20},
                      timeout=10).json()  # fmt: skip
    elapsed = time.monotonic() - started
    assert body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23}
    assert len(body["choices"][0]["text"].split()) == 20
    assert body["choices"][0]["finish_reason"] == "length"
    # 3 ms of prefill, then 19 decode steps of 10 ms: never faster than the model says.
    assert elapsed >= 0.19


def test_chat_stream_sends_role_then_tokens_then_usage_then_done(server):
    chunks = []
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=10, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True},
    }) as response:  # fmt: skip
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: ") :])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert len(text.split()) == 6
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


def test_slots_limit_running_and_the_rest_wait(server):
    import threading

    def long_request() -> None:
        httpx.post(
            f"{server}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 150}, timeout=20
        )

    threads = [threading.Thread(target=long_request) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    during = metrics(server)
    for thread in threads:
        thread.join()
    assert during["vllm:num_requests_running"] == 2
    assert during["vllm:num_requests_waiting"] == 1
    assert 0 < during["vllm:kv_cache_usage_perc"] < 1
    after = metrics(server)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


def test_a_client_that_disconnects_frees_its_slot(server):
    with httpx.stream("POST", f"{server}/v1/completions", timeout=10,
                      json={"model": "tiny", "prompt": "x", "max_tokens": 500, "stream": True}) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 5
    while metrics(server)["vllm:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(server)["vllm:num_requests_running"] == 0


@pytest.mark.parametrize(
    ("path", "payload", "status"),
    [
        ("/v1/completions", {"model": "other", "prompt": "x"}, 404),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400),
        ("/v1/chat/completions", {"model": "tiny", "messages": "nope"}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 100_000}, 400),
    ],
)
def test_bad_requests_get_vllm_style_errors(server, path, payload, status):
    response = httpx.post(f"{server}{path}", json=payload)
    assert response.status_code == status
    error = response.json()["error"]  # vLLM's ErrorResponse: the status in `code`, the class name in `type`
    assert error["code"] == status and error["message"] and error["type"].endswith("Error")


def test_concurrency_report_counts_requests_in_flight_per_user_and_their_peak(server):
    """/virtual/concurrency: what a gateway test reads at the backend. A request waiting for a slot is in flight
    too (the gateway sent it); the report goes back to zero in flight, the peaks stay."""
    import threading
    import uuid

    first, second = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"

    def request(user: str) -> None:
        httpx.post(f"{server}/v1/completions", timeout=20,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 30, "user": user})  # fmt: skip

    threads = [threading.Thread(target=request, args=(user,)) for user in (first, first, first, second)]
    for thread in threads:
        thread.start()
    time.sleep(0.15)
    during = httpx.get(f"{server}/virtual/concurrency").json()
    for thread in threads:
        thread.join()
    after = httpx.get(f"{server}/virtual/concurrency").json()
    assert during["in_flight_by_user"][first] == 3 and during["in_flight_by_user"][second] == 1
    assert during["in_flight"] >= 4
    assert after["in_flight_by_user"][first] == 0 and after["in_flight_by_user"][second] == 0
    assert after["peak_by_user"][first] == 3 and after["peak_by_user"][second] == 1
    assert after["peak"] >= 4
