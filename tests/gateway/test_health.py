"""The health endpoints: `/healthz` (up), `/readyz` (the database, the state store and a healthy replica of each
pool; what is not ready named), `/health` (as vLLM answers it). No authentication, no request metrics, no
tenant or entitlement names, GET and HEAD."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.gateway.redis_state import RedisStateStore
from tests.support.crash import upstream as backend
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.metrics import scrape
from tests.support.services import PrivateRedis
from tests.support.site import prepare_site, server_log, serving

pytestmark = pytest.mark.django_db

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PROBES = ("/healthz", "/readyz", "/health")


def _no_tenant_names(text: str, *names: str) -> None:
    for name in names:
        assert name not in text, f"{name!r} in {text!r}"


def test_healthz_answers_without_a_key_and_without_starting_the_gateway(gateway_factory: Any) -> None:
    h = gateway_factory()
    response = httpx.get(h.url + "/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    head = httpx.head(h.url + "/healthz")
    assert (head.status_code, head.content) == (200, b"")
    # Nothing but the process answered: the gateway (snapshot from the database, the store) is not started.
    assert h.gateway._started is False


def test_health_answers_as_vllm_does(gateway_factory: Any) -> None:
    h = gateway_factory()
    for method in ("GET", "HEAD"):
        response = httpx.request(method, h.url + "/health")
        assert (response.status_code, response.content) == (200, b""), method
    assert h.gateway._started is False


def test_probes_refuse_other_methods(gateway_factory: Any) -> None:
    h = gateway_factory()
    for path in PROBES:
        response = httpx.post(h.url + path)
        assert response.status_code == 405, path
        assert response.json()["error"]["code"] == "method_not_allowed"


def test_readyz_starts_the_gateway_and_is_ready_with_a_healthy_replica(gateway_factory: Any) -> None:
    h = gateway_factory()
    assert h.gateway._started is False
    response = httpx.get(h.url + "/readyz")
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ok",
                               "checks": {"database": "ok", "state_store": "ok", "pools": {"tiny": "ok"}}}
    assert h.gateway._started is True
    _no_tenant_names(response.text, "acme", h.entitlement.name)
    head = httpx.head(h.url + "/readyz")
    assert (head.status_code, head.content) == (200, b"")


def test_readyz_names_the_pool_once_the_health_probes_find_no_healthy_replica(gateway_factory: Any,
                                                                               upstream_factory: Any) -> None:
    sick, _ = upstream_factory()
    h = gateway_factory(upstreams=[sick], extra_entitlements={"acme-batch": {}})
    assert httpx.get(h.url + "/readyz").status_code == 200
    sick.healthy = False
    # What the gateway knows, not a probe per /readyz: still ready until its health loop has looked.
    assert httpx.get(h.url + "/readyz").status_code == 200
    h.server.call(h.gateway.loops.health_check())
    response = httpx.get(h.url + "/readyz")
    assert response.status_code == 503
    assert response.json() == {"status": "not ready", "checks": {
        "database": "ok", "state_store": "ok", "pools": {"tiny": "no healthy replica"}}}
    _no_tenant_names(response.text, "acme", h.entitlement.name, "acme-batch")
    assert httpx.head(h.url + "/readyz").status_code == 503
    # Liveness does not follow the backends: restarting this process would not bring them back.
    assert httpx.get(h.url + "/healthz").status_code == 200
    sick.healthy = True
    h.server.call(h.gateway.loops.health_check())
    assert httpx.get(h.url + "/readyz").status_code == 200


def test_readyz_names_a_pool_whose_only_replica_refuses_connections(gateway_factory: Any) -> None:
    from tests.gateway.servers import free_port

    h = gateway_factory(upstreams=[], replica_urls=[f"http://127.0.0.1:{free_port()}"], config={"tokenize": False})
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 503
    response = httpx.get(h.url + "/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["pools"] == {"tiny": "no healthy replica"}


@pytest.mark.redis
def test_readyz_names_the_state_store_when_redis_is_stopped(gateway_factory: Any) -> None:
    redis = PrivateRedis()
    redis.start()
    try:
        h = gateway_factory(store=RedisStateStore(url=redis.url, socket_timeout_s=0.5), config={"tokenize": False})
        assert httpx.get(h.url + "/readyz").json()["checks"]["state_store"] == "ok"
        redis.stop()
        response = httpx.get(h.url + "/readyz", timeout=10)
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "not ready"
        assert body["checks"]["state_store"].startswith("unreachable: "), body
        assert body["checks"]["database"] == "ok"
        assert body["checks"]["pools"] == {"tiny": "ok"}
        assert redis.url not in response.text and str(redis.port) not in response.text  # no address leaks
        redis.start()
        deadline = time.monotonic() + 10
        while (response := httpx.get(h.url + "/readyz", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, response.text
            time.sleep(0.1)
        redis.pause()  # a hung Redis: connections open, nothing answers; the PING's timeout answers for it
        response = httpx.get(h.url + "/readyz", timeout=10)
        assert response.status_code == 503
        assert response.json()["checks"]["state_store"].startswith("unreachable: ")
    finally:
        redis.remove()


def _request_series(text: str) -> list[str]:
    """The lines of the per-request counters and histograms (what a request, and only a request, moves)."""
    return sorted(line for line in text.splitlines()
                  if re.match(r"gateway_(requests_admitted_total|requests_rejected_total|request_duration_seconds|"
                              r"ttft_seconds|tokens_total)", line))


@pytest.mark.usefixtures("metrics_token")
def test_probes_are_not_counted_as_requests(gateway_factory: Any) -> None:
    h = gateway_factory(config={"tokenize": False})
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    before = scrape(h.url)
    for _ in range(3):
        for path in PROBES:
            for method in ("GET", "HEAD"):
                assert httpx.request(method, h.url + path).status_code == 200, (method, path)
    after = scrape(h.url)
    assert _request_series(after) == _request_series(before)
    assert not re.search(r"healthz|readyz|/health", after)
    # The comparison can fail: one more completion moves the same series.
    assert httpx.post(h.url + "/v1/chat/completions", json=BODY, headers=h.auth()).status_code == 200
    assert _request_series(scrape(h.url)) != _request_series(after)


@pytest.fixture
def live_backend() -> Iterator[Any]:
    with backend() as server:
        yield server


@pytest.mark.slow
def test_a_served_site_answers_the_probes(tmp_path: Path, live_backend: Any) -> None:
    manifest = documents(tiny_pool("probe-pool", live_backend.url),
                         entitlement("probe-chat", tenant="acme", pool="probe-pool", service_class="guaranteed",
                                     concurrency=2))
    site = prepare_site(tmp_path, tenants=["acme"], manifest=manifest, key_for=["probe-chat"],
                        env={"REDIS_URL": "", "GATEWAY_STATE_BACKEND": "memory", "GATEWAY_HEALTH_INTERVAL_S": "0.2"})
    with serving(site) as (url, _process):
        assert httpx.get(url + "/healthz", timeout=10).json() == {"status": "ok"}
        health = httpx.get(url + "/health", timeout=10)
        assert (health.status_code, health.content) == (200, b"")
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200, ready.text + server_log(site)[-2000:]
        assert ready.json()["checks"] == {"database": "ok", "state_store": "ok", "pools": {"probe-pool": "ok"}}
        live_backend.healthy = False  # the server's own health loop finds it (every 0.2 s here)
        deadline = time.monotonic() + 10
        while (ready := httpx.get(url + "/readyz", timeout=10)).status_code != 503:
            assert time.monotonic() < deadline, ready.text
            time.sleep(0.1)
        assert ready.json()["checks"]["pools"] == {"probe-pool": "no healthy replica"}
        _no_tenant_names(ready.text, "acme", "probe-chat")
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200


@pytest.mark.slow
def test_a_site_without_its_database_is_live_but_not_ready(tmp_path: Path) -> None:
    from apps.simulator.live_site import PreparedSite
    from tests.gateway.servers import free_port

    # Nothing listens on that port: the database is away (as while PostgreSQL restarts).
    env = {**prepare_env(), "DATABASE_URL": f"postgres://tokenpools:secret@127.0.0.1:{free_port()}/tokenpools"}
    site = PreparedSite(env=env, keys={}, workdir=tmp_path)
    with serving(site) as (url, _process):
        assert httpx.get(url + "/healthz", timeout=10).json() == {"status": "ok"}
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        ready = httpx.get(url + "/readyz", timeout=20)
        assert ready.status_code == 503, server_log(site)[-2000:]
        body = ready.json()
        assert body["status"] == "starting"
        assert body["checks"]["gateway"].startswith("not started: ")
        assert body["checks"]["database"].startswith("unreachable: ")
        assert "secret" not in ready.text and "tokenpools@" not in ready.text


def prepare_env() -> dict[str, str]:
    import os

    env = {**os.environ, "LOG_LEVEL": "WARNING", "REDIS_URL": "", "GATEWAY_STATE_BACKEND": "memory"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env
