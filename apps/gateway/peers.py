"""What a gateway process shares with the other processes on its state store, besides the state machine.

The store (`apps.gateway.state.GatewayStateStore`) is the state machine's transitions and reads, each one
implemented by both stores. What differs between a process alone (the in-process store) and several processes
on one Redis is not a transition: it is here, chosen with the store (`peers_for`), and both variants implement
every part of it:

- other processes' transitions reach this process's waiters and victims (`listen`);
- a process that dies leaves reservations behind: they are held under leases, renewed and reaped (`leases`);
- a request's usage is counted by its release in the store and claimed from there by the flush (nothing is lost
  when a process dies), or counted in this process's accumulator (`usage_key`, `usage_flush`);
- the pools' dispatch budgets are one shared controller's, or each process's own (`budgets_shared`);
- the request log goes through the store's Redis, or straight to the database (`request_log`).
"""

from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from apps.gateway.state import GatewayStateStore, StateStoreUnavailable, UsageKey
from apps.gateway.usage import current_minute, usage_batch_apply, usage_counts_parse

if TYPE_CHECKING:
    from apps.gateway.redis_state import RedisStateStore
    from apps.gateway.request_log import RequestLog

# How long a usage claim is this process's to write before another flush may take it over.
USAGE_CLAIM_LEASE_S = 30.0


class Peers(ABC):
    # The pools' dispatch budgets are the pool's, stepped by one shared controller (`PoolBudget.shared`,
    # `apps.gateway.control.aimd_tick_shared`); False: each process steps its own.
    budgets_shared: bool

    @abstractmethod
    async def listen(self) -> None:
        """Deliver other processes' transitions to this process's waiters and victims (runs until cancelled,
        or returns when there is nobody to hear)."""

    @abstractmethod
    async def leases(self, *, pool: str, request_ids: Sequence[str]) -> int:
        """Renew the leases of this process's requests in `pool`, then release those of processes that died
        (waiting ones cancelled, running ones completed with their usage unknown); returns how many."""

    @abstractmethod
    def usage_key(self, *, tenant_id: int, service_tier: str) -> UsageKey | None:
        """Where the store's release counts a served request's tokens; None: the process counts them
        (`UsageAccumulator.add`)."""

    @abstractmethod
    async def usage_flush(self, *, pools: Sequence[str]) -> int:
        """The usage the store counted, claim by claim, to the database (each claim applied once); returns
        the number of claims written."""

    @abstractmethod
    def request_log(self, log: RequestLog) -> None:
        """Route the request log: through the store's Redis (crash-safe as usage) or straight to the database."""


class Alone(Peers):
    """The in-process store: no other process drives its pools, and nothing it holds outlives this process."""

    budgets_shared = False

    async def listen(self) -> None:
        """Every transition runs in this process and notifies its waiters itself: nothing to hear."""

    async def leases(self, *, pool: str, request_ids: Sequence[str]) -> int:
        # A request of a dead process dies with it (the ledger is in its memory): nothing is ever left to reap.
        return 0

    def usage_key(self, *, tenant_id: int, service_tier: str) -> UsageKey | None:
        return None  # the accumulator counts it, and its flush writes it

    async def usage_flush(self, *, pools: Sequence[str]) -> int:
        return 0  # nothing counted in the store

    def request_log(self, log: RequestLog) -> None:
        """Records go straight from this process's buffer to the database."""


class RedisPeers(Peers):
    """Several gateway processes on one Redis (`RedisStateStore`): its events, request leases, usage counts,
    shared budgets and request-log list."""

    budgets_shared = True

    def __init__(self, store: RedisStateStore) -> None:
        self.store = store

    async def listen(self) -> None:
        await self.store.events_listen()

    async def leases(self, *, pool: str, request_ids: Sequence[str]) -> int:
        await self.store.leases_renew(pool=pool, request_ids=list(request_ids))
        return await self.store.leases_reap(pool=pool)

    def usage_key(self, *, tenant_id: int, service_tier: str) -> UsageKey | None:
        return UsageKey(tenant_id, current_minute(), service_tier)

    async def usage_flush(self, *, pools: Sequence[str]) -> int:
        written = 0
        for pool in pools:
            try:
                claims = await self.store.usage_claim(pool=pool, token=uuid.uuid4().hex, lease_s=USAGE_CLAIM_LEASE_S)
            except StateStoreUnavailable:
                return written
            for token, fields in claims.items():
                # A failed write leaves the claim in the store; its lease runs out and a flush takes it again.
                await asyncio.to_thread(usage_batch_apply, token, usage_counts_parse(fields))
                await self.store.usage_done(pool=pool, token=token)
                written += 1
        return written

    def request_log(self, log: RequestLog) -> None:
        log.attach(self.store.redis, self.store.prefix)


def peers_for(store: GatewayStateStore) -> Peers:
    """The peers that go with `store`: Redis' when the store is shared, else a process alone."""
    from apps.gateway.redis_state import RedisStateStore

    return RedisPeers(store) if isinstance(store, RedisStateStore) else Alone()
