"""Crashes of real gateway processes (`manage.py serve`), measured: how long a SIGKILLed worker's
reservations stay held, and how much usage survives a SIGKILL. Used by tests/e2e/test_crash.py (which
asserts the targets) and bench/faults.py (which reports the figures in bench/RESULTS.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.gateway.servers import ServerThread
from tests.gateway.upstream import Upstream
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.site import PreparedSite, manage, prepare_site, serving

POOL = "crash"
# How long the requests that hold the entitlement's concurrency take (the survivor's end after it).
HOLD_S = 3.0
BODY = {"model": POOL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@contextmanager
def upstream(first_token_delay_s: float = 0.0, token_delay_s: float = 0.0) -> Iterator[Upstream]:
    backend = Upstream(first_token_delay_s=first_token_delay_s, token_delay_s=token_delay_s)
    server = ServerThread(backend).start()
    backend.url = server.url
    try:
        yield backend
    finally:
        server.stop()


def crash_site(workdir: Path, backend: Upstream, *, concurrency: int, env: dict[str, str]) -> PreparedSite:
    """A guaranteed entitlement: it never borrows beyond its concurrency, so a slot held by a dead process is
    a slot it cannot use (a class that may burst would borrow the pool's idle slots instead)."""
    workdir.mkdir(parents=True, exist_ok=True)
    manifest = documents(
        tiny_pool(POOL, backend.url, slots=256),
        entitlement("crash", tenant="acme", pool=POOL, service_class="guaranteed", concurrency=concurrency),
    )
    return prepare_site(workdir, tenants=["acme"], manifest=manifest, key_for=["crash"], env=env)


def worker_pids(parent: int) -> list[int]:
    """The uvicorn worker processes under `serve` (children of its process)."""
    children: list[int] = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                children.append(int(entry.name))
    return children


def client_connections(pid: int, port: int) -> int:
    """Established TCP connections to `port` that process `pid` holds (the clients a worker is serving)."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return 0
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                count += 1
    return count


def wait_for_workers(parent: int, count: int, timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = worker_pids(parent)
        if len(pids) >= count:
            return pids
        time.sleep(0.1)
    raise RuntimeError(f"serve did not start {count} worker processes")


async def _burst(url: str, key: str, count: int, *, stream: bool = False) -> list[int]:
    """`count` requests at once, each on a connection of its own (so several workers get some)."""

    async def one() -> int:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {**BODY, "stream": stream}
            try:
                response = await client.post(f"{url}/v1/chat/completions", json=body,
                                              headers={"Authorization": f"Bearer {key}"})
            except httpx.HTTPError:
                return 0
            return response.status_code

    return list(await asyncio.gather(*(one() for _ in range(count))))


@dataclass
class ReclaimResult:
    held_by_killed: int
    seconds: float | None


def reclaim_after_sigkill(workdir: Path, redis_url: str, *, concurrency: int = 4, limit_s: float = 60.0,
                          env: dict[str, str] | None = None) -> ReclaimResult:
    """Under `serve --workers 2` on Redis: `concurrency` slow requests hold the entitlement's whole concurrency,
    one worker is SIGKILLed, and the time until the entitlement admits `concurrency` requests at once again
    is measured (its reservations held by the dead worker come back when their lease runs out)."""
    settings = {"REDIS_URL": redis_url, "GATEWAY_STATE_BACKEND": "redis", "TOKENPOOLS_TICKS": "off",
                "GATEWAY_ACQUIRE_TIMEOUT_S": "0.2", **(env or {})}
    with upstream(first_token_delay_s=HOLD_S) as backend:
        site = crash_site(workdir, backend, concurrency=concurrency, env=settings)
        key = site.keys["crash"]
        with serving(site, workers=2, log_name="crash-serve.log") as (url, process):
            workers = wait_for_workers(process.pid, 2)
            port = int(url.rsplit(":", 1)[1])
            loop = asyncio.new_event_loop()
            try:
                holders = loop.create_task(_burst(url, key, concurrency))
                deadline = time.monotonic() + 30
                while len(backend.received) < concurrency:
                    loop.run_until_complete(asyncio.sleep(0.05))
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"only {len(backend.received)} of {concurrency} holders were admitted")
                # The worker serving most of them (the kernel decides who accepts a connection).
                victim = max(workers, key=lambda pid: client_connections(pid, port))
                os.kill(victim, signal.SIGKILL)
                killed_at = time.monotonic()
                backend.first_token_delay_s = 0.0
                # The survivor's holders end after HOLD_S; the dead worker's never answer.
                held = sum(1 for status in loop.run_until_complete(holders) if status != 200)
                while time.monotonic() - killed_at < limit_s:
                    if loop.run_until_complete(_burst(url, key, concurrency)) == [200] * concurrency:
                        return ReclaimResult(held, time.monotonic() - killed_at)
                    loop.run_until_complete(asyncio.sleep(0.2))
                return ReclaimResult(held, None)
            finally:
                loop.close()


@dataclass
class UsageResult:
    answered: int
    recorded: int


def recorded_requests(site: PreparedSite) -> int:
    out = manage(site.env, "shell", "-c", "from django.db.models import Sum; from apps.gateway.models import "
                                          "UsageRecord; print(UsageRecord.objects.aggregate(n=Sum('requests'))['n'] or 0)")
    return int(out.strip().splitlines()[-1])


def usage_after_sigkill(workdir: Path, *, requests: int = 200, over_s: float = 3.0, workers: int = 1,
                        redis_url: str | None = None, flush_s: float = 2.0) -> UsageResult:
    """`requests` requests spread over `over_s` seconds, then SIGKILL of every gateway process; the site is
    served again (with Redis: any process flushes what the dead ones counted there) and the usage records
    are compared with the requests that were answered."""
    settings = {"TOKENPOOLS_TICKS": "off", "GATEWAY_USAGE_FLUSH_S": str(flush_s)}
    if redis_url:
        settings.update({"REDIS_URL": redis_url, "GATEWAY_STATE_BACKEND": "redis"})
    with upstream() as backend:
        site = crash_site(workdir, backend, concurrency=256, env=settings)
        key = site.keys["crash"]

        async def spread(url: str) -> list[int]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
                async def one(delay: float) -> int:
                    await asyncio.sleep(delay)
                    response = await client.post(f"{url}/v1/chat/completions", json=BODY,
                                                 headers={"Authorization": f"Bearer {key}"})
                    return response.status_code
                return list(await asyncio.gather(*(one(over_s * i / requests) for i in range(requests))))

        with serving(site, workers=workers, log_name="usage-serve.log") as (url, process):
            if workers > 1:
                wait_for_workers(process.pid, workers)
            statuses = asyncio.run(spread(url))
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        answered = statuses.count(200)
        # Served again: a fresh process flushes what Redis holds (nothing is left anywhere with the in-process
        # store: what the dead process had not flushed is gone).
        with serving(site, log_name="usage-serve-again.log"):
            deadline = time.monotonic() + 5 * flush_s + 10
            recorded = recorded_requests(site)
            while recorded < answered and time.monotonic() < deadline:
                time.sleep(flush_s / 2)
                recorded = recorded_requests(site)
        return UsageResult(answered, recorded)
