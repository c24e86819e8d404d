"""The backend scrape: read every enabled replica's vLLM ``/metrics`` and keep what saturation and
capacity need (running, waiting, KV usage, KV size from ``vllm:cache_config_info``).

Parsing is `backends.vllm_wire`'s (one parser of vLLM's text for the whole project); fetching uses
httpx with a short timeout and turns any failure into an unhealthy observation, so one dead replica
never fails the tick.
Observations are written onto the replica rows (``QuerySet.update``: no ``updated_at`` churn, so
gateways do not reload their snapshots every scrape), and each pool's measured per-replica KV size
is refreshed from its healthy replicas.
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import httpx
from django.utils import timezone

from apps.policy import InstanceSnapshot
from apps.pools.models import Replica, TokenPool
from backends import vllm_wire

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """One replica's saturation signals as the replica row stores them; KV sizes are None when vLLM did not
    publish them."""

    running: int
    waiting: int
    kv_usage: float
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None


def replica_metrics(text: str) -> ReplicaMetrics:
    """One replica's `/metrics` text (vLLM's, parsed by `backends.vllm_wire`) as the replica row keeps it."""
    parsed = vllm_wire.parse_vllm_metrics(text)
    return ReplicaMetrics(
        running=max(0, int(parsed.running)),
        waiting=max(0, int(parsed.waiting)),
        kv_usage=parsed.kv_usage,
        kv_cache_tokens=parsed.kv_cache_tokens,
        kv_cache_bytes=parsed.kv_cache_bytes,
    )


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    url: str
    metrics: ReplicaMetrics | None
    error: str = ""

    @property
    def healthy(self) -> bool:
        return self.metrics is not None


def metrics_url(base_url: str) -> str:
    return base_url.rstrip("/") + "/metrics"


def scrape_replica(url: str, *, client: httpx.Client) -> ScrapeResult:
    """Fetch and parse one replica; never raises (an unreachable replica is simply unhealthy)."""
    try:
        response = client.get(metrics_url(url))
        response.raise_for_status()
        return ScrapeResult(url, replica_metrics(response.text))
    except httpx.HTTPError as exc:
        return ScrapeResult(url, None, f"{type(exc).__name__}: {exc}"[:300])


@dataclass(frozen=True, slots=True)
class PoolScrape:
    pool: str
    replicas: int
    healthy: int
    kv_cache_tokens_per_replica: int | None
    kv_cache_bytes_per_replica: int | None
    # The healthy replicas' saturation inputs, `updated_at` in epoch seconds (the scrape's time).
    snapshots: tuple[InstanceSnapshot, ...] = ()


def _measured(results: Iterable[ScrapeResult]) -> tuple[int | None, int | None]:
    """Per-replica KV size: the smallest healthy replica's (the pool is sized by its weakest member)."""
    tokens = [r.metrics.kv_cache_tokens for r in results if r.metrics and r.metrics.kv_cache_tokens]
    size = [r.metrics.kv_cache_bytes for r in results if r.metrics and r.metrics.kv_cache_bytes]
    return (min(tokens) if tokens else None), (min(size) if size else None)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The scrape client's TLS context, built once: loading the CA bundle took 60-110 ms of CPU here, holding the
    interpreter's lock, so a client built every scrape (every 5 s) stalled an embedded gateway's requests."""
    return httpx.create_ssl_context()  # what httpx builds for a client, as the gateway's transport does


def pools_scrape(
    *, now: datetime | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, transport: httpx.BaseTransport | None = None
) -> list[PoolScrape]:
    """Scrape every enabled replica of every pool, store the observations, refresh measured capacity.

    Disabled replicas are not scraped (their last observation stays, marked by its ``scraped_at``).
    """
    now = now or timezone.now()
    summaries: list[PoolScrape] = []
    with httpx.Client(timeout=timeout_s, transport=transport, verify=tls_context()) as client:
        for pool in TokenPool.objects.prefetch_related("replicas").order_by("id"):
            replicas = [r for r in pool.replicas.all() if r.enabled]
            results = [scrape_replica(r.url, client=client) for r in replicas]
            for replica, result in zip(replicas, results, strict=True):
                _store_observation(replica, result, now)
            tokens, size = _measured(results)
            if tokens is not None or size is not None:
                TokenPool.objects.filter(pk=pool.pk).update(
                    measured_kv_cache_tokens_per_replica=tokens,
                    measured_kv_cache_bytes_per_replica=size,
                    measured_at=now,
                )
            healthy = sum(1 for r in results if r.healthy)
            snapshots = tuple(
                InstanceSnapshot(queue_depth=float(r.metrics.waiting), kv_utilization=r.metrics.kv_usage,
                                 updated_at=now.timestamp(), batch_size=float(r.metrics.running))
                for r in results if r.metrics is not None
            )
            summaries.append(PoolScrape(pool.name, len(results), healthy, tokens, size, snapshots))
    return summaries


def _store_observation(replica: Replica, result: ScrapeResult, now: datetime) -> None:
    query = Replica.objects.filter(pk=replica.pk)
    # Log changes of health only: a replica down for an hour is one warning, not 720.
    if result.metrics is None and replica.healthy is not False:
        logger.warning("replica %s of pool %s is unreachable: %s", replica.url, replica.pool_id, result.error)
    elif result.metrics is not None and replica.healthy is False:
        logger.info("replica %s of pool %s is reachable again", replica.url, replica.pool_id)
    if result.metrics is None:
        # Keep the last good numbers for the UI; health and the error say they are stale.
        query.update(healthy=False, scrape_error=result.error, scraped_at=now)
        return
    m = result.metrics
    query.update(
        healthy=True,
        scrape_error="",
        scraped_at=now,
        num_requests_running=m.running,
        num_requests_waiting=m.waiting,
        kv_cache_usage=m.kv_usage,
        kv_cache_tokens=m.kv_cache_tokens,
        kv_cache_bytes=m.kv_cache_bytes,
    )
