"""Servers as child processes: a free port, waiting for it, a health-checked HTTP server in its own process
group, stopping the whole group. Used by the live experiments (`manage.py experiment --live`) and by the
tests and benchmarks (`tests/support`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


class ServiceUnavailable(RuntimeError):
    """The server's binaries are missing or it did not come up."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServiceUnavailable(f"server on port {port} exited with code {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise ServiceUnavailable(f"nothing listened on 127.0.0.1:{port} within {timeout_s:.0f}s")


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop a server started with ``start_new_session=True`` and everything it forked (vLLM forks an engine
    core; uvicorn may fork workers): SIGTERM to the group, SIGKILL if it does not go."""
    import signal

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
def running_http_server(
    cmd: list[str], *, port: int, name: str, startup_timeout_s: float, cwd: Path | None = None,
    env: dict[str, str] | None = None, health_path: str = "/health",
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `cmd` (which must listen on 127.0.0.1:`port`) in its own process group, wait until
    `health_path` answers 200, yield (base URL, process), stop the group afterwards. When the server exits
    or never gets healthy, the error carries the tail of its log."""
    import httpx

    log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                raise ServiceUnavailable(f"{name} exited with code {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base_url + health_path, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                raise ServiceUnavailable(f"{name} did not answer {health_path} within {startup_timeout_s:.0f}s:\n{tail}")
            time.sleep(0.5)
        yield base_url, proc
    finally:
        stop_process_group(proc)
        log.close()
        if os.environ.get("TOKENPOOLS_KEEP_SERVER_LOGS"):
            # For a failure to look into afterwards (the backend's own errors are not in the test's output).
            print(f"{name} log kept: {log.name}")
        else:
            with contextlib.suppress(OSError):
                os.unlink(log.name)
