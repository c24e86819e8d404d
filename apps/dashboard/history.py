"""The last 15 minutes of samples per pool, so that a page opened now shows the recent past: `HistoryStore`, with
two implementations behind one interface (convention 5), an in-process ring buffer (embedded) and a capped Redis
list per pool (`RPUSH` + `LTRIM`), chosen by `REDIS_URL` (`history_store`)."""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from typing import Any

from apps.dashboard.samples import PoolSample

logger = logging.getLogger(__name__)

HISTORY_SECONDS = 15 * 60
SAMPLE_PERIOD_S = 1.0
HISTORY_LENGTH = int(HISTORY_SECONDS / SAMPLE_PERIOD_S)


class HistoryStore(ABC):
    """The last `HISTORY_SECONDS` of samples per pool (so a page opened now shows the recent past)."""

    def __init__(self, *, length: int = HISTORY_LENGTH, seconds: float = HISTORY_SECONDS) -> None:
        self.length = length
        self.seconds = seconds

    @abstractmethod
    async def append(self, sample: PoolSample) -> None: ...

    @abstractmethod
    async def _all(self, pool: str) -> list[PoolSample]: ...

    async def recent(self, pool: str, *, now: float | None = None) -> list[PoolSample]:
        """Samples of the last `seconds`, oldest first (a paused sampler leaves no stale points)."""
        samples = await self._all(pool)
        cutoff = (time.time() if now is None else now) - self.seconds
        return [s for s in samples if s.time >= cutoff]

    async def clear(self) -> None:  # noqa: B027 - optional hook (tests)
        pass


class MemoryHistory(HistoryStore):
    """A ring buffer per pool. Appended from the server's loop, read from consumers: a lock keeps the
    deque consistent should a tick thread append directly."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pools: dict[str, deque[PoolSample]] = {}
        self._lock = threading.Lock()

    async def append(self, sample: PoolSample) -> None:
        with self._lock:
            ring = self._pools.get(sample.pool)
            if ring is None:
                ring = self._pools[sample.pool] = deque(maxlen=self.length)
            ring.append(sample)

    async def _all(self, pool: str) -> list[PoolSample]:
        with self._lock:
            return list(self._pools.get(pool, ()))

    async def clear(self) -> None:
        with self._lock:
            self._pools.clear()


class RedisHistory(HistoryStore):
    """A capped list per pool: `RPUSH` then `LTRIM` to the last `length` samples, in one pipeline, so
    every server process appends to and reads the same history."""

    PREFIX = "tokenpools:dashboard:history:"

    def __init__(self, *, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.url = url

    def _client(self) -> Any:
        import redis.asyncio as aioredis

        # A client per call: callers come from different event loops (server, ticks via asyncio.run), and an
        # asyncio connection pool is tied to the loop that created it. At 1 Hz the connect is negligible.
        return aioredis.from_url(self.url)

    def key(self, pool: str) -> str:
        return self.PREFIX + pool

    async def append(self, sample: PoolSample) -> None:
        client = self._client()
        try:
            key = self.key(sample.pool)
            pipe = client.pipeline(transaction=True)
            pipe.rpush(key, json.dumps(sample.to_dict(), separators=(",", ":")))
            pipe.ltrim(key, -self.length, -1)
            # A pool nobody samples any more leaves nothing behind.
            pipe.expire(key, int(self.seconds) * 2)
            await pipe.execute()
        finally:
            await client.aclose()

    async def _all(self, pool: str) -> list[PoolSample]:
        client = self._client()
        try:
            raw = await client.lrange(self.key(pool), 0, -1)
        finally:
            await client.aclose()
        samples: list[PoolSample] = []
        for item in raw:
            try:
                samples.append(PoolSample.from_dict(json.loads(item)))
            except (ValueError, KeyError, TypeError):
                logger.warning("dropping a malformed history entry of pool %s", pool)
        return samples

    async def clear(self) -> None:
        client = self._client()
        try:
            keys = [k async for k in client.scan_iter(match=self.PREFIX + "*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


_history: HistoryStore | None = None
_history_guard = threading.Lock()


def history_store() -> HistoryStore:
    """The process-wide history: Redis when `REDIS_URL` is set (shared by every process), else in memory."""
    global _history
    with _history_guard:
        if _history is None:
            from django.conf import settings

            url = getattr(settings, "REDIS_URL", "")
            _history = RedisHistory(url=url) if url else MemoryHistory()
        return _history


def reset_history_store(store: HistoryStore | None = None) -> None:
    """Replace the process-wide history (tests; a settings change)."""
    global _history
    with _history_guard:
        _history = store
