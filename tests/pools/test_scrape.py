"""The backend scrape: replicas scraped over real HTTP, their vLLM metrics stored, capacity measured
(the parser itself: tests/backends/test_vllm_wire.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from apps.policy import InstanceSnapshot
from apps.pools.models import Replica, TokenPool
from apps.pools.scrape import ReplicaMetrics, pools_scrape, replica_metrics
from apps.pools.selectors import pool_instance_snapshots
from tests.pools.factories import make_pool
from tests.support.services import free_port
from tests.support.vllm_metrics import VLLM_LEGACY_TWO_ENGINES, VLLM_V1_METRICS


def test_replica_metrics_are_whole_counts_and_an_empty_text_is_an_idle_replica() -> None:
    assert replica_metrics(VLLM_LEGACY_TWO_ENGINES) == ReplicaMetrics(5, 6, 0.9, 32000, None)
    assert replica_metrics("") == ReplicaMetrics(0, 0, 0.0, None, None)


@pytest.fixture
def metrics_server() -> Iterator[str]:
    """A real HTTP server answering /metrics with vLLM's text."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            body = VLLM_V1_METRICS.encode() if self.path == "/metrics" else b"not found"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.django_db
def test_pools_scrape_stores_observations_and_measured_capacity(admin: Any, metrics_server: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    pool = make_pool(admin, replicas=[{"url": metrics_server}, {"url": dead},
                                      {"url": "http://127.0.0.1:9", "enabled": False}])
    updated_before = pool.updated_at
    now = datetime(2026, 11, 22, 3, 0, tzinfo=UTC)

    (summary,) = pools_scrape(now=now, timeout_s=2.0)

    assert (summary.pool, summary.replicas, summary.healthy) == (pool.name, 2, 1)
    up = Replica.objects.get(url=metrics_server)
    assert (up.healthy, up.num_requests_running, up.num_requests_waiting, up.kv_cache_usage) == (True, 3, 2, 0.25)
    assert (up.kv_cache_tokens, up.kv_cache_bytes, up.scraped_at) == (524288, 1073741824, now)
    down = Replica.objects.get(url=dead)
    assert down.healthy is False and down.scrape_error and down.scraped_at == now
    assert Replica.objects.get(url="http://127.0.0.1:9").scraped_at is None  # disabled: not scraped
    pool = TokenPool.objects.get(pk=pool.pk)
    assert pool.measured_kv_cache_tokens_per_replica == 524288
    assert pool.measured_kv_cache_bytes_per_replica == 1073741824
    assert pool.measured_at == now
    assert pool.updated_at == updated_before  # gateways' snapshots are not invalidated by a scrape

    assert summary.snapshots == (
        InstanceSnapshot(queue_depth=2.0, kv_utilization=0.25, updated_at=now.timestamp(), batch_size=3.0),
    )
    (snapshot,) = pool_instance_snapshots(pool=pool)
    assert (snapshot.queue_depth, snapshot.kv_utilization, snapshot.batch_size) == (2.0, 0.25, 3.0)
    assert snapshot.updated_at == now.timestamp()


@pytest.mark.django_db
def test_a_replica_that_went_down_keeps_its_last_numbers_but_is_unhealthy(admin: Any, metrics_server: str) -> None:
    pool = make_pool(admin, replicas=[{"url": metrics_server}])
    pools_scrape(timeout_s=2.0)
    replica = pool.replicas.get()
    Replica.objects.filter(pk=replica.pk).update(url=f"http://127.0.0.1:{free_port()}")
    pools_scrape(timeout_s=2.0)
    replica.refresh_from_db()
    assert replica.healthy is False
    assert replica.num_requests_running == 3
    assert pool_instance_snapshots(pool=pool) == []


@pytest.mark.django_db
def test_pool_api_shows_observations_and_measured_capacity(admin: Any, metrics_server: str) -> None:
    from rest_framework.test import APIClient

    make_pool(admin, replicas=[{"url": metrics_server}])
    client = APIClient()
    client.force_authenticate(admin)
    before = client.get("/api/v1/pools/qwen3-8b/").json()
    assert before["measured_capacity"] is None and before["replicas"][0]["healthy"] is None
    pools_scrape(timeout_s=2.0)
    body = client.get("/api/v1/pools/qwen3-8b/").json()
    assert body["measured_capacity"]["kv_cache_tokens_per_replica"] == 524288
    assert body["replicas"][0]["healthy"] is True
    assert body["replicas"][0]["num_requests_waiting"] == 2


@pytest.mark.django_db
def test_health_changes_are_logged_once(admin: Any, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    make_pool(admin, replicas=[{"url": f"http://127.0.0.1:{free_port()}"}])
    with caplog.at_level(logging.WARNING, logger="apps.pools.scrape"):
        pools_scrape(timeout_s=2.0)
        pools_scrape(timeout_s=2.0)
    assert sum("is unreachable" in r.getMessage() for r in caplog.records) == 1
