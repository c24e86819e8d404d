from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.services import free_port, wait_for_port

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir) -> Iterator[str]:
    """`manage.py engine` in a subprocess, with a KV budget large enough that nothing is evicted."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "engine",
            "--model",
            str(tiny_model_dir),
            "--policy",
            "token-pd",
            "--kv-budget-mib",
            "8",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--tenant-max-concurrent",
            "2",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(port, timeout_s=60, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def offline_greedy(model_dir: Path, prompt_ids: list[int], steps: int) -> list[int]:
    from backends.engine.model import LlamaModel, SequenceCache

    model = LlamaModel(model_dir, num_slots=len(prompt_ids) + steps, device="cpu")
    seq = SequenceCache(row=0)
    logits = model.forward([seq], [prompt_ids]).logits[0]
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model.forward([seq], [[out[-1]]]).logits[0]
    return out


def sse_payloads(response: httpx.Response) -> list[dict | str]:
    payloads: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def test_health_models_and_tokenize(engine_url, tiny_model_dir):
    assert httpx.get(f"{engine_url}/health").status_code == 200
    models = httpx.get(f"{engine_url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == tiny_model_dir.name
    tokenized = httpx.post(f"{engine_url}/tokenize", json={"prompt": "import os"}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    back = httpx.post(f"{engine_url}/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert back["prompt"] == "import os"


def test_greedy_completion_matches_offline_decoding_and_streaming_matches_whole(engine_url, tiny_model_dir):
    from tokenizers import Tokenizer

    prompt_ids = [5, 77, 300, 41, 9, 128]
    body = {"prompt": prompt_ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{engine_url}/v1/completions", json=body, timeout=30).json()
    expected_ids = offline_greedy(tiny_model_dir, prompt_ids, 10)
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert whole["choices"][0]["text"] == tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": 6, "completion_tokens": 10, "total_tokens": 16}

    with httpx.stream(
        "POST",
        f"{engine_url}/v1/completions",
        timeout=30,
        json=body | {"stream": True, "stream_options": {"include_usage": True}},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = [p for p in payloads[:-1] if p["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert payloads[-2]["usage"]["completion_tokens"] == 10


def test_chat_completion_streams_role_then_content(engine_url):
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=30).json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream(
        "POST", f"{engine_url}/v1/chat/completions", json=body | {"stream": True}, timeout=30
    ) as r:
        payloads = sse_payloads(r)
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads[:-1])
    assert content == whole["choices"][0]["message"]["content"]
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string_ends_the_completion_early(engine_url):
    body = {"prompt": [5, 77, 300], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{engine_url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip("the random model produced no usable stop string")
    cut = httpx.post(f"{engine_url}/v1/completions", json=body | {"stop": [stop]}, timeout=30).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == full[: full.index(stop)]


def test_tenants_from_header_get_their_own_quota_and_show_in_metrics(engine_url):
    results = []

    def call(tenant: str) -> None:
        response = httpx.post(
            f"{engine_url}/v1/completions",
            headers={"x-tokenpools-tenant": tenant},
            json={"prompt": "def f(x):", "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        results.append(response.status_code)

    threads = [threading.Thread(target=call, args=(tenant,)) for tenant in ("acme", "acme", "acme", "globex")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [200, 200, 200, 200]  # over-quota requests wait in the engine queue, they are not lost
    metrics = httpx.get(f"{engine_url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "tokenpools_engine_token_pd_mu",
        "tokenpools_engine_tokens_evicted_total",
    ):
        assert name in metrics
    assert 'tokenpools_engine_tenant_active{tenant="acme"} 0' in metrics
    assert 'tokenpools_engine_tenant_active{tenant="globex"} 0' in metrics
    bad = httpx.post(
        f"{engine_url}/v1/completions", headers={"x-tokenpools-tenant": 'bad tenant"'}, json={"prompt": "x"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_tenant"


def test_context_length_and_bad_requests_are_openai_errors(engine_url):
    too_long = httpx.post(f"{engine_url}/v1/completions", json={"prompt": [5] * 10, "max_tokens": 5000})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.post(f"{engine_url}/v1/completions", content=b"{not json").status_code == 400
    assert httpx.get(f"{engine_url}/v1/nothing").status_code == 404


def test_openai_sdk_client(engine_url, tiny_model_dir):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{engine_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert model == tiny_model_dir.name
    completion = client.completions.create(model=model, prompt="import", max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens <= 5 and completion.choices[0].finish_reason in (
        "stop",
        "length",
    )
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert whole.choices[0].message.content == text


def test_queue_full_is_a_429_with_retry_after(tiny_model_dir):
    import asyncio

    from backends.engine.server import EngineApp
    from backends.engine.service import Engine, EngineSettings

    engine = Engine(EngineSettings(model_dir=str(tiny_model_dir), max_pending_prompts=0, kv_budget_mib=1))

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=EngineApp(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})

    response = asyncio.run(scenario())
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "pool_contended"


def test_client_disconnect_cancels_the_request_and_frees_the_tenant(engine_url):
    body = {"prompt": "def f(x):", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"x-tokenpools-tenant": "leaver"}
    with httpx.stream(
        "POST", f"{engine_url}/v1/completions", json=body, headers=headers, timeout=30
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{engine_url}/metrics").text
        if 'tokenpools_engine_tenant_active{tenant="leaver"} 0' in metrics:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the request kept running after its client left")
    assert 'finished_reason="cancelled"' in metrics


def test_over_quota_requests_get_a_429_in_reject_mode(tiny_model_dir):
    from backends.engine.scheduler import TenantConfig
    from backends.engine.server import EngineApp
    from backends.engine.service import Engine, EngineSettings

    engine = Engine(
        EngineSettings(
            model_dir=str(tiny_model_dir),
            kv_budget_mib=1,
            over_quota="reject",
            tenants=(TenantConfig("solo", max_concurrent=1, max_blocks=1000),),
        )
    )

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=EngineApp(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as client:
            # The first request runs long enough that the second always finds the tenant at its quota.
            long = {"prompt": "x = 1", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
            short = {"prompt": "x = 1", "max_tokens": 4, "temperature": 0}
            headers = {"x-tokenpools-tenant": "solo"}
            first = asyncio.create_task(client.post("/v1/completions", json=long, headers=headers))
            await asyncio.sleep(0.3)
            second = asyncio.create_task(client.post("/v1/completions", json=short, headers=headers))
            return await asyncio.gather(first, second)

    try:
        responses = asyncio.run(scenario())
    finally:
        engine.stop()
    assert [r.status_code for r in responses] == [200, 429]
    rejected = responses[1]
    assert rejected.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert "retry-after" in rejected.headers
    assert engine.scheduler.tenant_state("solo").active_count == 0


def test_a_failing_engine_step_ends_requests_with_a_500_and_the_engine_keeps_serving(tiny_model_dir):
    from backends.engine.server import EngineApp
    from backends.engine.service import Engine, EngineSettings

    engine = Engine(EngineSettings(model_dir=str(tiny_model_dir), kv_budget_mib=1))
    real_plan = engine.scheduler._plan_work
    failures = iter([True])

    def plan_once_broken():
        if next(failures, False):
            raise RuntimeError("injected scheduler bug")
        return real_plan()

    engine.scheduler._plan_work = plan_once_broken

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=EngineApp(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as client:
            body = {"prompt": "x = 1", "max_tokens": 4, "temperature": 0}
            broken = await client.post("/v1/completions", json=body)
            healthy = await client.post("/v1/completions", json=body)
            return broken, healthy

    try:
        broken, healthy = asyncio.run(scenario())
    finally:
        engine.stop()
    assert broken.status_code == 500 and broken.json()["error"]["code"] == "engine_error"
    assert healthy.status_code == 200
    assert engine.scheduler.tenant_state("default").active_count == 0


def test_a_prompt_longer_than_the_kv_budget_streams_through_with_token_pd(tiny_model_dir):
    from backends.engine.server import EngineApp
    from backends.engine.service import Engine, EngineSettings

    # 0.05 MiB of 512-byte tokens: a budget of 102 tokens, and a prompt of 300.
    engine = Engine(EngineSettings(model_dir=str(tiny_model_dir), kv_budget_mib=0.05, policy="token-pd"))
    budget = engine.runner.config.budget_tokens

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=EngineApp(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as client:
            body = {"prompt": list(range(3, 303)), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return await client.post("/v1/completions", json=body)

    try:
        response = asyncio.run(scenario())
    finally:
        engine.stop()
    assert budget < 300
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == {"prompt_tokens": 300, "completion_tokens": 8, "total_tokens": 308}
    assert engine.runner.stats.peak_used_tokens <= budget
    assert engine.runner.stats.tokens_evicted >= 300 - budget


def test_a_bfloat16_engine_holds_twice_the_tokens_in_the_same_budget_and_reports_its_cache_dtype(
    tiny_model_dir,
):
    from backends.engine.server import EngineApp
    from backends.engine.service import Engine, EngineSettings

    half = Engine(EngineSettings(model_dir=str(tiny_model_dir), kv_budget_mib=1, dtype="bfloat16"))
    full = Engine(EngineSettings(model_dir=str(tiny_model_dir), kv_budget_mib=1))
    assert half.runner.config.budget_tokens == 2 * full.runner.config.budget_tokens
    assert half.runner.model.pool.keys.dtype == torch.bfloat16

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=EngineApp(half))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as client:
            body = {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            return await client.post("/v1/completions", json=body), await client.get("/metrics")

    try:
        completion, metrics = asyncio.run(scenario())
    finally:
        half.stop()
        full.stop()
    assert completion.status_code == 200
    assert completion.json()["usage"]["completion_tokens"] == 6
    assert 'cache_dtype="bfloat16"' in metrics.text
    assert f'kv_bytes_per_token="{half.kv_bytes_per_token}"' in metrics.text
    assert half.kv_bytes_per_token * 2 == full.kv_bytes_per_token


def test_an_unknown_dtype_is_refused_with_the_choices(tiny_model_dir):
    from backends.engine.service import Engine, EngineSettings

    with pytest.raises(ValueError, match="unknown dtype 'bf16'; choose from float32, bfloat16, float16"):
        Engine(EngineSettings(model_dir=str(tiny_model_dir), kv_budget_mib=1, dtype="bf16"))
