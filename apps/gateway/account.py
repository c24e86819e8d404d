"""The account step: give the request's hold back and record what it used (and its time to first token).

`finish` runs once per admitted request, from the request path's `finally` (apps/gateway/app.py), just before
the end of the answer goes to the client (clients send their next request as soon as they see the end) or on
the way out after a rejection while waiting, an error, a disconnect or a preemption:
the dispatch slot goes back, the state machine completes the request (refunding what it did not use) or
cancels it if it was still waiting, and the tokens it used go to the metrics and the usage records.
The end of the answer waits for the release to begin, not for the store's answer to it: a release once begun
comes before any later offer of this process (`GatewayStateStore.release`), and on Redis its answer is a
round trip the client would otherwise wait for. `settle` waits for the releases still on their way (stop).

A release the store could not take (Redis away) is not dropped: it is kept and tried again every second
until the store takes it (`retry_pending`), so nothing stays held once the store is back; releases are
idempotent in the store, so a retry of one that did land changes nothing (its usage is not counted twice
either: a store that counts usage does it in the release that finds the request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from apps.gateway.admission import Admission, InFlight
from apps.gateway.budget import PoolBudget
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.peers import Peers
from apps.gateway.state import GatewayStateStore, Reservation, StateStoreUnavailable, UsageKey
from apps.gateway.usage import UsageAccumulator

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingRelease:
    reservation: Reservation
    prompt_tokens: int | None
    completion_tokens: int | None
    usage: UsageKey | None


class Accountant:
    def __init__(self, *, store: GatewayStateStore, peers: Peers, metrics: GatewayMetrics, usage: UsageAccumulator,
                 in_flight: InFlight, budgets: Mapping[str, PoolBudget]) -> None:
        self.store = store
        # Where a served request's usage is counted: in the store's release (a shared store), or here.
        self.peers = peers
        # Each pool's dispatch budget controller, whose AIMD reads the TTFTs seen here.
        self.budgets = budgets
        self.metrics = metrics
        self.usage = usage
        self.in_flight = in_flight
        self.pending: list[PendingRelease] = []
        self._releasing: set[asyncio.Task[None]] = set()
        # Releases on their way to the store (their leases are renewed until they land or are deferred).
        self.releasing: dict[str, PendingRelease] = {}

    def first_token(self, admission: Admission, seconds: float) -> None:
        """The relay saw the first token `seconds` after the request came in."""
        # Labelled by entitlement too: the dashboard draws each entitlement's p99 against its own SLO.
        self.metrics.ttft.observe((admission.pool.name, admission.entry.entitlement), seconds)
        budget = self.budgets.get(admission.pool.name)
        if budget is not None:
            # The pool's budget (AIMD) answers the pool's load: a wait in the entitlement's own queue is the
            # entitlement's own limit, and counted in it would shrink every tenant's budget for one tenant's excess.
            own_wait_s = admission.ctx.queue_ms / 1000.0 if admission.decision.own_queue else 0.0
            budget.observe_ttft(max(0.0, seconds - own_wait_s))

    async def finish(self, admission: Admission) -> None:
        """Release everything the request holds and account for it (call once)."""
        ctx, reservation = admission.ctx, admission.reservation
        self.in_flight.remove(admission.pool.name, ctx.request_id)
        # The key served (or was offered) a request: its last_used_at, written by the usage flush.
        self.usage.key_used(admission.entry.key_id, time.time())
        prompt, completion = ctx.served.counts(reservation.input_tokens)
        entitlement = admission.entry.entitlement
        # A shared store counts usage in the release itself (nothing is lost if this process dies).
        tier = ctx.service_tier or str(admission.limits.service_class)
        usage = self.peers.usage_key(tenant_id=admission.entry.tenant_id, service_tier=tier) if (
            ctx.proxied and reservation.accounted) else None
        in_store = usage is not None
        if ctx.proxied:
            await self._begin_release(reservation, prompt, completion, usage)
        else:
            # Nothing reached a backend (expired, cancelled): the whole charge comes back.
            await self._begin_release(reservation, 0, 0, None)
        self.metrics.tokens.inc((entitlement, "prompt"), prompt)
        self.metrics.tokens.inc((entitlement, "completion"), completion)
        self.metrics.duration.observe((admission.pool.name,), time.perf_counter() - ctx.started)
        if not ctx.proxied:
            return
        self.metrics.tier_requests.inc((entitlement, tier))
        self.metrics.tier_tokens.inc((entitlement, tier, "prompt"), prompt)
        self.metrics.tier_tokens.inc((entitlement, tier, "completion"), completion)
        if not in_store:
            self.usage.add(tenant_id=admission.entry.tenant_id, entitlement=entitlement, prompt_tokens=prompt,
                           completion_tokens=completion, service_tier=tier)

    async def release(self, reservation: Reservation, prompt_tokens: int | None, completion_tokens: int | None,
                      usage: UsageKey | None) -> None:
        """Release and wait for the store's answer (or the deferral)."""
        task = self._release_task(reservation, prompt_tokens, completion_tokens, usage)
        if task is not None:
            await asyncio.shield(task)

    async def _begin_release(self, reservation: Reservation, prompt_tokens: int | None,
                             completion_tokens: int | None, usage: UsageKey | None) -> None:
        """Release, waiting only until the release has begun (its task's first step): from then on it comes
        before any later offer of this process (`GatewayStateStore.release`)."""
        if self._release_task(reservation, prompt_tokens, completion_tokens, usage) is not None:
            await asyncio.sleep(0)  # the task was scheduled first: its first step runs before this resumes

    def _release_task(self, reservation: Reservation, prompt_tokens: int | None, completion_tokens: int | None,
                      usage: UsageKey | None) -> asyncio.Task[None] | None:
        if not reservation.accounted:
            return None
        # A task of its own: a cancellation of the request (shutdown, client gone, twice) must not leave the
        # reservation held, nor lose the deferral when the store is away.
        task = asyncio.ensure_future(self._release_or_defer(
            PendingRelease(reservation, prompt_tokens, completion_tokens, usage)))
        self._releasing.add(task)
        task.add_done_callback(self._release_done)
        return task

    def _release_done(self, task: asyncio.Task[None]) -> None:
        self._releasing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug (a store away is deferred instead)
            logger.error("release failed", exc_info=task.exception())

    async def settle(self) -> None:
        """Wait for the releases still on their way to the store (each lands or is deferred)."""
        while self._releasing:
            await asyncio.wait(list(self._releasing))

    async def forget(self, reservation: Reservation) -> None:
        """Release what the store holds under the reservation's request id, with nothing used (an offer whose
        answer was lost); a store that holds nothing under it changes nothing."""
        await self.release(reservation, 0, 0, None)

    async def _release_or_defer(self, item: PendingRelease) -> None:
        request_id = item.reservation.request_id
        self.releasing[request_id] = item
        try:
            await self.store.release(reservation=item.reservation, prompt_tokens=item.prompt_tokens,
                                     completion_tokens=item.completion_tokens, usage=item.usage)
        except StateStoreUnavailable:
            logger.warning("release of %s deferred: state store unreachable", request_id)
            self.pending.append(item)
        finally:
            self.releasing.pop(request_id, None)

    def unreleased(self) -> list[PendingRelease]:
        """Releases not in the store yet (on their way, or deferred): their holds' leases stay renewed, so that
        no reaper counts a request whose release is coming as spent in full."""
        return [*self.releasing.values(), *self.pending]

    def pending_ids(self, pool: str) -> list[str]:
        """Requests of `pool` whose release has not reached the store yet (their leases are kept alive)."""
        return [item.reservation.request_id for item in self.unreleased() if item.reservation.pool == pool]

    async def retry_pending(self) -> int:
        """Try the deferred releases again (every second); returns how many the store took."""
        done = 0
        while self.pending:
            item = self.pending[0]
            try:
                await self.store.release(reservation=item.reservation, prompt_tokens=item.prompt_tokens,
                                         completion_tokens=item.completion_tokens, usage=item.usage)
            except StateStoreUnavailable:
                break
            self.pending.pop(0)
            done += 1
        return done
