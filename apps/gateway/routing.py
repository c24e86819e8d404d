"""Replica choice: least outstanding requests among the healthy enabled replicas of a pool.

Health is learnt two ways: a connect failure marks a replica down (passive), and the health task
probes `/health` of every replica (active), which is also how a replica comes back.

A definite answer counts at once: a refused connection (nothing listens) or a `/health` that answers
5xx marks the replica down, a 2xx-4xx answer marks it up. Silence does not: a probe or a connection that
times out only counts, and `UNHEALTHY_AFTER_TIMEOUTS` of them in a row mark the replica down. A busy
backend on a loaded CPU answers late now and then (vLLM's front end has been seen unscheduled for
seconds); ejecting the pool's only replica for one late answer would turn every request into a 503.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from apps.policy import InstanceSnapshot, pool_saturation
from backends import vllm_wire

logger = logging.getLogger(__name__)

# Consecutive timeouts (probes or connects) after which a replica that never said no is marked down.
UNHEALTHY_AFTER_TIMEOUTS = 3


class ReplicaSet:
    def __init__(self, urls: tuple[str, ...] = ()) -> None:
        self.urls: tuple[str, ...] = ()
        self.outstanding: dict[str, int] = {}
        self.healthy: dict[str, bool] = {}
        self.timeouts: dict[str, int] = {}
        # Last scraped vLLM metrics per replica (only replicas that expose them).
        self.metrics: dict[str, InstanceSnapshot] = {}
        self.update(urls)

    def update(self, urls: tuple[str, ...]) -> None:
        if urls == self.urls:
            return
        self.urls = urls
        self.outstanding = {url: self.outstanding.get(url, 0) for url in urls}
        self.healthy = {url: self.healthy.get(url, True) for url in urls}
        self.timeouts = {url: self.timeouts.get(url, 0) for url in urls}
        self.metrics = {url: m for url, m in self.metrics.items() if url in urls}

    def candidates(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Healthy replicas not yet tried, fewest outstanding requests first (ties keep list order)."""
        urls = [u for u in self.urls if self.healthy.get(u, True) and u not in exclude]
        urls.sort(key=lambda u: self.outstanding.get(u, 0))
        return urls

    def acquire(self, url: str) -> None:
        self.outstanding[url] = self.outstanding.get(url, 0) + 1

    def release(self, url: str) -> None:
        if url in self.outstanding and self.outstanding[url] > 0:
            self.outstanding[url] -= 1

    def saturation(self) -> float | None:
        """GAIE's saturation over the healthy replicas that report metrics (seed 004); None if none do."""
        snapshots = [m for url, m in self.metrics.items() if self.healthy.get(url, True)]
        return pool_saturation(snapshots) if snapshots else None

    def mark(self, url: str, healthy: bool) -> None:
        """A definite answer: the replica is up or down from now on."""
        self.timeouts[url] = 0
        if url in self.healthy and self.healthy[url] != healthy:
            logger.warning("replica %s is now %s", url, "healthy" if healthy else "unhealthy")
        self.healthy[url] = healthy

    def timed_out(self, url: str) -> None:
        """No answer in time: down only after `UNHEALTHY_AFTER_TIMEOUTS` in a row."""
        count = self.timeouts.get(url, 0) + 1
        if count >= UNHEALTHY_AFTER_TIMEOUTS:
            self.mark(url, False)
        else:
            self.timeouts[url] = count


def admission_saturation(replicas: ReplicaSet | None, enabled: bool) -> float:
    """The pool's saturation as admission sees it: 0 when saturation admission is off or no replica reports."""
    value = replicas.saturation() if enabled and replicas is not None else None
    return 0.0 if value is None else value


async def probe_replicas(client: httpx.AsyncClient, replica_sets: list[ReplicaSet], timeout_s: float = 1.0) -> None:
    """One round of `/health` probes over every replica of every pool."""

    async def probe(replicas: ReplicaSet, url: str) -> None:
        try:
            response = await client.get(url + "/health", timeout=timeout_s)
            replicas.mark(url, response.status_code < 500)
        except httpx.TimeoutException:
            replicas.timed_out(url)
            return
        except httpx.HTTPError:
            replicas.mark(url, False)
            replicas.metrics.pop(url, None)
            return
        try:
            metrics = await client.get(url + "/metrics", timeout=timeout_s)
        except httpx.HTTPError:
            return
        snapshot = parse_vllm_metrics(metrics.text) if metrics.status_code == 200 else None
        if snapshot is None:
            replicas.metrics.pop(url, None)
        else:
            replicas.metrics[url] = snapshot

    await asyncio.gather(*(probe(rs, url) for rs in replica_sets for url in rs.urls))


def parse_vllm_metrics(text: str) -> InstanceSnapshot | None:
    """Waiting requests, running requests and KV usage from vLLM's Prometheus text (summed over engines;
    parsed by `backends.vllm_wire`); None when the text has none of them (not a vLLM)."""
    metrics = vllm_wire.parse_vllm_metrics(text)
    if not metrics.saturation_reported:
        return None
    return InstanceSnapshot(queue_depth=metrics.waiting, kv_utilization=metrics.kv_usage, batch_size=metrics.running)
