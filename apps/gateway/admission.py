"""The admit-or-wait step: size the request for admission (the entitlement's limits now, the backend's own
context window, the client's llm-d SLO hints), offer it to its pool's admission state machine and wait if it says
so: in the entitlement's own queue (over its own limits) or the pool's waiting room (no room in the pool's
capacity or its dispatch budget, the AIMD of seed 002, which is a check of the same machine).

The state machine decides (`apps.policy`'s ordered checks, the entitlement's queue, the priority-ordered waiting
room, preemption);
this step only turns its outcome into the request's fate: a 429/400 for a rejection, a wait that ends
started or expired, a 503 when the shared store is away (or an unaccounted admission when failing open).
Evictions the machine decides anywhere reach the victims through `InFlight.evict`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from apps.gateway.config import GatewayConfig
from apps.gateway.context import ClientGone, RequestContext
from apps.gateway.errors import GatewayError, rejected, unavailable
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.parse import slo_hints
from apps.gateway.routing import ReplicaSet, admission_saturation
from apps.gateway.snapshot import KeyEntry, PoolInfo
from apps.gateway.state import (
    REJECTED,
    WAITING,
    GatewayStateStore,
    Offer,
    RateView,
    Reservation,
    StateStoreBusy,
    StateStoreUnavailable,
)
from apps.gateway.usage import UsageAccumulator
from apps.policy import AdmissionDecision, AdmissionRequest, EntitlementLimits, Reason
from apps.policy.admission import resolved_max_tokens
from apps.policy.quota import QuotaClaim

logger = logging.getLogger(__name__)

PREEMPTED = "preempted"
# Reasons for requests that are malformed rather than over a limit: a 400, as OpenAI answers a context
# overflow, not a 429.
BAD_REQUEST_REASONS = frozenset(
    {Reason.INVALID_REQUEST.value, Reason.MAX_TOKENS_INVALID.value, Reason.CONTEXT_LENGTH_EXCEEDED.value}
)
REASON_TEXT = {
    "entitlement_not_bound": "The entitlement of this key is not bound to pool capacity.",
    "max_tokens_invalid": "'max_tokens' must be a positive integer.",
    "context_length_exceeded": "The prompt plus max_tokens exceeds the model's context window.",
    "invalid_request": "The request could not be sized.",
    "concurrency_limit_exceeded": "Too many requests in flight for this entitlement.",
    "rate_limit_exceeded": "The entitlement's token budget is exhausted.",
    "kv_cache_limit_exceeded": "The entitlement's KV cache allowance is exhausted.",
    "pool_contended": "The pool is contended and this request's priority is below the admission threshold.",
    "quota_exceeded": "The quota of this entitlement or its tenant is used up for the current window.",
    "queue_full": "The entitlement's queue is full: too many of its requests are waiting already.",
    "queue_timeout": "The request waited in its entitlement's queue as long as the entitlement allows.",
}


@dataclass(slots=True)
class Admission:
    """A request's hold on its pool, from the offer to the release (`apps.gateway.account`)."""

    ctx: RequestContext
    entry: KeyEntry
    limits: EntitlementLimits
    pool: PoolInfo
    reservation: Reservation
    decision: AdmissionDecision
    # How the offer ended (running or waiting), for `Admitter.start`.
    offer: Offer


class InFlight:
    """This process's admitted requests by pool: who to cancel when the state machine evicts one, whose
    leases to renew, what the in-flight gauges show, what a shutdown cancels. And the quota holds of requests
    still being offered, by request id (their scope): renewed too, for an offer may wait behind its
    entitlement's releases for longer than a lease after its quota reserve."""

    def __init__(self) -> None:
        self.by_pool: dict[str, dict[str, RequestContext]] = {}
        self.offering: dict[str, str] = {}

    def add(self, pool: str, ctx: RequestContext) -> None:
        self.by_pool.setdefault(pool, {})[ctx.request_id] = ctx

    def remove(self, pool: str, request_id: str) -> None:
        self.by_pool.get(pool, {}).pop(request_id, None)

    def ids(self, pool: str) -> list[str]:
        return list(self.by_pool.get(pool, ()))

    def contexts(self) -> Iterator[RequestContext]:
        for contexts in list(self.by_pool.values()):
            yield from list(contexts.values())

    def evict(self, request_id: str) -> None:
        """The state machine evicted this request (here or in another process): end it with a clean error."""
        for contexts in self.by_pool.values():
            ctx = contexts.get(request_id)
            if ctx is not None and not ctx.preempted:
                ctx.preempted = True
                if ctx.task is not None and not ctx.task.done():
                    ctx.task.cancel(PREEMPTED)
                return


class Admitter:
    def __init__(self, *, store: GatewayStateStore, config: GatewayConfig, metrics: GatewayMetrics,
                 usage: UsageAccumulator, in_flight: InFlight,
                 forget: Callable[[Reservation], Awaitable[None]]) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.usage = usage
        self.in_flight = in_flight
        # Release whatever the store holds under a request id whose offer did not come back (idempotent).
        self.forget = forget
        self._limits_cache: dict[tuple[EntitlementLimits, int], EntitlementLimits] = {}
        # This process's requests waiting now, by entitlement (`tokenpools_queue_depth`; Prometheus sums the
        # processes).
        self.waiting: dict[str, int] = {}
        self.waiting_by_pool: dict[str, int] = {}
        metrics.add_gauge("tokenpools_queue_depth",
                          "Requests of this process waiting in their entitlement's queue or the pool's waiting room.",
                          ("entitlement",), lambda: {(name,): float(count) for name, count in self.waiting.items()})

    async def admit(self, ctx: RequestContext, entry: KeyEntry, pool: PoolInfo, replicas: ReplicaSet, *,
                    input_tokens: int, max_tokens: int | None, max_model_len: int | None = None) -> Admission:
        """Offered: a hold on the pool (running, or waiting until `start`) or a GatewayError. From here the
        request path releases the hold, once, whatever happens (`apps.gateway.account`). `max_model_len` is
        the backend's own context window when it told (its /tokenize answer), which beats the configured
        one; the replicas' saturation counts when saturation admission is on."""
        limits = self._limits(entry, max_model_len)
        slo_ms, tier = slo_hints(ctx)
        request = AdmissionRequest(ctx.request_id, input_tokens, max_tokens, slo_ms, tier)
        saturation = admission_saturation(replicas, self.config.saturation_admission)
        quota = quota_claim(entry, limits, request, time.time(), lease_s=self.config.lease_s)
        if quota is not None:
            self.in_flight.offering[ctx.request_id] = quota.scope
        try:
            offer = await self._offer(limits, pool, request, saturation, quota)
        finally:
            # From here: in flight, refused (its hold refunded), or released by `forget` (deferred if the store is away).
            self.in_flight.offering.pop(ctx.request_id, None)
        ctx.view, ctx.quota = offer.view, offer.quota
        if offer.state == REJECTED:
            raise self._rejection(entry, limits, offer.decision)
        assert offer.reservation is not None
        admission = Admission(ctx, entry, limits, pool, offer.reservation, offer.decision, offer)
        self.in_flight.add(pool.name, ctx)
        self.metrics.admitted.inc((limits.entitlement_id, str(limits.service_class)))
        return admission

    async def start(self, admission: Admission) -> None:
        """Started (within its limits, the pool's capacity and its dispatch budget), or a GatewayError (its wait
        ran out); a cancellation (client gone) propagates. Either way nothing reached a backend and the caller's
        release gives the hold back."""
        ctx, entry, limits, offer = admission.ctx, admission.entry, admission.limits, admission.offer
        if offer.state == WAITING and not await self._wait(ctx, limits, offer):
            raise self._rejection(entry, limits, self._turned_away(offer.decision))
        if ctx.disconnected:
            # The watcher's cancellation can be lost in a store call: Python 3.11's asyncio.wait_for (redis-py's
            # socket timeout) returns a reply that came in with the cancellation and drops the cancellation
            # (CPython gh-86296). Seen under load: a gone client's request was sent and served in full.
            raise ClientGone()
        ctx.service_tier = served_tier(admission)

    def _limits(self, entry: KeyEntry, max_model_len: int | None) -> EntitlementLimits:
        limits = entry.limits_at(time.time())
        if max_model_len is None or max_model_len == limits.context_window or max_model_len < 1:
            return limits
        key = (limits, max_model_len)
        adjusted = self._limits_cache.get(key)
        if adjusted is None:
            if len(self._limits_cache) > 10_000:
                self._limits_cache.clear()
            adjusted = self._limits_cache[key] = dataclasses.replace(limits, context_window=max_model_len)
        return adjusted

    async def _offer(self, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest,
                     saturation: float, quota: QuotaClaim | None) -> Offer:
        try:
            return await self.store.offer(limits=limits, pool=pool, request=request, saturation=saturation,
                                          quota=quota)
        except BaseException as exc:
            # The offer may have taken effect in the store though its answer never came back here (a reply
            # lost to the socket timeout, a client that left while it was awaited): whatever the store holds
            # under this request id (quota, slot, KV, a waiting or running record) is released, now or, if
            # the store is away, by the deferred releases once it is back.
            await self.forget(_lost(limits, pool, request, quota))
            if not isinstance(exc, StateStoreUnavailable):
                raise
            if self.config.fail_open and exc.may_fail_open:
                return _unaccounted(limits, pool, request)
            raise store_error(exc) from None

    async def _wait(self, ctx: RequestContext, limits: EntitlementLimits, offer: Offer) -> bool:
        """Wait in the entitlement's queue or the pool's waiting room; True once started. A cancellation (client
        gone, shutdown) propagates and the request path's release cancels the reservation."""
        assert offer.reservation is not None
        own = offer.decision.own_queue
        # The state machine's own deadlines: the entitlement's queue wait, or the pool's acquire timeout.
        timeout_s = limits.own_queue_wait_s if own else self.store.config.wait_timeout_s
        waited_from = time.perf_counter()
        pool = offer.reservation.pool
        self.waiting[limits.entitlement_id] = self.waiting.get(limits.entitlement_id, 0) + 1
        self.waiting_by_pool[pool] = self.waiting_by_pool.get(pool, 0) + 1
        try:
            return await self.store.wait(reservation=offer.reservation, timeout_s=timeout_s,
                                         wake_s=offer.decision.retry_after_s if own else None)
        except StateStoreUnavailable as exc:
            raise store_error(exc) from None
        finally:
            self.waiting[limits.entitlement_id] -= 1
            self.waiting_by_pool[pool] -= 1
            waited = time.perf_counter() - waited_from
            ctx.queue_ms = waited * 1000.0
            self.metrics.queue_wait.observe((limits.entitlement_id,), waited)

    def _turned_away(self, decision: AdmissionDecision) -> AdmissionDecision:
        """The rejection of a waiter whose wait ran out: queue_timeout from its entitlement's queue (retry after
        the expected service time: the queue was full of work), pool_contended from the pool's room."""
        if decision.own_queue:
            return decision._replace(reason=Reason.QUEUE_TIMEOUT.value, queued=False,
                                     retry_after_s=self.store.config.expected_service_s)
        return decision._replace(reason=Reason.POOL_CONTENDED.value, retry_after_s=1.0, queued=False)

    def _rejection(self, entry: KeyEntry, limits: EntitlementLimits, decision: AdmissionDecision) -> GatewayError:
        reason = decision.reason
        if reason in BAD_REQUEST_REASONS:
            self.metrics.rejected.inc((limits.entitlement_id, str(limits.service_class), reason))
            param = "max_tokens" if reason == Reason.MAX_TOKENS_INVALID.value else "messages"
            return GatewayError(400, reason, REASON_TEXT.get(reason, reason), param=param)
        self.count_rejection(entry, limits, reason)
        retryable = decision.retryable and reason != Reason.ENTITLEMENT_NOT_BOUND.value
        return rejected(reason, REASON_TEXT.get(reason, reason), retry_after_s=decision.retry_after_s,
                        retryable=retryable)

    def count_rejection(self, entry: KeyEntry, limits: EntitlementLimits, reason: str) -> None:
        self.metrics.rejected.inc((limits.entitlement_id, str(limits.service_class), reason))
        self.usage.reject(tenant_id=entry.tenant_id, entitlement=entry.entitlement,
                          service_tier=str(entry.limits.service_class))
        self.usage.key_used(entry.key_id, time.time())


def served_tier(admission: Admission) -> str:
    """The class the request runs as: what its reservation says (a lower class when spilled over or demoted),
    else its entitlement's own."""
    return admission.reservation.service_tier or str(admission.limits.service_class)


def store_error(exc: Exception) -> GatewayError:
    """503: the store is away (`state_store_unavailable`), or there but too busy to answer in time
    (`state_store_busy`: no connection of the pool came free; never failed open)."""
    if isinstance(exc, StateStoreBusy):
        return unavailable("state_store_busy", f"The gateway state store is busy, try again: {exc}")
    return unavailable("state_store_unavailable", f"The gateway state store is unreachable: {exc}")


def quota_claim(entry: KeyEntry, limits: EntitlementLimits, request: AdmissionRequest,
                now_epoch: float, lease_s: float | None = None) -> QuotaClaim | None:
    """What the request reserves against its entitlement's and tenant's quotas: the prompt plus the
    `max_tokens` check (2) will charge, held under a lease of `lease_s` that this process renews while the
    request lives. None without quotas, or for a request check (2) rejects anyway."""
    if not entry.quotas:
        return None
    max_tokens = resolved_max_tokens(limits, request)
    if max_tokens is None:
        return None
    now = dt.datetime.fromtimestamp(now_epoch, dt.UTC)
    return QuotaClaim(request.request_id, request.input_tokens, max_tokens,
                      tuple(rule.charge_at(now) for rule in entry.quotas), now_epoch, scope=str(entry.tenant_id),
                      lease_s=lease_s)


def _lost(limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, quota: QuotaClaim | None) -> Reservation:
    """A release by request id for an offer whose outcome is unknown: it releases what the store holds
    under the id, with nothing used (nothing reached a backend), and changes nothing if it holds none."""
    return Reservation(request.request_id, limits.entitlement_id, pool.name, 0, 0.0, 0.0, request.max_tokens or 0,
                       request.input_tokens, False, quota_scope=None if quota is None else quota.scope)


def _unaccounted(limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest) -> Offer:
    """Failing open while the store is away: admitted, with nothing held anywhere to release."""
    max_tokens = request.max_tokens or limits.default_max_tokens
    decision = AdmissionDecision(True, Reason.ADMITTED.value, max_tokens=max_tokens,
                                 token_cost=request.input_tokens + max_tokens)
    reservation = Reservation(request.request_id, limits.entitlement_id, pool.name, decision.token_cost, 0.0,
                              0.0, max_tokens, request.input_tokens, False, accounted=False)
    return Offer(decision, reservation, RateView(), "running")

