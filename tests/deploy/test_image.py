"""The container image (deploy/Containerfile) run with podman as production runs it: a real PostgreSQL and
Redis on the host, the migrations as a one-shot container, the gateway container (read-only root, all
capabilities dropped, uid 10001) ready on /readyz, a manifest applied and a key created in it, a streamed
chat completion through it to the virtual vLLM on the host, then SIGTERM (`podman stop`) and the usage in
PostgreSQL. Only when asked (`make test-image`: it builds the image first); each phase's time is printed."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.services import free_port, running_postgres, running_redis, stop_process_group

pytestmark = [pytest.mark.image, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("TOKENPOOLS_IMAGE", "localhost/tokenpools:latest")
POOL = "tiny"
MAX_TOKENS = 12
# runc (crun refuses this machine's cgroups v1/v2 hybrid); as root, podman's default ulimits fail to apply.
PODMAN = ["podman", "--runtime", "runc"]
RUN = ["run", "--network", "host", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
       # The Kubernetes manifests' securityContext: only /tmp writable, no capabilities, no privilege gain.
       "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]


class Phases:
    """Wall time of each phase, printed at the end (`pytest -s`) and on failure."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.times.append((name, time.monotonic() - start))

    def report(self) -> str:
        return "\n".join(f"  {name:<28} {seconds:7.2f} s" for name, seconds in self.times)


def podman(*args: str, stdin: str | None = None, timeout: float = 120) -> str:
    result = subprocess.run([*PODMAN, *args], input=stdin, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def env_flags(env: dict[str, str]) -> list[str]:
    return [flag for name, value in env.items() for flag in ("--env", f"{name}={value}")]


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None:
        pytest.fail("podman not found: `make image-deps` (Debian packages podman, runc, debootstrap)")
    if subprocess.run([*PODMAN, "image", "exists", IMAGE]).returncode != 0:
        pytest.fail(f"image {IMAGE} not found: `make image` builds it (`make test-image` builds it and runs this)")
    return IMAGE


@pytest.fixture()
def virtual_vllm(tmp_path: Path) -> Iterator[str]:
    """The virtual vLLM on the host, serving model `tiny`."""
    port = free_port()
    log = open(tmp_path / "vllm.log", "w")  # noqa: SIM115  (closed in finally)
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends.virtual_vllm", "--port", str(port), "--served-model-name", POOL,
         "--max-num-seqs", "4", "--latency-model", "fixed", "--prefill-ms-per-token", "1",
         "--decode-ms-per-token", "5"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 30, "virtual vLLM /health",
                    proc=proc)
        yield url
    finally:
        stop_process_group(proc)
        log.close()


def _wait_until(check: object, timeout_s: float, what: str, *, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({proc.returncode})")
        try:
            if check():  # type: ignore[operator]
                return
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached in {timeout_s} s (last error: {last!r})")


def _readyz_has_pool(url: str) -> bool:
    response = httpx.get(f"{url}/readyz", timeout=5)
    return response.status_code == 200 and response.json()["checks"]["pools"].get(POOL) == "ok"


def _stream_chat(url: str, key: str) -> tuple[int, str]:
    """A streamed chat completion; (status, the concatenated content). A 401 while the serving process has not
    yet loaded the new key is retried (it never reaches an entitlement, so records no usage)."""
    body = {"model": POOL, "messages": [{"role": "user", "content": "hello from a container"}],
            "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    deadline = time.monotonic() + 30
    while True:
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            text = "".join(r.iter_text())
        if r.status_code != 401 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, (r.status_code, text)
    assert text.rstrip().endswith("data: [DONE]"), text[-500:]
    content = ""
    for line in text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: "):]).get("choices", []):
                content += choice.get("delta", {}).get("content") or ""
    return r.status_code, content


def _usage(database_url: str) -> tuple[int, int, int]:
    import psycopg

    with psycopg.connect(database_url.replace("postgres://", "postgresql://", 1)) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(requests), 0), coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0)"
            " FROM gateway_usagerecord WHERE entitlement = %s", ["wide"]).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def test_image_serves_a_streamed_completion_and_records_its_usage_after_sigterm(
    image: str, virtual_vllm: str, tmp_path: Path
) -> None:
    phases = Phases()
    name = f"tokenpools-test-{secrets.token_hex(4)}"
    port = free_port()
    manifest = "\n---\n".join([
        "apiVersion: tokenpools.io/v1alpha1\nkind: Tenant\nmetadata: {name: acme}\nspec: {displayName: Acme}",
        documents(tiny_pool(POOL, virtual_vllm, slots=8),
                  entitlement("wide", tenant="acme", pool=POOL, service_class="dedicated", concurrency=8)),
    ])
    try:
        with running_postgres() as database_url, running_redis() as redis_url:
            env = {"DEPLOYMENT": "production", "DATABASE_URL": database_url, "REDIS_URL": redis_url,
                   "SECRET_KEY": secrets.token_urlsafe(32), "ALLOWED_HOSTS": "127.0.0.1,localhost",
                   "GATEWAY_PORT": str(port), "GATEWAY_WORKERS": "2", "GATEWAY_DRAIN_TIMEOUT_S": "20",
                   "LOG_LEVEL": "INFO"}
            with phases("migrate (one-shot)"):
                podman(*RUN, "--rm", *env_flags(env), image, "python", "manage.py", "migrate", "--noinput",
                       timeout=300)
            with phases("gateway start to /readyz"):
                podman(*RUN, "--detach", "--name", name, *env_flags(env), image)
                url = f"http://127.0.0.1:{port}"
                _wait_until(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 200, 90, "/readyz 200")
            assert podman("exec", name, "id", "-u").strip() == "10001"
            with phases("HEALTHCHECK (podman)"):
                podman("healthcheck", "run", name)
            with phases("apply + create_key (exec)"):
                applied = podman("exec", "-i", name, "python", "manage.py", "apply", "-f", "-", stdin=manifest)
                assert "TokenEntitlement/wide created" in applied, applied
                key = podman("exec", name, "python", "manage.py", "create_key", "--entitlement", "wide").strip()
            with phases("pool ready on /readyz"):
                _wait_until(lambda: _readyz_has_pool(url), 30, f"/readyz with pool {POOL} ok")
            with phases("streamed chat completion"):
                status, content = _stream_chat(url, key)
            assert content, "the stream carried no content"
            with phases("podman stop (SIGTERM)"):
                podman("stop", "-t", "30", name, timeout=60)
            state = json.loads(podman("inspect", "--format", "{{json .State}}", name))
            logs = podman("logs", name)
            # 137 would be podman's SIGKILL after the 30 s: the drain and the usage flush never finished.
            assert state["ExitCode"] == 0, (state, logs[-3000:])
            with phases("usage query"):
                requests, prompt_tokens, completion_tokens = _usage(database_url)
            assert requests == 1, logs[-3000:]
            assert prompt_tokens > 0
            assert 0 < completion_tokens <= MAX_TOKENS
    finally:
        if sys.exc_info()[0] is not None:  # failing: the gateway's own account of it
            logs = subprocess.run([*PODMAN, "logs", "--tail", "60", name], capture_output=True, text=True)
            print(f"\ngateway container log (last 60 lines):\n{logs.stdout}{logs.stderr}")
        subprocess.run([*PODMAN, "rm", "--force", "--ignore", name], capture_output=True)
        print(f"\ntest_image phases ({image}):\n{phases.report()}")
