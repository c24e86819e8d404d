"""deploy/compose.yaml brought up with podman-compose as a platform team would run it on one machine: PostgreSQL,
Redis, the migration job, two gateway containers (`serve --workers 2` each) behind nginx's one port, a Celery
worker and beat, the virtual vLLM as the backend. A manifest is applied in one gateway container; many clients
at once through the one port, on a guaranteed entitlement and an elastic one, reach both containers, and the
virtual vLLM's own count of requests in flight (GET /virtual/concurrency) shows the guaranteed entitlement's
concurrency never exceeded across the four processes, nor the pool's slots; after SIGTERM the gateways' usage in
PostgreSQL matches the answers. Everything is removed at the end (`down -v`). Only when asked (`make
test-compose`, which builds the images first); each phase's time is printed."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.deploy.test_image import Phases, _wait_until
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.services import free_port

pytestmark = [pytest.mark.image, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "deploy" / "compose.yaml"
COMPOSE = os.environ.get("PODMAN_COMPOSE", str(REPO / "var" / "compose-venv" / "bin" / "podman-compose"))
IMAGE = os.environ.get("TOKENPOOLS_IMAGE", "localhost/tokenpools:latest")
# runc, as for the image test: crun refuses this machine's cgroups v1/v2 hybrid (podman's own default elsewhere).
RUNTIME = os.environ.get("PODMAN_RUNTIME", "runc")
SERVICE_IMAGES = ["localhost/tokenpools-postgres:bookworm", "localhost/tokenpools-redis:bookworm",
                  "localhost/tokenpools-nginx:bookworm"]
POOL, SLOTS = "tiny", 8
GOLD, GOLD_CONCURRENCY = "gold", 4  # guaranteed: never more than this at the backend
BULK, BULK_CONCURRENCY = "bulk", 2  # elastic: may borrow the pool's idle slots, never gold's reservation
GOLD_CLIENTS, BULK_CLIENTS, ROUNDS = 24, 8, 3
MAX_TOKENS = 20  # 20 ms a token at the virtual vLLM: about 0.4 s a request


class Stack:
    """One podman-compose project on the compose file, with its own name, port and secrets."""

    def __init__(self) -> None:
        self.project = f"tpcompose{secrets.token_hex(4)}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "TOKENPOOLS_IMAGE": IMAGE, "TOKENPOOLS_PORT": str(self.port),
                    "SECRET_KEY": secrets.token_urlsafe(32), "POSTGRES_PASSWORD": secrets.token_hex(12)}
        self.base = [COMPOSE, f"--podman-args=--runtime={RUNTIME}", "-f", str(COMPOSE_FILE), "-p", self.project]

    def compose(self, *args: str, timeout: float = 300) -> str:
        command = [*self.base, *args]
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                                 f"{result.stderr[-3000:]}")
        return result.stdout

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"  # podman-compose's naming

    def exec(self, service: str, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run(["podman", "--runtime", RUNTIME, "exec", "-i", self.container(service), *args], input=stdin,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        return result.stdout

    def logs(self, service: str, tail: int = 40) -> str:
        result = subprocess.run(["podman", "logs", "--tail", str(tail), self.container(service)],
                                capture_output=True, text=True)
        return result.stdout + result.stderr


@pytest.fixture(scope="module")
def images() -> None:
    if shutil.which("podman") is None:
        pytest.fail("podman not found: `make image-deps` (Debian packages podman, runc, debootstrap)")
    if not Path(COMPOSE).exists():
        pytest.fail(f"{COMPOSE} not found: `make compose-venv` installs podman-compose")
    for image in [IMAGE, *SERVICE_IMAGES]:
        if subprocess.run(["podman", "image", "exists", image]).returncode != 0:
            pytest.fail(f"image {image} not found: `make compose-images` builds them (`make test-compose` too)")


def _manifest() -> str:
    tenant = "apiVersion: tokenpools.io/v1alpha1\nkind: Tenant\nmetadata: {name: acme}\nspec: {displayName: Acme}"
    return "\n---\n".join([tenant, documents(
        tiny_pool(POOL, "http://virtual-vllm.tokenpools.internal:8000", slots=SLOTS),
        entitlement(GOLD, tenant="acme", pool=POOL, service_class="guaranteed", concurrency=GOLD_CONCURRENCY),
        entitlement(BULK, tenant="acme", pool=POOL, service_class="elastic", concurrency=BULK_CONCURRENCY))])


def _warm(url: str, key: str) -> int:
    """Until 12 answers in a row are 200s: every gateway process has loaded the new pool and key (a 401 or a
    404 for the model before that reaches no entitlement). Returns how many requests were served."""
    body = {"model": POOL, "messages": [{"role": "user", "content": "warm"}], "max_tokens": 1}
    served, streak, deadline = 0, 0, time.monotonic() + 60
    while streak < 12:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=30)
        served += r.status_code == 200
        streak = streak + 1 if r.status_code == 200 else 0
        assert time.monotonic() < deadline, f"the new key not served by every gateway: {r.status_code} {r.text}"
        if streak == 0:
            time.sleep(0.3)
    return served


async def _client(client: httpx.AsyncClient, url: str, key: str, user: str) -> list[tuple[int, str, bool]]:
    """ROUNDS streamed chat completions one after another: (status, the gateway container, the stream ended)."""
    body = {"model": POOL, "messages": [{"role": "user", "content": "many clients, one port"}],
            "max_tokens": MAX_TOKENS, "stream": True, "user": user}
    answers = []
    for _ in range(ROUNDS):
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            text = "".join([chunk async for chunk in r.aiter_text()])
        answers.append((r.status_code, r.headers.get("x-tokenpools-upstream", ""), "data: [DONE]" in text))
    return answers


def _burst(url: str, keys: dict[str, str]) -> dict[str, list[tuple[int, str, bool]]]:
    async def run() -> dict[str, list[tuple[int, str, bool]]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            gold = [_client(client, url, keys[GOLD], GOLD) for _ in range(GOLD_CLIENTS)]
            bulk = [_client(client, url, keys[BULK], BULK) for _ in range(BULK_CLIENTS)]
            results = await asyncio.gather(*gold, *bulk)
        return {GOLD: [a for r in results[:GOLD_CLIENTS] for a in r],
                BULK: [a for r in results[GOLD_CLIENTS:] for a in r]}

    return asyncio.run(run())


def _usage(stack: Stack) -> dict[str, int]:
    out = stack.exec("postgres", "psql", "-U", "tokenpools", "-d", "tokenpools", "-At", "-F", " ", "-c",
                     "SELECT entitlement, sum(requests) FROM gateway_usagerecord GROUP BY entitlement")
    return {name: int(count) for name, count in (line.split() for line in out.splitlines() if line.strip())}


def test_compose_stack_holds_a_guaranteed_concurrency_across_two_gateway_containers_behind_one_port(
    images: None,
) -> None:
    phases, stack = Phases(), Stack()
    try:
        with phases("podman-compose up -d"):
            stack.compose("up", "-d")
        with phases("migrations, gateways ready"):
            _wait_until(lambda: httpx.get(f"{stack.url}/readyz", timeout=5).status_code == 200, 180,
                        "/readyz 200 through the proxy")
        with phases("apply + create_key (exec)"):
            applied = stack.exec("gateway-1", "python", "manage.py", "apply", "-f", "-", stdin=_manifest())
            assert f"TokenEntitlement/{GOLD} created" in applied, applied
            keys = {name: stack.exec("gateway-1", "python", "manage.py", "create_key", "--entitlement",
                                     name).strip() for name in (GOLD, BULK)}
        with phases("every process serves the keys"):
            warmed = {name: _warm(stack.url, key) for name, key in keys.items()}
        with phases(f"{GOLD_CLIENTS + BULK_CLIENTS} clients x {ROUNDS} streams"):
            answers = _burst(stack.url, keys)
        report = json.loads(stack.exec("virtual-vllm", "python", "-c", (
            "import urllib.request; print(urllib.request.urlopen("
            "'http://127.0.0.1:8000/virtual/concurrency').read().decode())")))
        codes = {name: Counter(status for status, _, _ in got) for name, got in answers.items()}
        gateways = Counter(upstream for got in answers.values() for _, upstream, _ in got)
        print(f"\ncompose burst: answers {dict(codes)}; by gateway container {dict(gateways)}; at the backend: "
              f"peak {report['peak']} (pool slots {SLOTS}), by entitlement {report['peak_by_user']} "
              f"(concurrency {GOLD}={GOLD_CONCURRENCY}, {BULK}={BULK_CONCURRENCY})")
        # The limit held across two containers of two processes each, and was reached (the clients contended).
        assert report["peak_by_user"][GOLD] <= GOLD_CONCURRENCY
        assert report["peak_by_user"][GOLD] == GOLD_CONCURRENCY
        assert report["peak"] <= SLOTS
        assert report["in_flight"] == 0
        assert len([name for name in gateways if name]) == 2, gateways  # nginx spread them over both containers
        assert codes[GOLD][200] > 0 and codes[BULK][200] > 0, codes
        assert all(status < 500 for got in answers.values() for status, _, _ in got), codes
        assert all(done for got in answers.values() for status, _, done in got if status == 200)
        with phases("stop gateways (SIGTERM)"):
            stack.compose("stop", "-t", "30", "gateway-1", "gateway-2", timeout=120)
        for service in ("gateway-1", "gateway-2"):
            state = json.loads(subprocess.run(["podman", "inspect", "--format", "{{json .State}}",
                                               stack.container(service)], capture_output=True, text=True).stdout)
            assert state["ExitCode"] == 0, (service, state, stack.logs(service))
        usage = _usage(stack)
        # Every answered request's usage reached PostgreSQL (the warm-up's too).
        assert usage == {name: codes[name][200] + warmed[name] for name in (GOLD, BULK)}, (usage, codes, warmed)
    finally:
        if sys.exc_info()[0] is not None:
            for service in ("migrate", "gateway-1", "gateway-2", "proxy", "celery-worker", "virtual-vllm"):
                print(f"\n--- {service} (last lines)\n{stack.logs(service)}")
        with phases("podman-compose down -v"):
            subprocess.run([*stack.base, "down", "-v", "-t", "10"], env=stack.env, capture_output=True, timeout=180)
        print(f"\ntest_compose phases ({stack.project}):\n{phases.report()}")
