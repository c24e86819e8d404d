"""An offer under quotas and its settlement on release: the one sequence both the ledger and the Redis store
follow (issue 25: it was written twice, in `AdmissionLedger` and again in `apps/gateway/redis_state.py`).

    reserve the claim ──> refused ──> demoted (a quota that says `on_exceeded: spot`): reserve the quotas
          │                     │     that say `reject` (`demoted_hold`), offer under the spot tier
          │                     └───> rejected: quota_exceeded (`after_reserve(...).refusal`)
          └──> held ──> offer ──> rejected: the hold is refunded (`refunds`)
                            └───> running | waiting | queued: held until the release settles it
                                  (`settlement`: at what it used)

The ledger reserves, offers and refunds in this process and synchronously, the Redis store in Lua and
asynchronously; so nothing here calls them: each function says what comes next, given what the last step
returned, and the two drivers of the sequence stay a few lines each.
"""

from __future__ import annotations

from dataclasses import dataclass

from apps.policy.admission import AdmissionDecision, Reason
from apps.policy.quota import QuotaClaim, QuotaVerdict
from apps.policy.tiers import demotion_claim

OUTCOME_COMPLETED = "completed"
OUTCOME_CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class AfterReserve:
    """What an offer does once its quota reservation answered: go on to the checks (`offer`), be served as spot
    under `demoted` (the claim whose quotas it must still hold: `demoted_hold`), or be refused (`refusal`)."""

    offer: bool = False
    demoted: QuotaClaim | None = None
    refusal: AdmissionDecision | None = None


def quota_refusal(verdict: QuotaVerdict, claim: QuotaClaim) -> AdmissionDecision:
    """The rejection of a request its quota cannot fit: not retryable before the window resets. A refusal with
    no standing means the request id holds a reservation already (a duplicate): refused as invalid."""
    if verdict.standing is None:
        return AdmissionDecision(False, Reason.INVALID_REQUEST.value, 0.0, retryable=False)
    return AdmissionDecision(False, Reason.QUOTA_EXCEEDED.value, verdict.retry_after_s(claim.issued_at),
                             retryable=False)


def after_reserve(claim: QuotaClaim, verdict: QuotaVerdict) -> AfterReserve:
    """The step after reserving `claim`: held (offer), demoted (a quota that says spot refused it) or refused.
    A demoted claim holds no quota that says spot, so its own reservation is never demoted again."""
    if verdict.admitted:
        return AfterReserve(offer=True)
    demoted = demotion_claim(claim, verdict)
    if demoted is not None:
        return AfterReserve(demoted=demoted)
    return AfterReserve(refusal=quota_refusal(verdict, claim))


def demoted_hold(claim: QuotaClaim) -> QuotaClaim | None:
    """What a demoted request reserves before its offer: the quotas that say `reject`, or nothing (None)."""
    return claim if claim.charges else None


def refunds(decision: AdmissionDecision) -> bool:
    """Whether the offer's decision gives its quota reservation back: nothing was admitted or queued."""
    return not (decision.admitted or decision.queued)


def _count(value: float | None, default: int) -> int:
    """A token count as reported (None or NaN: the default; never negative)."""
    if isinstance(value, int | float) and value == value:
        return int(max(value, 0))
    return default


def consumed(input_tokens: int, max_tokens: int, output_tokens: float | None,
             prompt_tokens: float | None) -> tuple[int, int]:
    """What a finished request consumed of its charge: the prompt (as counted at admission unless the backend
    reported it) and the output produced, clamped to `max_tokens`. A missing or NaN output count is taken as the
    whole `max_tokens` (nothing is refunded on a guess)."""
    produced = min(_count(output_tokens, max_tokens), max_tokens)
    return _count(prompt_tokens, input_tokens), produced


def settlement(outcome: str, input_tokens: int, max_tokens: int, output_tokens: float | None,
               prompt_tokens: float | None) -> tuple[int, int]:
    """The prompt and output a release settles the request's quota hold at: a completed request at what it
    consumed (`consumed`), a cancelled one at nothing, one that left before this release (evicted, expired,
    reaped: outcome `unknown`) at what the caller reports it was given (nothing when it reports nothing)."""
    if outcome == OUTCOME_COMPLETED:
        return consumed(input_tokens, max_tokens, output_tokens, prompt_tokens)
    if outcome == OUTCOME_CANCELLED:
        return 0, 0
    return _count(prompt_tokens, 0), _count(output_tokens, 0)
