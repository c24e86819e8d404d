"""The state store's Redis client, on one Redis or on a Redis Cluster (`GATEWAY_REDIS_CLUSTER`).

On a cluster every key one transition touches shares its pool's hash tag (`tp:gw:{<pool>}:...`), so each
function call (FCALL) is routed by its first key to the one primary that owns the pool's slot; a tenant's
quota keys share their own tag (`{q:<tenant>}`). The function library is loaded on every primary (a replica
gets it by replication, so a promoted one has it; a node that lacks it answers "Function not found" and the
store loads it again, then retries).

Events: the scripts PUBLISH on one channel, which a cluster broadcasts to every node over its bus, so a
gateway process subscribes on any one node, whatever pools it serves, and moves to another node when that one
goes away. Sharded pub/sub (SPUBLISH on a per-pool channel) would save the broadcast, but each process would
then hold a subscription per pool and shard and follow them through failovers; the events are rare (a waiter
started, a victim evicted, a waiter expired) and a waiter also polls its request's state, so a notice lost
while the subscriber moves costs at most one poll.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)

# Cluster errors that mean the slot's primary is away or being replaced (a failover): the gateway answers
# 503 state_store_unavailable and the next request finds the new primary.
FAILOVER_ERRORS = (ClusterDownError, ClusterError, MasterDownError, SlotNotCoveredError, TryAgainError)


def connection_race(exc: BaseException) -> bool:
    """A connection torn down under a write (a node killed, or the cluster client dropping a node's connections
    after another call failed) leaks from redis-py's asyncio connection as AttributeError, TypeError or
    RuntimeError ("the handler is closed") instead of ConnectionError (redis/redis-py#4287, #3546; fix
    proposed in #4217): that is the store away, not a bug of ours, when raised inside redis-py's connection."""
    if not isinstance(exc, AttributeError | TypeError | RuntimeError):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("redis/asyncio/connection.py"):
            return True
        tb = tb.tb_next
    return False


# How often a cluster call is tried again on a connection error or a redirect (each after rereading the
# cluster's slots): few, so that a request to a pool whose primary died answers 503 in well under a second
# instead of waiting out the failover.
CLUSTER_RETRIES = 3


class StateCluster(RedisCluster):
    """redis-py's cluster client, routing FCALL by its keys without asking a node: the stock client sends
    COMMAND GETKEYS for every FCALL (it does so only for commands whose keys it cannot find itself, and it
    special-cases EVAL but not FCALL), one more round trip per transition."""

    async def _determine_slot(self, command: str, *args: Any) -> int:
        if command.upper() in ("FCALL", "FCALL_RO") and len(args) >= 2 and int(args[1]) > 0:
            slots = {self.keyslot(key) for key in args[2: 2 + int(args[1])]}
            if len(slots) != 1:
                raise RedisClusterException(f"{command} {args[0]}: all keys must map to one slot")
            return slots.pop()
        return int(await super()._determine_slot(command, *args))


def cluster_client(url: str, *, socket_timeout_s: float, max_connections: int) -> RedisCluster:
    """A cluster client from any node's URL (the others are discovered). `require_full_coverage=False`: a
    slot without a primary (during a failover) must not stop the client from serving the other slots."""
    return StateCluster.from_url(
        url, decode_responses=True, socket_connect_timeout=socket_timeout_s, socket_timeout=socket_timeout_s,
        require_full_coverage=False, max_connections=max_connections,
        retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=CLUSTER_RETRIES),
    )


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


async def load_library(client: Any, library: str) -> None:
    """FUNCTION LOAD the library (REPLACE): on one Redis, or on every primary of a cluster that answers
    (a primary that is away gets it when it comes back as a replica, by replication)."""
    if not is_cluster(client):
        await client.function_load(library, replace=True)
        return
    await client.initialize()
    failures: list[BaseException] = []
    primaries = client.get_primaries()
    for node in primaries:
        try:
            await client.execute_command("FUNCTION LOAD", "REPLACE", library, target_nodes=node)
        except (RedisError, OSError) as exc:
            failures.append(exc)
    if len(failures) == len(primaries):
        raise failures[0]


async def ping(client: Any) -> None:
    """One Redis answers, or every primary of the cluster does (a slot without one is a store partly away)."""
    if is_cluster(client):
        await client.ping(target_nodes=RedisCluster.PRIMARIES)
    else:
        await client.ping()


async def close(client: Any) -> None:
    if is_cluster(client):
        await client.aclose()
    else:
        await client.aclose(close_connection_pool=True)


@contextlib.asynccontextmanager
async def subscription(client: Any, channel: str) -> AsyncIterator[Any]:
    """A pub/sub subscribed to `channel`: on the store's own connection pool for one Redis; on a cluster, on a
    connection of its own to one node picked at random (PUBLISH reaches every node), another on each retry."""
    own: aioredis.Redis | None = None
    if is_cluster(client):
        await client.initialize()
        node = random.choice(client.get_nodes())
        kwargs = node.connection_kwargs
        own = aioredis.Redis(host=node.host, port=node.port, decode_responses=True,
                             socket_connect_timeout=kwargs.get("socket_connect_timeout"))
        pubsub = own.pubsub(ignore_subscribe_messages=True)
    else:
        pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(channel)
        yield pubsub
    finally:
        with contextlib.suppress(Exception):
            await pubsub.aclose()
        if own is not None:
            with contextlib.suppress(Exception):
                await own.aclose()
