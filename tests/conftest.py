"""Session-wide fixtures: real Redis and PostgreSQL servers started on demand."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
