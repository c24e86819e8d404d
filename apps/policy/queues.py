"""The entitlement's own queue, as pure functions the ledger and the Redis store's Python side share.

A request refused only by its entitlement's own concurrency, token bucket or KV bytes (checks 3 and 4 of
`admit`) waits in the entitlement's queue, and so does every request offered while that queue holds any
(first come first served); a full queue refuses at once (queue_full), a class without a queue (spot,
preemptible, or `queue_max` 0) refuses at once as before. Retry-After comes from the state: the bucket's
refill time, or the earliest expected end among the entitlement's running requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from apps.policy.admission import (
    DEFAULT_ADMISSION_CONFIG,
    OWN_LIMIT_REASONS,
    AdmissionConfig,
    AdmissionDecision,
    AdmissionRequest,
    EntitlementLimits,
    EntitlementUsage,
    Reason,
    new_tuple,
    request_priority,
)

ENQUEUE = "enqueue"
# Looked up once: an enum's `.value` is a Python-level property.
_QUEUED = Reason.QUEUED.value
_RATE_LIMITED = Reason.RATE_LIMIT_EXCEEDED.value
_QUEUE_FULL = Reason.QUEUE_FULL.value
FULL = "full"


def own_queue_route(limits: EntitlementLimits, decision: AdmissionDecision, queue_length: int) -> str | None:
    """`ENQUEUE`, `FULL`, or None when `admit`'s decision stands. A request joins the queue when its own limits
    refused it (retryable), or when the queue holds requests already and checks 1 and 2 let it through."""
    if decision.check in (1, 2):
        return None
    if queue_length <= 0 and (decision.admitted or decision.queued or not decision.retryable
                              or decision.reason not in OWN_LIMIT_REASONS):
        return None
    if limits.own_queue_max <= 0 or limits.own_queue_wait_s <= 0:
        return None
    return FULL if queue_length >= limits.own_queue_max else ENQUEUE


def own_limits_decision(limits: EntitlementLimits, decision: AdmissionDecision, queue_length: int,
                        retry_s: Callable[[AdmissionDecision], float],
                        priority: Callable[[], float]) -> tuple[AdmissionDecision, str | None]:
    """`admit`'s decision once the entitlement's own queue has had its say, and the route it took: `ENQUEUE` (the
    request joins the queue: a `queued_decision`), `FULL` (refused as queue_full), or None (the decision stands;
    refused by its own limits, its Retry-After is when the entitlement will have room). `retry_s` (`own_retry_s`
    on the state) and `priority` (`offered_priority`) are asked only when needed. A tier has no queue."""
    route = None if limits.tier_of else own_queue_route(limits, decision, queue_length)
    if route == FULL:
        return full_decision(decision, retry_s(decision)), FULL
    if route == ENQUEUE:
        return queued_decision(decision, priority(), retry_s(decision)), ENQUEUE
    if not decision.admitted and not decision.queued and decision.retryable and decision.reason in OWN_LIMIT_REASONS:
        # decision._replace(retry_after_s=...), written out (`new_tuple`): every throttled request comes here.
        return new_tuple(AdmissionDecision, (decision[0], decision[1], retry_s(decision), *decision[3:])), None
    return decision, None


def own_retry_s(decision: AdmissionDecision, oldest_start: float | None, now: float,
                expected_service_s: float) -> float:
    """When the entitlement will have room, as far as the state tells: the bucket's refill time for a token
    refusal, else the earliest expected end among its running requests (the oldest start plus the expected
    service time), at least a twentieth of that service time. Once that end has passed (a request running
    longer than expected) the state knows no better than the expected service time: a client told to come back
    at once would only be refused again."""
    if decision.reason == _RATE_LIMITED and decision.retry_after_s > 0:
        return decision.retry_after_s
    if oldest_start is None or oldest_start + expected_service_s <= now:
        return expected_service_s
    return max(oldest_start + expected_service_s - now, expected_service_s / 20.0)


def queued_decision(decision: AdmissionDecision, priority: float, retry_after_s: float) -> AdmissionDecision:
    """The decision of a request that waits in its entitlement's queue (`AdmissionDecision.own_queue`)."""
    # decision._replace(admitted=False, reason=QUEUED, retry_after_s=..., queued=True, evict=False, priority=...,
    # check=...), every field in order (`new_tuple`: `_replace` is interpreted Python, and every queued request
    # comes here).
    return new_tuple(AdmissionDecision, (
        False, _QUEUED, retry_after_s, True, False, decision.retryable, priority, decision.max_tokens,
        decision.token_cost, decision.kv_bytes, decision.borrowed, decision.slo_tier,
        decision.check if decision.check in (3, 4) else 3, decision.served_class))


def full_decision(decision: AdmissionDecision, retry_after_s: float) -> AdmissionDecision:
    # AdmissionDecision(False, QUEUE_FULL, retry_after_s, check=..., max_tokens=..., token_cost=..., kv_bytes=...,
    # slo_tier=...), every field in order (`new_tuple`).
    return new_tuple(AdmissionDecision, (
        False, _QUEUE_FULL, retry_after_s, False, False, True, 0.0, decision.max_tokens, decision.token_cost,
        decision.kv_bytes, False, decision.slo_tier, decision.check or 3, ""))


def within_own_limits(limits: EntitlementLimits, usage: EntitlementUsage, cost: float, kv_bytes: float,
                      pool_has_room: bool) -> bool:
    """Whether the head of an entitlement's queue may leave it now: checks 3 and 4 of `admit` on the levels
    now, where borrowing beyond the entitlement's own limits (a class that may burst, under its ceilings) needs
    room free in the pool now (`pool_has_room`). The Redis store's `own_fits` (apps/gateway/lua/machine.lua)
    is this, step for step."""
    may_burst = limits._traits.may_burst
    borrow = False
    r_e = limits.concurrency
    if r_e is not None and usage.in_flight >= r_e:
        ceiling = limits.burst_concurrency
        if not may_burst or (ceiling is not None and usage.in_flight >= ceiling):
            return False
        borrow = True
    if limits.tokens_per_second is not None and usage.tokens_available < cost:
        return False
    chi = limits.kv_bytes
    if chi is not None and kv_bytes > 0 and usage.kv_bytes_in_flight + kv_bytes > chi:
        ceiling_kv = limits.burst_kv_bytes
        if not may_burst or (ceiling_kv is not None and usage.kv_bytes_in_flight + kv_bytes > ceiling_kv):
            return False
        borrow = True
    return pool_has_room or not borrow


def offered_priority(limits: EntitlementLimits, request: AdmissionRequest, mean_slo_ms: float, burst: float,
                     debt: float, config: AdmissionConfig = DEFAULT_ADMISSION_CONFIG) -> float:
    """Formula (1) for a request as check 5 computes it (its SLO hint only loosens the target): the priority a
    request waiting in its entitlement's queue keeps for the pool's waiting room."""
    slo_ms = limits.slo_target_ms
    hinted = request.slo_target_ms
    if isinstance(hinted, int | float) and not isinstance(hinted, bool) and slo_ms < hinted < math.inf:
        slo_ms = float(hinted)
    return request_priority(limits._traits, slo_ms, mean_slo_ms, burst, debt, config)
