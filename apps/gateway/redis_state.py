"""The shared store: the admission state machine of every pool in Redis, for every gateway process.

Each transition of `apps.policy.AdmissionLedger` is one atomic Lua function (`apps/gateway/lua/`: one
library of transitions plus one entry each, loaded into Redis once as a function library, Redis 7 or later). An
offer is two: `READ` returns the snapshot that `apps.policy.admit` decides on in Python (one policy
implementation), and `COMMIT` applies the decision only if the pool's version is unchanged (compare-and-set;
else the caller decides again), starting the request or putting it in the pool's priority-ordered waiting
room, with the evictions the decision allows. A start decided on the snapshot the last reply about the
entitlement brought is `COMMIT` alone (`apps.gateway.redis_snapshot`: checked against `READ`'s, exactly).
`RELEASE`, `EXPIRE`, `EVICT`, `SYNC` and `LEASES` start waiters in priority order wherever they run; every
start, expiry and eviction is published on `tp:gw:events`, where each gateway process hears about its own
waiters and victims (and a waiter also polls its request's state, in case a notice is lost).

Time is Redis' own clock (one for every process) unless a clock is injected (the conformance suite runs
the scripts on a fake one). A pool's keys share one hash tag, so the scripts stay within one cluster slot.
The pool's dispatch budget (seed 002's AIMD, set by `BUDGET`) is one more limit the scripts check with the
pool's capacity: a request starts only while fewer than the budget run.

Beside this module: the wire (the function library, the connections, what a failure means) in
`apps.gateway.redis_calls`, the scripts' arguments and replies in `apps.gateway.redis_args`, tenant quotas in
`apps.gateway.redis_quota`, the snapshots an offer decides on in `apps.gateway.redis_snapshot`. What stays here is
one class, the store's transitions; the offer's compare-and-set loop is most of it, and reads top to bottom.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from apps.gateway import redis_cluster
from apps.gateway.redis_args import (
    bucket_args,
    capacity_args,
    queue_args,
    reply_float,
    reserved_args,
    tick_rows,
    usage_claims,
    usage_minute,
)
from apps.gateway.redis_calls import CALL_ERRORS, MAX_CONNECTIONS, POOL_TIMEOUT_S, ScriptCalls
from apps.gateway.redis_quota import RedisQuotas
from apps.gateway.redis_snapshot import MARK, KeptSnapshots, fingerprint, read_snapshot, standing_args
from apps.gateway.snapshot import EntitlementIndex, PoolInfo
from apps.gateway.state import (
    REJECTED,
    GatewayStateStore,
    Offer,
    RateView,
    Reservation,
    StateStoreUnavailable,
    UsageKey,
    rate_view,
    reservation_for,
)
from apps.policy import (
    AdmissionConfig,
    AdmissionDecision,
    AdmissionRequest,
    Clock,
    Dynamics,
    EntitlementLimits,
    EntitlementState,
    EntitlementUsage,
    admit,
)
from apps.policy.admission import (
    CAPACITY_REASONS,
    DEFAULT_ADMISSION_CONFIG,
    Reason,
)
from apps.policy.ledger import RUNNING, WAITING, ReleaseResult
from apps.policy.priority import DynamicsConfig
from apps.policy.queues import ENQUEUE, offered_priority, own_limits_decision, own_retry_s
from apps.policy.quota import QuotaCharge, QuotaClaim, QuotaStanding, QuotaVerdict, binding
from apps.policy.quota_offer import Decide, Refund, Reserve, Step, quota_offer, run_async, settlement
from apps.policy.tiers import DEMOTED_CLASS, served_as, spills, tier_pool
from apps.policy.window import WindowReading, window_reading

logger = logging.getLogger(__name__)

PREFIX = "tp:gw:"
# COMMIT's mode for a request that joins its entitlement's queue (it reads as `waiting` afterwards).
QUEUED = "queued"
EVENTS = "tp:gw:events"
MAX_ATTEMPTS = 12
CAS_BACKOFF_S = 0.0005
CAS_BACKOFF_CAP_S = 0.05


class RedisStateStore(GatewayStateStore):
    poll_s = 0.25

    def __init__(
        self, *, url: str = "", socket_timeout_s: float = 1.0, client: aioredis.Redis | None = None,
        prefix: str = PREFIX, clock: Clock | None = None, config: AdmissionConfig = DEFAULT_ADMISSION_CONFIG,
        dynamics_config: DynamicsConfig | None = None, lease_s: float = 10.0,
        max_connections: int = MAX_CONNECTIONS, pool_timeout_s: float = POOL_TIMEOUT_S, cluster: bool = False,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.clock = clock
        self.config = config
        self.dynamics_config = dynamics_config or DynamicsConfig()
        self.lease_s = lease_s
        self.scripts = ScriptCalls(url=url, socket_timeout_s=socket_timeout_s, client=client,
                                   max_connections=max_connections, pool_timeout_s=pool_timeout_s, cluster=cluster)
        self.redis: Any = self.scripts.redis
        self._quotas = RedisQuotas(call=self._call, prefix=prefix, now=self._now)
        self._queue_arg_cache: dict[int, tuple[EntitlementLimits, str]] = {}
        self._tick_index = EntitlementIndex()
        # Admissions to one pool from this process go one at a time, so compare-and-set conflicts
        # only come from other processes (a retry storm among our own tasks would be pure waste).
        self._pool_locks: dict[str, asyncio.Lock] = {}
        self._offers_waiting: dict[tuple[str, str], int] = {}
        self._kept = KeptSnapshots()
        # Releases in progress: by pool and entitlement, and those no single connection puts ahead of later calls.
        self._releasing: dict[tuple[str, str], set[asyncio.Future[None]]] = {}
        self._unordered_releases: set[asyncio.Future[None]] = set()

    # --- keys and calls ---------------------------------------------------------------------------------

    def _base(self, pool: str) -> str:
        return f"{self.prefix}{{{pool}}}:"

    def _now(self) -> str:
        return "" if self.clock is None else repr(float(self.clock.now()))

    def _queue_arg(self, limits: EntitlementLimits) -> str:
        """`_queue_args`, once per limits object (the snapshot's, shared by its requests)."""
        hit = self._queue_arg_cache.get(id(limits))
        if hit is not None and hit[0] is limits:
            return hit[1]
        if len(self._queue_arg_cache) > 10_000:
            self._queue_arg_cache.clear()
        value = queue_args(limits)
        self._queue_arg_cache[id(limits)] = (limits, value)
        return value

    def _clock_now(self) -> float:
        """This process's reading of the store's clock (Retry-After estimates; Redis keeps its own time)."""
        return time.time() if self.clock is None else float(self.clock.now())

    async def _call(self, name: str, keys: list[str], args: Sequence[Any]) -> Any:
        return await self.scripts.call(name, keys, args)

    # --- the transitions -------------------------------------------------------------------------------

    async def sync_pool(self, *, pool: PoolInfo, saturation: float = 0.0) -> None:
        signature, pairs = reserved_args(pool)
        queues: list[str] = []
        for limits in pool.entitlements:
            queues += [limits.entitlement_id, queue_args(limits),
                       "1" if limits.state is EntitlementState.BOUND else "0"]
        started = await self._call("sync", [self._base(pool.name)],
                                   [self._now(), *capacity_args(pool, saturation, self.config), signature,
                                    len(pairs), *pairs, *queues])
        self._kept.forget(pool.name)
        self._notify(started=started)

    async def _read(self, limits: EntitlementLimits, pool: PoolInfo, request_id: str = "") -> list[str]:
        """READ's snapshot of the entitlement, its fields (`apps.gateway.redis_snapshot`)."""
        _, pairs = reserved_args(pool)
        return str(await self._call("read", [self._base(pool.name)],
                                    [self._now(), limits.entitlement_id, *bucket_args(limits), request_id,
                                     *pairs])).split(" ")

    async def offer(
        self, *, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, saturation: float = 0.0,
        quota: QuotaClaim | None = None,
    ) -> Offer:
        if self._unordered_releases:  # releases begun before this offer come first (see `release`)
            await asyncio.wait(list(self._unordered_releases))
        if quota is None:
            return await self._offer_settling(limits, pool, request, saturation, None)

        # The quota sequence is apps.policy.quota_offer's (as AdmissionLedger._request_under_quota drives it):
        # this store answers its steps with the quota scripts and the offer.
        async def answer(step: Step) -> Any:
            if isinstance(step, Reserve):
                return await self._quotas.reserve(step.claim)
            if isinstance(step, Decide):
                return await self._offer_settling(limits, pool, request, saturation, step.hold, demote=step.demoted)
            if isinstance(step, Refund):
                return await self._quotas.settle(step.claim.scope, step.claim.request_id, 0, 0)
            return QuotaVerdict(True, binding(await self.quota_standings(scope=step.claim.scope,
                                                                         charges=step.claim.charges)))

        outcome = await run_async(quota_offer(quota, bound=limits.state is EntitlementState.BOUND), answer)
        standing = None if outcome.verdict is None else outcome.verdict.standing
        if outcome.offer is None:
            assert outcome.refusal is not None
            return Offer(outcome.refusal, None, RateView(), REJECTED, quota=standing)
        offer: Offer = outcome.offer
        if offer.reservation is not None and outcome.hold is not None:
            offer.reservation.quota_scope = outcome.hold.scope
        return replace(offer, quota=standing)

    async def _offer_settling(self, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest,
                              saturation: float, quota: QuotaClaim | None, demote: bool = False) -> Offer:
        """The offer, one at a time per pool in this process, but for a start on a kept snapshot, which waits for
        no other offer (COMMIT's `still_admitted` keeps it exact); a failure gives the quota's reservation back."""
        lock = self._pool_locks.get(pool.name)
        if lock is None:
            lock = self._pool_locks[pool.name] = asyncio.Lock()
        # Offers of an entitlement waiting here for the lock: the one holding it asks COMMIT for the snapshot
        # after it, on which the next decides (one call), where the one kept from before it is out of date.
        waiting = (pool.name, limits.entitlement_id)
        try:
            fresh = None
            if not demote:
                tried = await self._offer(limits, pool, request, saturation, kept_only=True)
                if isinstance(tried, Offer):
                    return tried
                fresh = tried
            if lock.locked():  # READ's snapshot from before the wait would be out of date after it
                fresh = None
            self._offers_waiting[waiting] = self._offers_waiting.get(waiting, 0) + 1
            try:
                await lock.acquire()
            finally:
                self._offers_waiting[waiting] -= 1
                if not self._offers_waiting[waiting]:
                    del self._offers_waiting[waiting]
            try:
                offer = await self._offer(limits, pool, request, saturation, demote, fresh=fresh)
                assert isinstance(offer, Offer)  # (without kept_only, every path answers)
                return offer
            finally:
                lock.release()
        except BaseException:
            if quota is not None:  # nothing was admitted: the reservation comes back (if Redis answers)
                with contextlib.suppress(StateStoreUnavailable):
                    await self._quotas.settle(quota.scope, request.request_id, 0, 0)
            raise

    # --- quotas (apps.gateway.redis_quota) -------------------------------------------------------------

    async def quota_leases(self, *, scope: str, request_ids: Sequence[str], lease_s: float) -> list[str]:
        return await self._quotas.leases(scope=scope, request_ids=request_ids, lease_s=lease_s)

    async def quota_standings(self, *, scope: str, charges: Sequence[QuotaCharge]) -> list[QuotaStanding]:
        return await self._quotas.standings(scope=scope, charges=charges)

    async def _tier_decision(self, tier: EntitlementLimits, owner: EntitlementLimits, owner_usage: EntitlementUsage,
                             version: str, pool: PoolInfo, request: AdmissionRequest,
                             saturation: float) -> AdmissionDecision | None:
        """`admit`'s decision for a request offered under its entitlement's tier (`apps.policy.tiers`), or None
        when the pool changed since the entitlement's own snapshot (`version`)."""
        snapshot = read_snapshot(await self._read(tier, pool), tier, pool, saturation)
        if snapshot.version != version:
            return None
        return served_as(admit(tier, snapshot.usage, tier_pool(snapshot.pool_usage, owner, owner_usage), request,
                               self.config), tier)

    async def _decided_on(self, limits: EntitlementLimits, pool: PoolInfo, request_id: str, kept: list[str] | None,
                          fresh: list[str] | None) -> tuple[list[str], str]:
        """The snapshot an offer decides on, and its fingerprint when it is a kept one ('' for READ's, which
        COMMIT checks by the pool's version)."""
        if kept is not None:
            return kept, fingerprint(kept)
        return (fresh if fresh is not None else await self._read(limits, pool, request_id)), ""

    async def _offer(
        self, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, saturation: float,
        demote: bool = False, kept_only: bool = False, fresh: list[str] | None = None,
    ) -> Offer | list[str] | None:
        """The offer, decided on `fresh` (READ's snapshot) when given. With `kept_only`, only a start on the kept
        snapshot: where that is not one, None, or READ's snapshot when COMMIT found the kept one out of date."""
        signature, pairs = reserved_args(pool)
        owner = limits
        # A start may be decided on the snapshot this process kept from its last reply for the entitlement, and
        # committed in one call (apps.gateway.redis_snapshot); anything else is decided on READ's.
        releasing = None if demote else self._releasing.get((pool.name, owner.entitlement_id))
        if releasing:  # the snapshot its reply brings, not the one kept from before it
            await asyncio.wait(list(releasing))
        kept = None if demote or fresh is not None else self._kept.get(pool.name, owner.entitlement_id)
        if kept_only and kept is None:
            return None
        attempt = 0
        while attempt < MAX_ATTEMPTS:
            limits = owner
            fields, print_ = await self._decided_on(limits, pool, request.request_id, kept, fresh)
            fresh = None
            snapshot = read_snapshot(fields, limits, pool, saturation)
            usage, version, queue_length = snapshot.usage, snapshot.version, snapshot.queue_length
            if not print_ and snapshot.duplicate:
                duplicate = AdmissionDecision(False, Reason.INVALID_REQUEST.value, self.config.never_retry_s,
                                              retryable=False, check=0)
                return Offer(duplicate, None, RateView(), REJECTED)
            tier: EntitlementLimits | None = None
            if demote:
                tier = owner.tier_limits(DEMOTED_CLASS)
            else:
                decision = admit(limits, usage, snapshot.pool_usage, request, self.config)
                if spills(limits, decision, queue_length):
                    assert limits.spillover_class is not None
                    tier = limits.tier_limits(limits.spillover_class)
            if print_ and (tier is not None or not decision.admitted or queue_length > 0):
                # Not a start on its own limits (a request behind others in its queue would join them): decided
                # again on READ's snapshot. What passes here starts (`own_limits_decision` leaves an admitted
                # decision with an empty queue as it is).
                if kept_only:
                    return None
                kept = None
                continue
            if tier is not None:
                # Offered as the lower class (AdmissionLedger._spillover, _request_demoted): decided on the same
                # version of the pool as the entitlement's own decision, or read again.
                tier_decision = await self._tier_decision(tier, owner, usage, version, pool, request, saturation)
                if tier_decision is None:
                    await asyncio.sleep(random.uniform(0, min(CAS_BACKOFF_CAP_S, CAS_BACKOFF_S * 2**attempt)))
                    attempt += 1
                    continue
                if demote or tier_decision.admitted:
                    limits, decision = tier, tier_decision
            capacity, rate = bucket_args(limits)
            mode = RUNNING if decision.admitted else WAITING
            decision, route = own_limits_decision(
                limits, decision, queue_length,
                partial(own_retry_s, oldest_start=snapshot.oldest_start, now=self._clock_now(),
                        expected_service_s=self.config.expected_service_s),
                partial(offered_priority, limits, request, pool.mean_slo_ms, usage.burst, usage.debt, self.config))
            if route == ENQUEUE:
                mode = QUEUED
            # A start on its own limits is checked by its snapshot (`still_admitted`, else the fingerprint), whether
            # kept or READ's: an offer of this process that started meanwhile does not turn it down.
            checked = print_ or (fingerprint(fields) if decision.admitted and limits is owner and not queue_length
                                 else "")
            if not decision.admitted and not decision.queued:
                if decision.reason in CAPACITY_REASONS:
                    await self._call("refuse", [self._base(pool.name)],
                                     [self._now(), limits.entitlement_id, decision.token_cost, repr(decision.kv_bytes)])
                if limits is owner:  # READ's snapshot: the next offer may start on it
                    self._kept.keep(pool.name, owner.entitlement_id, " ".join(fields))
                return Offer(decision, None, rate_view(limits, usage.in_flight, usage.tokens_available), REJECTED)
            raw = await self._call(
                "commit", [self._base(pool.name)],
                [self._now(), version, request.request_id, limits.entitlement_id,
                 mode, repr(decision.priority), decision.token_cost,
                 repr(decision.kv_bytes), request.input_tokens, decision.max_tokens,
                 "1" if limits.traits.evictable else "0", "1" if decision.evict else "0", capacity, rate,
                 *capacity_args(pool, saturation, self.config), repr(self.lease_s), checked,
                 fields[MARK] if checked else "", signature, self._queue_arg(limits),
                 "1" if self._offers_waiting.get((pool.name, owner.entitlement_id)) else "",
                 standing_args(limits, decision, fields) if checked else "", *pairs],
            )
            if int(raw[0]) == 1:
                if limits is owner:  # the snapshot after it, when asked for: the waiting offer decides on it
                    self._kept.keep(pool.name, owner.entitlement_id, str(raw[7]))
                offer = self._committed(limits, pool, request, decision, raw)
                if limits is not owner:  # spilled over: the headers speak of the entitlement's own limits
                    offer = replace(offer, view=rate_view(owner, usage.in_flight, usage.tokens_available))
                return offer
            if checked:  # the snapshot was out of date: decide again on READ's, which the reply brings
                self._kept.keep(pool.name, owner.entitlement_id, str(raw[1]))
                kept, fresh = None, str(raw[1]).split(" ")
                if kept_only:
                    return fresh
                if not print_:  # READ's own was out of date already: a try, as below but with no wait
                    attempt += 1
                continue
            # Another process took room in between: decide again on fresh state, after a jittered wait that
            # doubles with each try, so two processes admitting in step do not keep colliding.
            await asyncio.sleep(random.uniform(0, min(CAS_BACKOFF_CAP_S, CAS_BACKOFF_S * 2**attempt)))
            attempt += 1
        contended = AdmissionDecision(False, Reason.POOL_CONTENDED.value, retry_after_s=0.1, check=5)
        return Offer(contended, None, RateView(), REJECTED)

    def _committed(self, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest,
                   decision: AdmissionDecision, raw: list[Any]) -> Offer:
        state, started, evicted = raw[1], tuple(raw[2]), tuple(raw[3])
        if state == WAITING:
            self._expect(request.request_id)
        self._notify(started=[s for s in started if s != request.request_id], evicted=evicted)
        tokens = math.inf if limits.bucket_capacity is None else reply_float(raw[5])
        return Offer(decision, reservation_for(limits, pool.name, request, decision),
                     rate_view(limits, int(reply_float(raw[4])), tokens), state, started, evicted)

    async def release(
        self, *, reservation: Reservation, prompt_tokens: int | None = None, completion_tokens: int | None = None,
        usage: UsageKey | None = None,
    ) -> ReleaseResult:
        self._forget(reservation.request_id)
        done = asyncio.get_running_loop().create_future()
        # The entitlement's next offer in this process waits for this reply: it brings the snapshot to decide on
        # (one call), where the kept one, from before this release, would be out of date (two).
        entitlement = (reservation.pool, reservation.entitlement)
        self._releasing.setdefault(entitlement, set()).add(done)
        # On the one connection, written before this first yields (if connected; else behind the connection's
        # lock, ahead of later calls): Redis applies it before any later call of this process. Through
        # redis-py's pool, or with a quota settle after it, nothing orders it: every next offer waits for it
        # (GatewayStateStore.release: a release once begun comes first).
        unordered = self.scripts.shared is None or reservation.quota_scope is not None
        if unordered:
            self._unordered_releases.add(done)
        try:
            return await self._release(reservation, prompt_tokens, completion_tokens, usage)
        finally:
            self._unordered_releases.discard(done)
            waiting = self._releasing.get(entitlement)
            if waiting is not None:
                waiting.discard(done)
                if not waiting:
                    del self._releasing[entitlement]
            done.set_result(None)

    async def _release(self, reservation: Reservation, prompt_tokens: int | None, completion_tokens: int | None,
                       usage: UsageKey | None) -> ReleaseResult:
        raw = await self._call(
            "release", [self._base(reservation.pool)],
            [self._now(), reservation.request_id, "" if completion_tokens is None else int(completion_tokens),
             "" if prompt_tokens is None else int(prompt_tokens),
             "" if usage is None else str(usage.tenant_id), "" if usage is None else usage_minute(usage)],
        )
        self._notify(started=raw[1])
        outcome = str(raw[0])
        # The entitlement's snapshot after the release ('' when nothing was released): its next offer may start on it.
        self._kept.keep(reservation.pool, reservation.entitlement, str(raw[4]))
        if reservation.quota_scope is not None:  # settled as the ledger settles it (apps.policy.quota_offer)
            prompt, output = settlement(outcome, reservation.input_tokens, reservation.max_tokens, completion_tokens,
                                        prompt_tokens)
            await self._quotas.settle(reservation.quota_scope, reservation.request_id, prompt, output)
        return ReleaseResult(outcome, tuple(raw[1]), reply_float(raw[2]))

    async def evict(self, *, pool: str, request_id: str) -> ReleaseResult:
        raw = await self._call("evict", [self._base(pool)], [self._now(), request_id])
        self._notify(started=raw[1])
        return ReleaseResult(str(raw[0]), tuple(raw[1]), reply_float(raw[2]))

    async def expire(self, *, pool: str) -> list[str]:
        raw = await self._call("expire", [self._base(pool)], [self._now()])
        expired = [str(request_id) for request_id in raw[0]]
        self._notify(started=[str(request_id) for request_id in raw[1]], gone=expired)
        return expired

    async def tick(
        self, *, entitlements: Mapping[str, Sequence[EntitlementLimits]]
    ) -> dict[str, dict[str, WindowReading]]:
        by_pool: dict[str, dict[str, WindowReading]] = {}
        for pool, pool_limits in entitlements.items():
            by_name = self._tick_index.of(pool, pool_limits)
            if not by_name:
                continue
            raw = await self._call("tick", [self._base(pool)], [self._now()])
            if int(raw[0]) != 1:
                continue  # the window is too short to measure (or the pool was never used): it stays open
            # Those at rest were not read and have no reading here (theirs is RESTING_READING: as the ledger's
            # `tick_changes`).
            readings = by_pool[pool] = {}
            elapsed = float(raw[1])
            updates: list[str] = []
            for name, figures, dynamics in tick_rows(raw):
                if name not in by_name:
                    # Not Bound in the snapshot (deleted, expired): its window closes with the others' but its
                    # debt and burst stay as they are (no limits here to weigh them against).
                    continue
                reading = window_reading(
                    figures, by_name[name], dynamics, elapsed,
                    expected_service_s=self.config.expected_service_s, config=self.dynamics_config,
                )
                readings[name] = reading
                updates += [name, repr(reading.dynamics.debt), repr(reading.dynamics.burst)]
            if updates:
                await self._call("dynamics", [self._base(pool)], updates)
        return by_pool

    # --- reads ------------------------------------------------------------------------------------------

    async def entitlement_usage(self, *, limits: EntitlementLimits, pool: str) -> EntitlementUsage:
        info = PoolInfo(pool, "-", (), 0, 0.0, 0, 1)
        return read_snapshot(await self._read(limits, info), limits, info, 0.0).usage

    async def record_fields(self, *, pool: str, field: str, records: Sequence[str]) -> list[Any]:
        """`field` of each of the pool's records ("pool", "ent:<id>", "req:<id>"; MessagePack maps that only
        the scripts decode): a number as its exact decimal string, a string as stored, None when absent."""
        if not records:
            return []
        return [value or None for value in await self._call("fields", [self._base(pool)], [field, *records])]

    async def pool_running(self, *, pool: str) -> int:
        return int(reply_float((await self.record_fields(pool=pool, field="running", records=["pool"]))[0]))

    async def in_flight(self, *, pool: PoolInfo) -> dict[str, int]:
        raw = await self._call("in_flight", [self._base(pool.name)], [])
        return {str(raw[index]): int(reply_float(raw[index + 1])) for index in range(0, len(raw), 2)}

    async def dynamics(self, *, pool: str, entitlements: Sequence[str]) -> dict[str, Dynamics]:
        if not entitlements:
            return {}
        raw = await self._call("dynamics_read", [self._base(pool)], list(entitlements))
        return {name: Dynamics(reply_float(raw[2 * index]), reply_float(raw[2 * index + 1]))
                for index, name in enumerate(entitlements)}

    async def request_state(self, *, reservation: Reservation) -> str | None:
        values = await self.record_fields(pool=reservation.pool, field="state",
                                          records=[f"req:{reservation.request_id}"])
        # An evicted request's record waits for its late release: it has left the state machine.
        return values[0] if values[0] in (RUNNING, WAITING) else None

    # --- usage counted by the releases (`apps.gateway.peers.RedisPeers`) ---------------------------------

    async def usage_claim(self, *, pool: str, token: str, lease_s: float) -> dict[str, dict[str, str]]:
        return usage_claims(await self._call("usage_claim", [self._base(pool)],
                                             [self._now(), token, repr(float(lease_s))]))

    async def usage_done(self, *, pool: str, token: str) -> None:
        await self._call("usage_done", [self._base(pool)], [token])

    # --- leases and other processes' transitions (`apps.gateway.peers.RedisPeers`) ----------------------

    async def leases_renew(self, *, pool: str, request_ids: list[str]) -> None:
        if request_ids:
            await self._call("leases", [self._base(pool)], ["renew", self._now(), repr(self.lease_s), *request_ids])

    async def leases_reap(self, *, pool: str) -> int:
        """Release reservations whose lease ran out (their process died): waiting ones are cancelled,
        running ones complete with their usage unknown (their charge stays spent)."""
        reaped = await self._call("leases", [self._base(pool)], ["reap", self._now()])
        return len(reaped)

    async def events_listen(self) -> None:
        """Started (`s:`), expired (`x:`) and evicted (`e:`) notices of every process, to this one's waiters
        and victims; resubscribes when Redis comes back."""
        while True:
            try:
                async with redis_cluster.subscription(self.redis, EVENTS) as pubsub:
                    while True:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is None or message.get("type") != "message":
                            continue
                        kind, _, request_id = str(message["data"]).partition(":")
                        if kind == "s":
                            self._notify(started=[request_id], remember=True)
                        elif kind == "x":
                            self._notify(gone=[request_id], remember=True)
                        elif kind == "e":
                            self._notify(evicted=[request_id])
            except CALL_ERRORS as exc:
                if not isinstance(exc, RedisError | OSError | redis_cluster.SlotNotCoveredError) and (
                        not redis_cluster.connection_race(exc)):
                    raise
                await asyncio.sleep(1.0)  # Redis (or this node) away: subscribe again when one answers

    # --- the pool budget shared by every gateway process -----------------------------------------------

    async def pool_budgets_set(self, *, budgets: Mapping[str, int | None]) -> list[str]:
        started: list[str] = []
        for pool, budget in budgets.items():
            raw = await self._call("budget", [self._base(pool)], [self._now(), "" if budget is None else int(budget)])
            started += [str(request_id) for request_id in raw]
        self._notify(started=started, remember=True)
        return started

    async def pool_budget(self, *, pool: str) -> int | None:
        value = (await self.record_fields(pool=pool, field="budget", records=["pool"]))[0]
        budget = None if value is None else int(reply_float(value))
        return None if budget is None or budget < 0 else budget

    async def ping(self, *, timeout_s: float) -> None:
        # Through this store's own pool: a pool exhausted by requests is as unready as a Redis that is away.
        await asyncio.wait_for(redis_cluster.ping(self.redis), timeout_s)

    async def close(self) -> None:
        await self.scripts.close()
