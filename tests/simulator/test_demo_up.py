"""`manage.py demo_up`: starts the virtual vLLM, the site and the load generator as children, the traffic
gets through the real gateway, and SIGTERM stops every child; a busy port fails before anything starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.gateway.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("TOKENPOOLS_CHROMIUM", "/usr/bin/chromium")


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_busy_backend_port_fails_with_a_clear_message(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError, match=f"port {port} on 127.0.0.1 is already in use.*--backend-port"):
            call_command("demo_up", "--backend-port", str(port), "--port", str(free_port()),
                         "--keys-file", str(tmp_path / "keys.json"))


def test_missing_demo_keys_say_how_to_make_them(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="seed_demo --write-keys"):
        call_command("demo_up", "--backend-port", str(free_port()), "--port", str(free_port()),
                     "--keys-file", str(tmp_path / "keys.json"))


@pytest.fixture
def seeded(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path, int]]:
    """A migrated temporary database seeded by seed_demo, with demo-pool's replica on a free port."""
    work = Path(tempfile.mkdtemp(prefix="tokenpools-demo-up-"))
    backend_port = free_port()
    examples = work / "examples"
    examples.mkdir()
    demo = (ROOT / "examples" / "demo.yaml").read_text().replace("127.0.0.1:8100", f"127.0.0.1:{backend_port}")
    (examples / "demo.yaml").write_text(demo)
    env = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "DJANGO_ALLOW_ASYNC_UNSAFE"}}
    env.update({"DATABASE_URL": f"sqlite:///{work / 'db.sqlite3'}", "TOKENPOOLS_ADMIN_PASSWORD": "demo-pass",
                "DJANGO_SETTINGS_MODULE": "tokenpools_site.settings"})
    try:
        for args in (["migrate", "--noinput", "-v", "0"],
                     ["seed_demo", "--examples", str(examples), "--write-keys", str(work / "keys.json")]):
            subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True, timeout=300,
                           capture_output=True)
        yield env, work, backend_port
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
def test_demo_up_runs_the_traffic_through_the_site_and_stops_its_children(
    seeded: tuple[dict[str, str], Path, int],
) -> None:
    env, work, backend_port = seeded
    site_port = free_port()
    log = work / "demo_up.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "demo_up", "--port", str(site_port), "--backend-port", str(backend_port),
             "--keys-file", str(work / "keys.json"), "--loadgen-duration", "8"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while "traffic finished" not in log.read_text(errors="replace"):
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text()
        assert f"http://127.0.0.1:{site_port}/pools/demo-pool/live/" in text
        # The site stays up after the traffic ends, the backend too.
        assert listening(site_port) and listening(backend_port)
        if Path(CHROMIUM).exists():
            # The README's screenshot helper works against the running demo (a short wait: the charts start
            # from the history the page is sent first).
            shot = work / "dashboard.png"
            done = subprocess.run(
                [sys.executable, "manage.py", "demo_screenshot", "--url", f"http://127.0.0.1:{site_port}",
                 "--password", "demo-pass", "--wait", "3", "--out", str(shot)],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            png = shot.read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
            width, height = struct.unpack(">II", png[16:24])
            assert width == 1400 and height > 2000  # the whole page, every chart, not just the viewport
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert "demo stopped" in text
    assert not listening(site_port) and not listening(backend_port)  # the children are gone
    # The summary of the load generator: acme's requests got through the real gateway to the virtual vLLM.
    rows = {m.group(1): [int(x) for x in m.group(2, 3, 4, 5)]
            for m in re.finditer(r"^(acme-\S+|globex-\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", text, re.M)}
    assert set(rows) == {"acme-guaranteed", "acme-elastic", "globex-spot"}, text[-3000:]
    sent, ok, _rejected, errors = rows["acme-guaranteed"]
    assert sent >= 2 and ok >= 1 and errors == 0, rows
    assert sum(r[1] for r in rows.values()) >= 5, rows
    keys = json.loads((work / "keys.json").read_text())
    assert all(k not in text for k in keys.values())  # the launcher never prints the secrets
