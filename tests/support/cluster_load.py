"""Gateway processes (`manage.py serve --workers N`) with their state on a real Redis Cluster, three pools whose
slots fall on different primaries, each pool with a backend of its own (so a backend's peak of requests at once
is its one entitlement's), and closed-loop clients that record every answer with its time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.gateway.servers import ServerThread
from tests.gateway.upstream import Upstream
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.redis_cluster import LocalRedisCluster, pools_on_distinct_primaries
from tests.support.site import PreparedSite, prepare_site, serving

CONCURRENCY = 4


@dataclass
class Answer:
    pool: str
    at: float  # time.monotonic() when the answer came
    status: int
    code: str = ""
    sent: float = 0.0  # when the request was sent


@dataclass
class ClusterSite:
    site: PreparedSite
    url: str
    pools: list[str]
    backends: dict[str, Upstream]
    answers: list[Answer] = field(default_factory=list)

    def key(self, pool: str) -> str:
        return self.site.keys[f"ent-{pool}"]


@contextlib.contextmanager
def cluster_site(workdir: Path, cluster: LocalRedisCluster, redis_url: str, *, workers: int = 4,
                 delay_s: float = 0.02, env: dict[str, str] | None = None) -> Iterator[ClusterSite]:
    """`workers` gateway processes on the cluster; Celery's and the control loops' Redis is `redis_url`."""
    pools = pools_on_distinct_primaries(cluster)
    backends = {pool: Upstream(first_token_delay_s=delay_s) for pool in pools}
    servers = []
    try:
        for backend in backends.values():
            server = ServerThread(backend).start()
            servers.append(server)
            backend.url = server.url
        manifest = documents(*(tiny_pool(pool, backends[pool].url, slots=256) for pool in pools), *(
            entitlement(f"ent-{pool}", tenant="acme", pool=pool, service_class="guaranteed", concurrency=CONCURRENCY)
            for pool in pools))
        settings = {"REDIS_URL": redis_url, "GATEWAY_STATE_BACKEND": "redis", "GATEWAY_REDIS_URL": cluster.url,
                    "GATEWAY_REDIS_CLUSTER": "true", "TOKENPOOLS_TICKS": "off", "GATEWAY_ACQUIRE_TIMEOUT_S": "0.5",
                    **(env or {})}
        workdir.mkdir(parents=True, exist_ok=True)
        site = prepare_site(workdir, tenants=["acme"], manifest=manifest, key_for=[f"ent-{p}" for p in pools],
                            env=settings)
        with serving(site, workers=workers, log_name="cluster-serve.log") as (url, _process):
            yield ClusterSite(site, url, pools, backends)
    finally:
        for server in servers:
            server.stop()


async def _client(target: ClusterSite, pool: str, client: httpx.AsyncClient, stop: asyncio.Event,
                  budget: list[int]) -> None:
    body = {"model": pool, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {target.key(pool)}"}
    while not stop.is_set() and budget[0] > 0:
        budget[0] -= 1
        sent = time.monotonic()
        try:
            response = await client.post(f"{target.url}/v1/chat/completions", json=body, headers=headers)
        except httpx.HTTPError as exc:  # kept with its kind, so that a failing run says what broke
            target.answers.append(Answer(pool, time.monotonic(), 0, f"transport {type(exc).__name__}: {exc}", sent))
            continue
        code = ""
        if response.status_code != 200:
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                code = str(response.json()["error"]["code"])
            await asyncio.sleep(0.01)  # a refused client comes back a moment later, not in a hot loop
        target.answers.append(Answer(pool, time.monotonic(), response.status_code, code, sent))


async def load(target: ClusterSite, *, requests: int, clients_per_pool: int, stop: asyncio.Event | None = None,
               ) -> None:
    """Closed-loop clients on every pool until `requests` were sent in all (or `stop` is set)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    stop = stop or asyncio.Event()
    budget = [requests]
    # Idle connections are dropped before the server drops them (`serve` closes them after
    # SERVER_KEEPALIVE_TIMEOUT_S, 75 s by default; it was 5 s, as httpx's default expiry: a request sent on a
    # connection idle just under 5 s could meet the server closing it, a ReadError with no answer, the likely cause
    # of the 1 ReadError in 5,000 requests of one full `make test` run, 2026-11-27).
    limits = httpx.Limits(max_connections=clients_per_pool * len(target.pools) * 2, keepalive_expiry=4.0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        await asyncio.gather(*(_client(target, pool, client, stop, budget)
                               for pool in target.pools for _ in range(clients_per_pool)))
