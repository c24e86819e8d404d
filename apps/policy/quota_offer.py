"""An offer under quotas and its settlement on release: the one sequence both the ledger and the Redis store
follow (issue 25: it was written twice, in `AdmissionLedger` and again in `apps/gateway/redis_state.py`).

    reserve the claim ──> refused ──> demoted (a quota that says `on_exceeded: spot`): reserve the quotas
          │                     │     that say `reject` (`demoted_hold`), offer under the spot tier
          │                     └───> rejected: quota_exceeded (`after_reserve(...).refusal`)
          └──> held ──> offer ──> rejected: the hold is refunded (`refunds`)
                            └───> running | waiting | queued: held until the release settles it
                                  (`settlement`: at what it used)

The ledger reserves, offers and refunds in this process and synchronously, the Redis store in Lua and
asynchronously; so the sequence (`quota_offer`) calls neither: it is a generator that yields each step
(`Reserve`, `Decide`, `Refund`, `Verdict`) and is sent what the step returned, and each store answers the
steps its own way (`run_sync`, `run_async`). The order of the steps and every decision between them are here
once; a store only says how it reserves, offers and refunds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

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
    if prompt_tokens is None and type(output_tokens) is int:
        # The common release (an int output count, the prompt as admitted): what `_count` gives, without its checks
        # (every release of the simulator's and the gateway's comes here).
        return input_tokens, min(output_tokens if output_tokens > 0 else 0, max_tokens)
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


# --- the sequence, step by step -------------------------------------------------------------------------


class Decided(Protocol):
    """What a store's offer returns (the ledger's `LedgerResult`, the gateway's `Offer`): its decision."""

    @property
    def decision(self) -> AdmissionDecision: ...



@dataclass(frozen=True, slots=True)
class Reserve:
    """Reserve the claim's prompt plus max_tokens under its quotas, all or nothing (answer: a `QuotaVerdict`)."""

    claim: QuotaClaim


@dataclass(frozen=True, slots=True)
class Decide:
    """Run the checks and start, queue or reject the request (answer: the store's offer, with its `decision`),
    as its entitlement's own class or, `demoted`, as its spot tier. `hold`: the claim whose reservation it holds
    meanwhile (a store gives it back should the offer fail), or None."""

    hold: QuotaClaim | None
    demoted: bool = False


@dataclass(frozen=True, slots=True)
class Refund:
    """Give the claim's reservation back (answer: None)."""

    claim: QuotaClaim


@dataclass(frozen=True, slots=True)
class Verdict:
    """Where the claim's quotas stand now, nothing reserved (answer: a `QuotaVerdict`, for the headers)."""

    claim: QuotaClaim


Step = Reserve | Decide | Refund | Verdict


@dataclass(frozen=True, slots=True)
class QuotaOutcome:
    """How an offer under quotas ended: the store's offer (None: refused before the checks, by `refusal`),
    where its quotas stand (None: no quota applies to it), and the claim it holds until its release settles it
    (None: it holds none)."""

    offer: Any  # the store's offer (a `Decided`), or None
    refusal: AdmissionDecision | None
    verdict: QuotaVerdict | None
    hold: QuotaClaim | None


def quota_offer(claim: QuotaClaim, *, bound: bool) -> Generator[Step, Any, QuotaOutcome]:
    """An offer under `claim`, as the steps a store answers. `bound`: whether the request's entitlement is bound
    (a demoted request of one that is not is offered as it is, to be refused by check 1, its quota untouched)."""
    verdict = yield Reserve(claim)
    step = after_reserve(claim, verdict)
    if step.refusal is not None:
        return QuotaOutcome(None, step.refusal, verdict, None)
    if step.demoted is None:
        offer = yield Decide(claim)
        if refunds(offer.decision):
            yield Refund(claim)
            return QuotaOutcome(offer, None, (yield Verdict(claim)), None)
        return QuotaOutcome(offer, None, verdict, claim)
    if not bound:
        return QuotaOutcome((yield Decide(None)), None, None, None)
    hold = demoted_hold(step.demoted)
    if hold is not None:
        held = yield Reserve(hold)
        refusal = after_reserve(hold, held).refusal
        if refusal is not None:
            return QuotaOutcome(None, refusal, held, None)
    offer = yield Decide(hold, demoted=True)
    if hold is not None and refunds(offer.decision):
        yield Refund(hold)
        hold = None
    # Its standing is the used-up quota's, the one that demoted it (`apps.policy.tiers`).
    return QuotaOutcome(offer, None, verdict, hold)


def run_sync(sequence: Generator[Step, Any, QuotaOutcome], answer: Callable[[Step], Any]) -> QuotaOutcome:
    """Drive the sequence with a store that answers each step at once (the ledger)."""
    reply: Any = None
    while True:
        try:
            step = sequence.send(reply)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        reply = answer(step)


async def run_async(sequence: Generator[Step, Any, QuotaOutcome],
                    answer: Callable[[Step], Awaitable[Any]]) -> QuotaOutcome:
    """Drive the sequence with a store whose answers are awaited (the Redis store)."""
    reply: Any = None
    while True:
        try:
            step = sequence.send(reply)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        reply = await answer(step)
