"""The backend scrape: read every enabled replica's vLLM ``/metrics`` and keep what saturation and
capacity need (running, waiting, KV usage, KV size from ``vllm:cache_config_info``).

Parsing is a pure function over Prometheus' text format; fetching uses httpx with a short timeout
and turns any failure into an unhealthy observation, so one dead replica never fails the tick.
Observations are written onto the replica rows (``QuerySet.update``: no ``updated_at`` churn, so
gateways do not reload their snapshots every scrape), and each pool's measured per-replica KV size
is refreshed from its healthy replicas.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

import httpx
from django.utils import timezone

from apps.policy import InstanceSnapshot
from apps.pools.models import Replica, TokenPool

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1.0

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# vLLM before 0.10 named the usage gauge after the GPU; still served by older images.
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"

# name{labels} value [timestamp]; label values may hold escaped quotes.
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_prometheus_text(text: str) -> list[Sample]:
    """Samples of a text exposition (comments and malformed lines are skipped, not fatal)."""
    samples: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        labels = {key: _unescape(val) for key, val in _LABEL.findall(match.group("labels") or "")}
        samples.append(Sample(match.group("name"), labels, value))
    return samples


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """One replica's saturation signals; KV sizes are None when vLLM did not publish them."""

    running: int
    waiting: int
    kv_usage: float
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None


def _int_label(labels: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = labels.get(name)
        if raw is None:
            continue
        try:
            number = float(raw)
        except ValueError:
            continue
        if math.isfinite(number) and number >= 0:
            return int(number)
    return None


def parse_vllm_metrics(text: str) -> ReplicaMetrics:
    """The saturation signals of one vLLM server.

    Gauges are summed over engines (a data-parallel server publishes one series per engine). The KV
    size comes from ``cache_config_info``'s ``kv_cache_size_tokens`` / ``kv_cache_memory_bytes``
    labels; older servers only give ``num_gpu_blocks`` and ``block_size``, whose product is the
    size in tokens.
    """
    totals = {RUNNING: 0.0, WAITING: 0.0}
    usage: list[float] = []
    legacy_usage: list[float] = []
    tokens: int | None = None
    size_bytes: int | None = None
    for sample in parse_prometheus_text(text):
        if sample.name in totals:
            totals[sample.name] += sample.value
        elif sample.name == KV_USAGE:
            usage.append(sample.value)
        elif sample.name == KV_USAGE_LEGACY:
            legacy_usage.append(sample.value)
        elif sample.name == CACHE_CONFIG:
            labels = sample.labels
            found = _int_label(labels, "kv_cache_size_tokens")
            if found is None:
                blocks, block_size = _int_label(labels, "num_gpu_blocks"), _int_label(labels, "block_size")
                if blocks is not None and block_size is not None:
                    found = blocks * block_size
            if found is not None:
                tokens = (tokens or 0) + found
            found_bytes = _int_label(labels, "kv_cache_memory_bytes")
            if found_bytes is not None:
                size_bytes = (size_bytes or 0) + found_bytes
    values = usage or legacy_usage
    # The busiest engine bounds what the server can still take.
    kv_usage = max(values) if values else 0.0
    return ReplicaMetrics(
        running=max(0, int(totals[RUNNING])),
        waiting=max(0, int(totals[WAITING])),
        kv_usage=min(1.0, max(0.0, kv_usage)) if math.isfinite(kv_usage) else 0.0,
        kv_cache_tokens=tokens,
        kv_cache_bytes=size_bytes,
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
        return ScrapeResult(url, parse_vllm_metrics(response.text))
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


def pools_scrape(
    *, now: datetime | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, transport: httpx.BaseTransport | None = None
) -> list[PoolScrape]:
    """Scrape every enabled replica of every pool, store the observations, refresh measured capacity.

    Disabled replicas are not scraped (their last observation stays, marked by its ``scraped_at``).
    """
    now = now or timezone.now()
    summaries: list[PoolScrape] = []
    with httpx.Client(timeout=timeout_s, transport=transport) as client:
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
