"""Serving a request at a lower tier than its entitlement's (issue 24), as pure functions the ledger and the
Redis store's Python side share.

Two transitions of the one state machine lead there:

- **Spillover.** An entitlement that names a lower `spillover_class` has a request its own limits would make
  wait (in its queue) or refuse (checks 3 and 4) offered at once as that class: under the entitlement's tier
  `<id>@<class>` (`EntitlementLimits.tier_limits`), with the class's base weight and no reservation, own
  limits or queue, so it runs only on idle capacity and never takes anyone's reservation. When that tier has
  no room either, the entitlement's own decision stands (its queue, or its refusal).
- **Quota demotion.** A used-up quota that says `on_exceeded: spot` serves the entitlement's requests under
  its spot tier until the window resets, charged to none of its `spot` quotas (they are used up; the tokens
  are counted apart, by tier); quotas that say `reject` still hold their share and still refuse.

A tier runs on idle capacity: the pool's free room, and its own entitlement's idle reservation (`tier_pool`),
never another's. Its refusal for want of that is `pool_contended` (it has no limits of its own to be over).
"""

from __future__ import annotations

from dataclasses import replace

from apps.policy.admission import (
    OWN_LIMIT_REASONS,
    AdmissionDecision,
    EntitlementLimits,
    EntitlementState,
    EntitlementUsage,
    PoolUsage,
    Reason,
)
from apps.policy.classes import ServiceClass
from apps.policy.quota import QuotaClaim, QuotaVerdict

DEMOTED_CLASS = ServiceClass.SPOT
ON_EXCEEDED_DEMOTE = "spot"


def spills(limits: EntitlementLimits, decision: AdmissionDecision, queue_length: int) -> bool:
    """Whether a request is offered as the entitlement's spillover class: it names one, and the request's own
    limits would make it wait (refused by checks 3 or 4, or behind requests in its queue)."""
    if limits.spillover_class is None or decision.check in (1, 2):
        return False
    if queue_length > 0:
        return True
    return (not decision.admitted and not decision.queued and decision.retryable
            and decision.reason in OWN_LIMIT_REASONS)


def tier_pool(pool: PoolUsage, owner: EntitlementLimits, owner_usage: EntitlementUsage) -> PoolUsage:
    """The pool as a tier of `owner` sees it: the owner's idle reservation (Bound dedicated or guaranteed) is
    room for its own requests at a lower tier; the others' idle reservations stay off limits."""
    if not owner.traits.reserved or owner.state is not EntitlementState.BOUND:
        return pool
    slots = max(0, (owner.concurrency or 0) - owner_usage.running)
    kv = max(0.0, (owner.kv_bytes or 0.0) - owner_usage.kv_bytes_running)
    if not slots and not kv:
        return pool
    return pool._replace(reserved_idle_concurrency=pool.reserved_idle_concurrency - slots,
                         reserved_idle_kv=pool.reserved_idle_kv - kv)


def served_as(decision: AdmissionDecision, limits: EntitlementLimits) -> AdmissionDecision:
    """`admit`'s decision for a request offered under a tier's limits: it says the class it is served as, and a
    refusal for want of idle capacity is the pool's contention."""
    if not limits.tier_of:
        return decision
    if not decision.admitted and not decision.queued and decision.reason in OWN_LIMIT_REASONS:
        decision = decision._replace(reason=Reason.POOL_CONTENDED.value)
    return decision._replace(served_class=str(limits.service_class))


def demotion_claim(claim: QuotaClaim, verdict: QuotaVerdict) -> QuotaClaim | None:
    """The claim a request refused by its quotas is served as spot under, or None when it is refused: the
    quota that refused it says `on_exceeded: spot`. The demoted request still reserves against the quotas that
    say `reject` (they may refuse it still), and against none that say `spot`."""
    standing = verdict.standing
    if standing is None or standing.charge.on_exceeded != ON_EXCEEDED_DEMOTE:
        return None
    return replace(claim, charges=tuple(c for c in claim.charges if c.on_exceeded != ON_EXCEEDED_DEMOTE))
