"""Killing the vLLM process mid-stream: the client gets an error and the gateway holds no slot afterwards.

This module starts its own vLLM (the session's shared one must survive for the other tests)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.site import prepare_site, server_log, serving
from tests.support.vllm import SERVED_MODEL_NAME, running_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

def _metric_sum(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_backend_killed_mid_stream_errors_the_client_and_releases_the_slot(tmp_path: Path) -> None:
    with running_vllm(max_num_seqs=16) as (vllm_url, vllm_process):
        site = prepare_site(tmp_path, tenants=["acme"], manifest=documents(tiny_pool("tiny", vllm_url), entitlement(
                                "victim", tenant="acme", pool="tiny", service_class="guaranteed", concurrency=4)),
                            key_for=["victim"], env={"REDIS_URL": "", "GATEWAY_STATE_BACKEND": "memory"})
        with serving(site) as (url, _gateway):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=site.keys["victim"], max_retries=0, timeout=60)
            stream = client.chat.completions.create(
                model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "a long answer please"}],
                max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
            received = 0
            with pytest.raises(openai.APIError):
                for _chunk in stream:
                    received += 1
                    if received == 2:  # generation has just begun: 2,000 tokens take seconds even on vLLM
                        os.killpg(vllm_process.pid, signal.SIGKILL)
            # The error itself shows the stream was still under way when the backend died.
            assert received >= 2

            deadline = time.monotonic() + 10
            while _metric_sum(url, "gateway_requests_in_flight") != 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _metric_sum(url, "gateway_requests_in_flight") == 0, server_log(site)[-3000:]

            # With its only replica gone the pool cannot serve: a clean 503, not a hang or a 500.
            with pytest.raises(openai.APIStatusError) as failure:
                client.chat.completions.create(model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=4)
            assert failure.value.status_code == 503
            assert _metric_sum(url, "gateway_requests_in_flight") == 0
