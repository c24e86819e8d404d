"""The 15-minute history: the ring buffer, a real Redis's capped lists, and which of them a process uses."""

from __future__ import annotations

from typing import Any

import pytest

from apps.dashboard import history as dashboard_history
from apps.dashboard.history import MemoryHistory, RedisHistory
from apps.dashboard.samples import PoolSample

T0 = 1_800_000_000.0


@pytest.mark.asyncio
async def test_memory_history_keeps_the_last_length_samples_and_drops_stale_ones() -> None:
    history = MemoryHistory(length=5, seconds=100)
    for i in range(8):
        await history.append(PoolSample(time=T0 + i, pool="qwen"))
    await history.append(PoolSample(time=T0, pool="other"))
    assert [s.time - T0 for s in await history.recent("qwen", now=T0 + 7)] == [3, 4, 5, 6, 7]
    assert [s.time - T0 for s in await history.recent("qwen", now=T0 + 105)] == [5, 6, 7]
    assert len(await history.recent("other", now=T0)) == 1


@pytest.mark.redis
@pytest.mark.asyncio
async def test_redis_history_is_a_capped_list_per_pool(redis_url: str) -> None:
    import redis.asyncio as aioredis

    history = RedisHistory(url=redis_url, length=5, seconds=100)
    await history.clear()
    for i in range(8):
        await history.append(PoolSample(time=T0 + i, pool="qwen", budget=i))
    await history.append(PoolSample(time=T0, pool="other"))
    assert [s.budget for s in await history.recent("qwen", now=T0 + 7)] == [3, 4, 5, 6, 7]
    client = aioredis.from_url(redis_url)
    try:
        assert await client.llen(history.key("qwen")) == 5  # LTRIM keeps the list capped
        assert await client.ttl(history.key("qwen")) > 0
    finally:
        await client.aclose()
    # Another process (another store object) reads the same history.
    assert len(await RedisHistory(url=redis_url).recent("qwen", now=T0 + 7)) == 5
    await history.clear()


def test_history_store_follows_redis_url(settings: Any) -> None:
    try:
        settings.REDIS_URL = ""
        dashboard_history.reset_history_store()
        assert isinstance(dashboard_history.history_store(), MemoryHistory)
        settings.REDIS_URL = "redis://127.0.0.1:1/0"
        dashboard_history.reset_history_store()
        assert isinstance(dashboard_history.history_store(), RedisHistory)
    finally:
        dashboard_history.reset_history_store()
