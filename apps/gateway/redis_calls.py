"""The Redis store's wire: its function library, its connections, and what a failure of either means.

`RedisStateStore` (apps.gateway.redis_state) calls its transitions through `ScriptCalls.call`: on a single
Redis the calls share one connection (apps.gateway.resp); on a cluster, or with a client handed in, they go
through redis-py, which routes each by its key's slot (apps.gateway.redis_cluster).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from apps.gateway import redis_cluster
from apps.gateway.resp import MultiplexedRedis
from apps.gateway.state import StateStoreBusy, StateStoreUnavailable

LUA = Path(__file__).with_name("lua")
SCRIPTS = ("read", "commit", "release", "expire", "evict", "refuse", "sync", "tick", "dynamics", "leases",
           "budget", "usage_claim", "usage_done", "quota_reserve", "quota_settle", "quota_read",
           "quota_leases", "fields", "in_flight", "dynamics_read")
# Entries that only read (Redis may run them anywhere, replicas included).
READ_ONLY = frozenset({"read", "quota_read", "fields", "in_flight", "dynamics_read"})
# The process's connections to Redis: one blocking pool shared by every request; a call waits up to the
# pool timeout for a free connection (a burst queues for a moment; it is not an outage).
MAX_CONNECTIONS = 128
POOL_TIMEOUT_S = 10.0
# What a call may raise that `store_failure` reads (redis-py's own, and what its cluster client lets through
# while a node goes away).
CALL_ERRORS = (RedisError, OSError, redis_cluster.SlotNotCoveredError, AttributeError, TypeError, RuntimeError)


class FastBlockingConnectionPool(aioredis.BlockingConnectionPool):
    """redis-py's blocking pool with a fast path: a connection that is free (or may still be opened) is taken as
    the plain pool takes it, with no timer and no condition; only a caller that must wait for one pays for those
    (on this machine they cost about 28 us a call, three calls a request: issue 23's benchmark)."""

    async def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> Any:
        if not self._in_maintenance and self.can_get_connection():
            return await aioredis.ConnectionPool.get_connection(self)
        return await super().get_connection()

    async def release(self, connection: Any) -> None:
        if self._in_maintenance or self._condition._waiters:  # somebody waits for it: hand it over
            await super().release(connection)
            return
        await aioredis.ConnectionPool.release(self, connection)


def store_failure(exc: BaseException) -> StateStoreUnavailable | None:
    """What a Redis error means for the gateway: `StateStoreUnavailable` only when Redis cannot be reached
    (refused, connect or read timeout, reset, loading, a read-only replica after a failover);
    `StateStoreBusy` when it is there but no pooled connection came free in time or it is busy running
    a script; None for anything else (a script error is a bug: it propagates, a 500, never a 503)."""
    text = str(exc)
    if isinstance(exc, MaxConnectionsError) or (isinstance(exc, RedisConnectionError)
                                                and "No connection available" in text):
        return StateStoreBusy(f"Redis busy (no free connection: {text})")
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError, ReadOnlyError,
                        *redis_cluster.FAILOVER_ERRORS)) or redis_cluster.connection_race(exc):
        return StateStoreUnavailable(f"Redis unreachable ({type(exc).__name__}: {exc})")
    if isinstance(exc, ResponseError) and text.startswith("BUSY"):
        return StateStoreBusy(f"Redis busy ({text})")
    return None


@cache
def function_library() -> tuple[str, str]:
    """The Lua library as one Redis function library, and its version: the transitions (machine.lua), then
    every entry as a function (`tp_<version>_<entry>`). Loaded once per Redis
    (FUNCTION LOAD), not sent with every call; the version, a hash of the source, keeps processes of
    different releases on their own functions during a rolling deploy."""
    body = [(LUA / "machine.lua").read_text()]
    for name in SCRIPTS:
        body.append(f"local function entry_{name}()\n{(LUA / f'{name}.lua').read_text()}\nend")
    source = "\n".join(body)
    version = hashlib.sha1(source.encode()).hexdigest()[:12]
    registrations = []
    for name in SCRIPTS:
        flags = ", flags={'no-writes'}" if name in READ_ONLY else ""
        registrations.append(
            f"redis.register_function{{function_name='tp_{version}_{name}', "
            f"callback=function(keys, args) bind(keys, args) return entry_{name}() end{flags}}}")
    return f"#!lua name=tokenpools_{version}\n" + source + "\n" + "\n".join(registrations) + "\n", version


class ScriptCalls:
    """The store's calls to its Lua functions, on the connections it opened (or the client handed in)."""

    def __init__(self, *, url: str, socket_timeout_s: float, client: aioredis.Redis | None, max_connections: int,
                 pool_timeout_s: float, cluster: bool) -> None:
        # Short socket timeouts: an unreachable store must turn into a fast 503, not a hung request. One
        # blocking pool: a burst of requests waits for a free connection instead of failing for want of one.
        # On a cluster (`apps.gateway.redis_cluster`): a pool of connections per node, calls routed by key.
        self.redis: Any = client or (redis_cluster.cluster_client(
            url, socket_timeout_s=socket_timeout_s, max_connections=max_connections) if cluster
            else aioredis.Redis(connection_pool=FastBlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=pool_timeout_s,
                socket_connect_timeout=socket_timeout_s, socket_timeout=socket_timeout_s, decode_responses=True,
                health_check_interval=30)))
        # The scripts' calls share one connection (apps.gateway.resp: a third of redis-py's CPU a call); other
        # commands, a cluster and a client handed in go through redis-py.
        self.shared = None if cluster or client is not None else MultiplexedRedis.from_url(
            url, timeout_s=socket_timeout_s)
        self.library, self.version = function_library()

    async def call(self, name: str, keys: list[str], args: Sequence[Any]) -> Any:
        """Call the entry `name` of this release's library; its failures as the gateway reads them."""
        return await self.guarded(self._fcall(f"tp_{self.version}_{name}", keys, args))

    async def _fcall(self, function: str, keys: list[str], args: Sequence[Any]) -> Any:
        try:
            return await self._send(function, keys, args)
        except ResponseError as exc:
            if "function not found" not in str(exc).lower():
                raise
            # A Redis that never saw this release's library, or lost it (restarted without its data; on a
            # cluster, a node that joined without it): loaded again (every primary), then the call again.
            await redis_cluster.load_library(self.redis, self.library)
            return await self._send(function, keys, args)

    def _send(self, function: str, keys: list[str], args: Sequence[Any]) -> Any:
        if self.shared is not None:  # one shared connection (apps.gateway.resp): a single Redis
            return self.shared.call("FCALL", function, len(keys), *keys, *args)
        return self.redis.fcall(function, len(keys), *keys, *args)

    @staticmethod
    async def guarded(operation: Any) -> Any:
        """Await a call to Redis; its failures as the gateway reads them (`store_failure`), the one place."""
        try:
            return await operation
        except CALL_ERRORS as exc:
            error = store_failure(exc)
            if error is None:
                raise
            raise error from exc

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.aclose()
        await redis_cluster.close(self.redis)
