"""``python manage.py demo_up --host H --port P``: the whole local demo of ``make run`` in one terminal.

Starts three child processes: the virtual vLLM (the demo pool's replica, 16 slots on 127.0.0.1:8100), the
site (``serve``: UI, REST API, gateway and the in-process ticks that feed the live dashboard) and the load
generator with ``examples/loadgen/demo.yaml`` (repeating until stopped, or for ``--loadgen-duration``
seconds). Prints where to look, then waits; Ctrl-C or SIGTERM stops every child (load first, backend last)
and a child that dies on its own stops the demo with its exit status. Run ``seed_demo --write-keys`` first
(``make run`` does), so the load generator finds the demo keys.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
DEMO_POOL = "demo-pool"
DEMO_MODEL = "tokenpools/tiny-4l-256"  # examples/demo.yaml's pool's model, when the pool is not in the database


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        # As uvicorn binds: connections of a demo just stopped (TIME_WAIT) do not make the port busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class Child:
    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        # Same process group as us: a Ctrl-C in the terminal reaches every child at once, and each one
        # shuts down its own way (uvicorn drains, loadgen prints its summary); we then reap them.
        self.process = subprocess.Popen([sys.executable, "manage.py", *args], cwd=settings.BASE_DIR, env=env)

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.running():
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)


class Command(BaseCommand):
    help = "Start the local demo: virtual vLLM, the site and the load generator; Ctrl-C stops them all."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="the site's address")
        parser.add_argument("--port", type=int, default=8000, help="the site's port")
        parser.add_argument("--backend-port", type=int, default=8100,
                            help="the virtual vLLM's port (demo-pool's replica is http://127.0.0.1:8100)")
        parser.add_argument("--scenario", default=str(Path(settings.BASE_DIR) / "examples" / "loadgen" / "demo.yaml"))
        parser.add_argument("--keys-file", default=settings.TOKENPOOLS_DEMO_KEYS)
        parser.add_argument("--loadgen-duration", type=float, default=None,
                            help="run the traffic this many seconds once (default: repeat until stopped)")
        parser.add_argument("--no-loadgen", action="store_true", help="start the backend and the site only")
        parser.add_argument("--log-level", default="warning", help="the site's uvicorn log level")

    def handle(self, *args: Any, **options: Any) -> None:
        import logging

        logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness polls are not news
        host, port, backend_port = options["host"], options["port"], options["backend_port"]
        for what, h, p in (("the virtual vLLM", "127.0.0.1", backend_port), ("the site", host, port)):
            if not 0 < p < 65536:
                raise CommandError(f"{what}'s port must be between 1 and 65535, got {p}")
            if not port_free(h, p):
                raise CommandError(
                    f"port {p} on {h} is already in use, so {what} cannot start there: is another demo "
                    f"(or a vLLM) still running? Stop it, or choose another port "
                    f"({'--backend-port' if p == backend_port and h == '127.0.0.1' else '--port'})."
                )
        # Absolute: the children run in the project folder, which need not be where we were started.
        options["keys_file"] = str(Path(options["keys_file"]).resolve())
        options["scenario"] = str(Path(options["scenario"]).resolve())
        if not options["no_loadgen"] and not Path(options["keys_file"]).exists():
            raise CommandError(
                f"no demo keys at {options['keys_file']}: run "
                f"`python manage.py seed_demo --write-keys {options['keys_file']}` first (make run does)"
            )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        site = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        backend = f"http://127.0.0.1:{backend_port}"

        stopping = False

        def request_stop(signum: int, frame: Any) -> None:
            nonlocal stopping
            stopping = True

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        children: list[Child] = []
        code = 0
        try:
            children.append(Child("virtual vLLM", [
                "virtual_vllm", "--host", "127.0.0.1", "--port", str(backend_port), "--max-num-seqs", "16",
                "--served-model-name", self._model(),
            ], env))
            self._wait_http(f"{backend}/health", children[-1], lambda: stopping)
            children.append(Child("site", [
                "serve", "--host", host, "--port", str(port), "--log-level", options["log_level"],
            ], env))
            self._wait_http(f"{site}/accounts/login/", children[-1], lambda: stopping)
            if not options["no_loadgen"]:
                loadgen = ["loadgen", "--scenario", options["scenario"], "--url", site,
                           "--keys-file", options["keys_file"]]
                if options["loadgen_duration"] is None:
                    loadgen.append("--repeat")
                else:
                    loadgen += ["--duration", str(options["loadgen_duration"])]
                children.append(Child("load generator", loadgen, env))
            self._banner(site, backend, options)
            code = self._watch(children, lambda: stopping)
        finally:
            for child in reversed(children):
                child.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.stdout.write("demo stopped")
        if code:
            sys.exit(code)

    def _model(self) -> str:
        from apps.pools.models import TokenPool

        pool = TokenPool.objects.filter(name=DEMO_POOL).first()
        return pool.model_name if pool is not None else DEMO_MODEL

    def _wait_http(self, url: str, child: Child, stopping: Any) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not stopping():
            if not child.running():
                raise CommandError(f"the {child.name} exited while starting (status {child.process.returncode})")
            try:
                if httpx.get(url, timeout=2.0).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        if stopping():
            raise CommandError("stopped while starting")
        raise CommandError(f"the {child.name} did not answer {url} within {START_TIMEOUT_S:g}s")

    def _banner(self, site: str, backend: str, options: dict[str, Any]) -> None:
        lines = [
            "",
            "tokenpools demo is up (Ctrl-C stops everything)",
            f"  live dashboard  {site}/pools/{DEMO_POOL}/live/",
            f"  log in          {site}/accounts/login/  (user admin; password printed by seed_demo the first"
            " time, or TOKENPOOLS_ADMIN_PASSWORD)",
            f"  OpenAI API      {site}/v1/chat/completions  (Bearer key from {options['keys_file']})",
            f"  REST API        {site}/api/v1/   Django admin {site}/django-admin/",
            f"  virtual vLLM    {backend}/metrics",
        ]
        if not options["no_loadgen"]:
            lines.append(f"  traffic         {options['scenario']}: progress below, one line a second")
        self.stdout.write("\n".join(lines) + "\n")
        self.stdout.flush()

    def _watch(self, children: list[Child], stopping: Any) -> int:
        """Until asked to stop: a server that exits ends the demo (with its status); the load generator
        ending after --loadgen-duration leaves the site up to look at."""
        while not stopping():
            for child in children:
                status = child.process.poll()
                if status is None:
                    continue
                if child.name == "load generator" and status == 0:
                    self.stdout.write("traffic finished; the site stays up until Ctrl-C")
                    children.remove(child)
                    break
                self.stderr.write(f"the {child.name} exited with status {status}; stopping the demo")
                return status or 1
            time.sleep(0.2)
        return 0
