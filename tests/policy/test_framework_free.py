"""The policy core must stay framework-free so the simulator and the gateway share it."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import apps.policy

FORBIDDEN = ("django", "rest_framework", "celery", "channels", "redis", "httpx")
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_importing_every_policy_module_loads_no_framework() -> None:
    modules = ["apps.policy"] + [
        f"apps.policy.{info.name}" for info in pkgutil.iter_modules(apps.policy.__path__)
    ]
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    # A clean interpreter: no pytest-django, no settings module, nothing preloaded.
    completed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)},
        check=False,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == []
    assert len(modules) > 5  # the walk found the package's modules


def test_core_modules_do_not_read_the_clock() -> None:
    """Only clock.py may touch the time module; everything else gets `now` passed in."""
    package = Path(apps.policy.__file__).parent
    offenders = [
        path.name
        for path in package.glob("*.py")
        if path.name != "clock.py" and ("import time" in path.read_text() or "time.monotonic" in path.read_text())
    ]
    assert offenders == []
