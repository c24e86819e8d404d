"""The live pool dashboard end to end: the real site (`manage.py serve`, uvicorn, a migrated temporary
SQLite database) in front of the virtual vLLM (`manage.py virtual_vllm`), traffic through
`/v1/chat/completions` with real keys, and the pool's live page in headless Chromium: the charts must
receive new points over the websocket while the traffic flows. Screenshots land in test-output/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import screenshot_path
from tests.gateway.servers import free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "live-dash-7315"
MODEL = "virtual-qwen"
START_TIMEOUT_S = 90.0

# Runs inside `manage.py shell` against the temporary database: an operator, tenant acme with a
# guaranteed and a spot entitlement on a one-replica pool (the virtual vLLM), one key each.
SETUP = """
import json, sys
from django.contrib.auth import get_user_model
from apps.pools.services import entitlement_create, pool_create
from apps.tenancy.models import Tenant
from apps.tenancy.services import apikey_create
root = get_user_model().objects.create_superuser("root", "root@example.com", "{password}")
acme = Tenant.objects.create(name="Acme Corp", slug="acme")
pool = pool_create(actor=root, name="live-pool", model_name="{model}", slots_per_replica=8,
                   tokens_per_second_per_replica=1000, kv_cache_gib_per_replica=8, kv_layers=4, kv_heads=2,
                   head_dim=64, max_replicas=1, replicas=[{{"url": "{upstream}"}}])
keys = {{}}
for name, cls, concurrency in (("acme-chat", "guaranteed", 3), ("acme-batch", "spot", 6)):
    ent = entitlement_create(actor=root, name=name, tenant=acme, pool=pool, service_class=cls,
                             slo_target_ms=1000, tokens_per_second=200, kv_cache_gib=1, concurrency=concurrency)
    keys[name] = apikey_create(actor=root, entitlement=ent, name=name)[1]
print("KEYS=" + json.dumps(keys))
"""


def _env(db_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "DATABASE_URL", "DJANGO_ALLOW_ASYNC_UNSAFE"}}
    env.update({
        "DJANGO_SETTINGS_MODULE": "tokenpools_site.settings",
        "DATABASE_URL": f"sqlite:///{db_path}",
        "TOKENPOOLS_TICKS": "off",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _manage(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    return subprocess.Popen([sys.executable, "manage.py", *args], cwd=ROOT, env=env, stdout=handle,
                            stderr=subprocess.STDOUT)


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer within {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@dataclass
class LiveSite:
    url: str
    keys: dict[str, str]
    logs: Path


@pytest.fixture
def live_site() -> Iterator[LiveSite]:
    workdir = Path(tempfile.mkdtemp(prefix="tokenpools-live-"))
    env = _env(workdir / "db.sqlite3")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env,
                       check=True, timeout=300)
        upstream_port, site_port = free_port(), free_port()
        upstream = f"http://127.0.0.1:{upstream_port}"
        vllm_log = workdir / "virtual_vllm.log"
        processes.append(_manage("virtual_vllm", "--port", str(upstream_port), "--max-num-seqs", "8",
                                 "--served-model-name", MODEL, "--decode-ms-per-token", "25",
                                 env=env, log=vllm_log))
        _wait_http(f"{upstream}/health", processes[-1], vllm_log)
        setup = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c",
             SETUP.format(password=PASSWORD, model=MODEL, upstream=upstream)],
            cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=120,
        )
        line = next(ln for ln in setup.stdout.splitlines() if ln.startswith("KEYS="))
        keys = json.loads(line.removeprefix("KEYS="))
        site_log = workdir / "serve.log"
        processes.append(_manage("serve", "--port", str(site_port), "--log-level", "warning", env=env, log=site_log))
        site = f"http://127.0.0.1:{site_port}"
        _wait_http(f"{site}/accounts/login/", processes[-1], site_log)
        yield LiveSite(site, keys, workdir)
    finally:
        for process in reversed(processes):
            _stop(process)
        for log in sorted(workdir.glob("*.log")):  # shown by pytest when the test fails
            print(f"--- {log.name} (tail) ---\n{log.read_text(errors='replace')[-4000:]}")
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class Traffic:
    """Client threads sending chat completions through the gateway until stopped; counts statuses."""

    url: str
    keys: dict[str, str]
    statuses: Counter[int] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _client(self, key: str) -> None:
        with httpx.Client(base_url=self.url, timeout=30.0) as client:
            while not self._stop.is_set():
                try:
                    response = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                           json={"model": MODEL, "max_tokens": 24,
                                                 "messages": [{"role": "user", "content": "hello there"}]})
                    self.statuses[response.status_code] += 1
                    if response.status_code == 429:
                        time.sleep(0.1)
                except httpx.HTTPError:
                    self.statuses[0] += 1
                    time.sleep(0.2)

    def start(self, per_key: int) -> Traffic:
        for key in self.keys.values():
            for _ in range(per_key):
                thread = threading.Thread(target=self._client, args=(key,), daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=35)


def _points(page: Any, fid: str) -> int:
    return int(page.get_attribute(f"#fig-{fid}", "data-points") or 0)


def test_pool_live_page_charts_grow_while_traffic_flows(
    live_site: LiveSite, browser_page: Any, request: pytest.FixtureRequest
) -> None:
    from playwright.sync_api import expect

    traffic = Traffic(live_site.url, live_site.keys).start(per_key=4)
    try:
        page = browser_page
        console: list[str] = []  # printed if the test fails: a JS error is the likeliest cause
        page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
        page.on("pageerror", lambda error: console.append(f"pageerror: {error}"))
        page.goto(f"{live_site.url}/pools/live-pool/live/")
        page.get_by_label("Username", exact=True).fill("root")
        page.get_by_label("Password", exact=True).fill(PASSWORD)
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_role("heading", name="Pool live-pool live")).to_be_visible()
        expect(page.locator("#live-status")).to_have_text("live", timeout=20_000)

        # The first messages: the history, then one update a second.
        page.wait_for_function("Number(document.getElementById('live').dataset.updates) >= 2", timeout=30_000)
        before = {fid: _points(page, fid) for fid in ("inflight", "aimd", "tokens")}
        page.wait_for_function("Number(document.getElementById('live').dataset.updates) >= 6", timeout=30_000)
        after = {fid: _points(page, fid) for fid in ("inflight", "aimd", "tokens")}
        for fid in before:
            assert after[fid] >= before[fid] + 4, (fid, before, after)

        # The traffic shows: some second had requests of acme-chat in flight in the stacked chart.
        in_flight = page.evaluate(
            "() => (document.getElementById('fig-inflight').data.find(t => t.meta === 'inflight:acme-chat') || {y: []})"
            ".y.reduce((a, b) => Math.max(a, b), 0)"
        )
        assert in_flight >= 1
        assert page.locator("#fig-inflight .main-svg").count() >= 1  # plotly drew it
        page.screenshot(path=str(screenshot_path(request, "-traffic")), full_page=True)

        # A page opened now starts from the recent past (the history message), not from an empty chart:
        # the AIMD chart draws budget and pool in-flight (2 points a sample, 3 with an action marker).
        page.reload()
        expect(page.locator("#live-status")).to_have_text("live", timeout=20_000)
        page.wait_for_function("Number(document.getElementById('fig-aimd').dataset.points) > 0", timeout=20_000)
        fresh = page.evaluate("() => ({updates: Number(document.getElementById('live').dataset.updates),"
                              " points: Number(document.getElementById('fig-aimd').dataset.points)})")
        # At least 4 samples of history (6 or more were published; under CI load a sample or two may be
        # coalesced by the sampler's 0.5 s de-duplication, so do not ask for all of them).
        assert fresh["points"] - 3 * fresh["updates"] >= 2 * 4, fresh

        # The entitlement's page streams too, with that entitlement's series only.
        page.goto(f"{live_site.url}/entitlements/acme-chat/live/")
        expect(page.locator("#live-status")).to_have_text("live", timeout=20_000)
        page.wait_for_function("Number(document.getElementById('live').dataset.updates) >= 2", timeout=30_000)
        names = page.evaluate("() => document.getElementById('fig-inflight').data.map(t => t.meta)")
        assert "inflight:acme-chat" in names and not any("acme-batch" in n for n in names), names
    finally:
        traffic.stop()
        print("browser console:", *console, sep="\n  ")
    assert traffic.statuses[200] > 0, dict(traffic.statuses)
