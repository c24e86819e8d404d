"""`manage.py simulate` and `manage.py virtual_vllm` exit 2 with a message on bad flags; simulate runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def manage(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_simulate_runs_and_prints_json():
    done = manage("simulate", "--latency-model", "fixed", "--num-requests", "20", "--rate", "5", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["completed_requests"] == 20 and summary["conservation"]["holds"]


def test_bad_flags_exit_2_naming_the_flag():
    simulate = manage("simulate", "--num-instances", "zero")
    assert simulate.returncode == 2 and "--num-instances" in simulate.stderr
    server = manage("virtual_vllm", "--port", "0")
    assert server.returncode == 2 and "--port" in server.stderr
