"""The ordered admission checks of seed 000, section 4.3, as one pure function over explicit state.

`admit(limits, usage, pool, request)` runs, in order and short-circuiting on the first failure:

1. entitlement state: only Bound entitlements admit (`entitlement_not_bound`);
2. output bound: the default `max_tokens` is applied (clipped to what the context leaves), a
   non-positive `max_tokens` is `max_tokens_invalid`, a prompt plus `max_tokens` beyond the context
   window is `context_length_exceeded`;
3. concurrency: in-flight below `r_e`; above it, classes that may burst (all but guaranteed) borrow
   idle pool slots up to their burst ceiling (`concurrency_limit_exceeded`);
4. token budget: the entitlement's token bucket at `lambda_e` must hold `n_in + max_tokens`
   (`rate_limit_exceeded`), and KV bytes in flight stay within `chi_e`, with the same borrowing
   rule (`kv_cache_limit_exceeded`);
5. pool contention (the request's SLO hints may loosen the entitlement's target and tier, never tighten
   them: a client cannot raise its own priority): when the pool is full or saturated (saturation alone
   never turns away a dedicated or guaranteed request within its reserved baseline), a request whose
   priority (1) does not exceed the admission threshold (the minimum priority among admitted requests) is
   rejected (`pool_contended`); one above it is queued for the next free slot ahead of lower priorities
   and may evict in-flight preemptible work of lower priority. When the pool's dispatch budget (AIMD) is what
   is full while its capacity has room, every request waits (`PoolUsage.budget_bound`).

Room in the pool is read two ways. Physical: slots and KV bytes nobody is using. Entitled: what this
request may claim, where the idle reservations of other dedicated and guaranteed entitlements are
off limits (their baseline is never reclaimed, even when idle: seed 000, Table 1) and running
preemptible work counts as room because it gives way; a request within its own reservation may always
claim that much of it, even where work admitted before the other reservations were bound still
fills theirs. A request is free to start when both views have room ("idle pool slots"); when only
the entitled view has room, evicting lower-priority preemptible work can make it (the decision's
`evict` flag). Preemptible work itself may occupy idle reservations, since it is evicted as soon as
the owner needs them back.

Nothing here mutates state or reads a clock: the caller passes a snapshot and applies the decision
(`AdmissionLedger` does both for the simulator and the in-process gateway store).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from apps.policy.classes import (
    SPILLOVER_FROM,
    SPILLOVER_TO,
    ClassTraits,
    ServiceClass,
    SloTier,
    effective_slo_tier,
)
from apps.policy.errors import PolicyConfigError, require_non_negative, require_positive
from apps.policy.priority import (
    DEFAULT_ALPHA_BURST,
    DEFAULT_ALPHA_DEBT,
    DEFAULT_ALPHA_SLO,
    DEFAULT_MIN_DEBT_FACTOR,
)
from apps.policy.slo import relaxed_slo_tier


class EntitlementState(enum.StrEnum):
    """Binding states of an entitlement (seed 000, section 4.1)."""

    PENDING = "pending"
    BOUND = "bound"
    DEGRADED = "degraded"
    EXPIRED = "expired"


class Reason(enum.StrEnum):
    """Machine-readable reasons; the rejection codes match ARCHITECTURE.md's error codes."""

    ADMITTED = "admitted"
    QUEUED = "queued"
    ENTITLEMENT_NOT_BOUND = "entitlement_not_bound"
    INVALID_REQUEST = "invalid_request"
    MAX_TOKENS_INVALID = "max_tokens_invalid"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CONCURRENCY_LIMIT_EXCEEDED = "concurrency_limit_exceeded"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    KV_CACHE_LIMIT_EXCEEDED = "kv_cache_limit_exceeded"
    POOL_CONTENDED = "pool_contended"
    QUOTA_EXCEEDED = "quota_exceeded"
    # The entitlement's own queue was full, or a request waited in it `queue_max_wait_ms` without fitting.
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"


# Rejections that describe scarcity (the caller wanted capacity and did not get it); these count
# as unmet demand for the debt mechanism, unlike malformed requests or unbound entitlements.
CAPACITY_REASONS = frozenset(
    {
        Reason.CONCURRENCY_LIMIT_EXCEEDED,
        Reason.RATE_LIMIT_EXCEEDED,
        Reason.KV_CACHE_LIMIT_EXCEEDED,
        Reason.POOL_CONTENDED,
    }
)


# The longest an entitlement's queue may hold a request (10 minutes): a longer wait is a configuration error.
MAX_QUEUE_WAIT_MS = 600_000.0


# Refusals by the entitlement's own limits: a request refused only by one of them may wait in its queue.
OWN_LIMIT_REASONS = frozenset(
    {Reason.CONCURRENCY_LIMIT_EXCEEDED, Reason.RATE_LIMIT_EXCEEDED, Reason.KV_CACHE_LIMIT_EXCEEDED}
)


def _optional_limit(name: str, value: float | None) -> float | None:
    return None if value is None else require_non_negative(name, value)


@dataclass(frozen=True, slots=True)
class EntitlementLimits:
    """What an entitlement may consume. `None` on a dimension means that dimension is not limited.

    Token bucket: capacity `tokens_per_second * token_bucket_seconds`, refilled at `tokens_per_second`.
    Burst ceilings cap borrowing; `None` lets a bursting class borrow whatever the pool has idle.
    """

    entitlement_id: str
    # Strings are accepted and normalised to the enums in __post_init__.
    service_class: ServiceClass | str = ServiceClass.ELASTIC
    tokens_per_second: float | None = None
    kv_bytes: float | None = None
    concurrency: int | None = None
    slo_target_ms: float = 1000.0
    slo_tier: str | None = None
    burst_concurrency: int | None = None
    burst_kv_bytes: float | None = None
    token_bucket_seconds: float = 60.0
    default_max_tokens: int = 256
    context_window: int = 4096
    kv_bytes_per_token: float = 0.0
    state: EntitlementState | str = EntitlementState.BOUND
    tenant_id: str = ""
    # The entitlement's own queue (requests over its own concurrency, token bucket or KV bytes wait there,
    # first come first served): None takes the class's default (`ClassTraits.queue_max`, `queue_max_wait_ms`).
    queue_max: int | None = None
    queue_max_wait_ms: float | None = None
    # Spillover (issue 24): a request the entitlement's own limits would make wait or refuse runs at once as
    # this lower class on idle capacity, where there is any (`tier_limits`). None: no spillover.
    spillover_class: ServiceClass | str | None = None
    # Set on the limits of an entitlement's lower tier (`tier_limits`): the entitlement it serves.
    tier_of: str = ""
    # Derived once here because every decision needs them.
    _traits: ClassTraits = field(init=False, repr=False, compare=False)
    _tier: str = field(init=False, repr=False, compare=False)
    _tiers: dict[ServiceClass, EntitlementLimits] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not str(self.entitlement_id):
            raise PolicyConfigError("entitlement_id must not be empty")
        object.__setattr__(self, "service_class", ServiceClass.parse(self.service_class))
        try:
            object.__setattr__(self, "state", EntitlementState(str(self.state).lower()))
        except ValueError:
            raise PolicyConfigError(f"unknown entitlement state {self.state!r}") from None
        _optional_limit("tokens_per_second", self.tokens_per_second)
        _optional_limit("kv_bytes", self.kv_bytes)
        _optional_limit("burst_kv_bytes", self.burst_kv_bytes)
        for name in ("concurrency", "burst_concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise PolicyConfigError(f"{name} must be a non-negative integer or None, got {value!r}")
        for ceiling, baseline in (("burst_concurrency", "concurrency"), ("burst_kv_bytes", "kv_bytes")):
            high, low = getattr(self, ceiling), getattr(self, baseline)
            if high is not None and low is not None and high < low:
                raise PolicyConfigError(f"{ceiling} ({high!r}) must be >= {baseline} ({low!r})")
        if self.queue_max is not None and (
            isinstance(self.queue_max, bool) or not isinstance(self.queue_max, int) or self.queue_max < 0
        ):
            raise PolicyConfigError(f"queue_max must be a non-negative integer or None, got {self.queue_max!r}")
        wait = self.queue_max_wait_ms
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float)
                                 or not 0 <= wait <= MAX_QUEUE_WAIT_MS):
            raise PolicyConfigError(f"queue_max_wait_ms must be a number from 0 to {MAX_QUEUE_WAIT_MS:g} "
                                    f"(10 minutes) or None, got {wait!r}")
        require_positive("slo_target_ms", self.slo_target_ms)
        require_positive("token_bucket_seconds", self.token_bucket_seconds)
        require_non_negative("kv_bytes_per_token", self.kv_bytes_per_token)
        for name in ("default_max_tokens", "context_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PolicyConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.slo_tier is not None:
            object.__setattr__(self, "slo_tier", effective_slo_tier(self.service_class, self.slo_tier))
        if self.spillover_class is not None:
            spillover = ServiceClass.parse(self.spillover_class)
            if self.service_class not in SPILLOVER_FROM:
                raise PolicyConfigError(f"a {self.service_class} entitlement cannot spill over (only dedicated, "
                                        "guaranteed and elastic ones can)")
            if not spillover.is_lower_than(self.service_class):
                lower = ", ".join(c.value for c in SPILLOVER_TO if c.is_lower_than(self.service_class))
                raise PolicyConfigError(f"spillover_class {spillover.value!r} is not lower than "
                                        f"{str(self.service_class)!r}; expected one of {lower}")
            object.__setattr__(self, "spillover_class", spillover)
        object.__setattr__(self, "_traits", ServiceClass.parse(self.service_class).traits)
        object.__setattr__(self, "_tier", effective_slo_tier(self.service_class, self.slo_tier))
        object.__setattr__(self, "_tiers", {})

    @property
    def traits(self) -> ClassTraits:
        return self._traits

    def tier_limits(self, service_class: ServiceClass | str) -> EntitlementLimits:
        """The limits this entitlement's requests run under when served as the lower `service_class`
        (spilled over, or demoted by a used-up quota): an entitlement of their own, `<id>@<class>`, with that
        class's base weight and SLO tier and no reservation, own limits or queue of its own, so they borrow
        idle capacity only and never take anyone's reservation (preemptible ones are evicted as any are)."""
        target = ServiceClass.parse(service_class)
        tier = self._tiers.get(target)
        if tier is None:
            tier = self._tiers[target] = EntitlementLimits(
                entitlement_id=f"{self.entitlement_id}@{target.value}", service_class=target,
                tokens_per_second=None, kv_bytes=0.0, concurrency=0, slo_target_ms=self.slo_target_ms,
                token_bucket_seconds=self.token_bucket_seconds, default_max_tokens=self.default_max_tokens,
                context_window=self.context_window, kv_bytes_per_token=self.kv_bytes_per_token,
                state=self.state, tenant_id=self.tenant_id, queue_max=0, queue_max_wait_ms=0.0,
                tier_of=self.entitlement_id,
            )
        return tier

    @property
    def bucket_capacity(self) -> float | None:
        if self.tokens_per_second is None:
            return None
        # A zero rate still needs a positive capacity for the bucket; nothing ever refills it.
        return max(self.tokens_per_second * self.token_bucket_seconds, 1e-9)

    @property
    def tier(self) -> str:
        return self._tier

    @property
    def own_queue_max(self) -> int:
        """How many requests over the entitlement's own limits may wait (0: refused at once)."""
        return self._traits.queue_max if self.queue_max is None else self.queue_max

    @property
    def own_queue_wait_s(self) -> float:
        """How long one of them may wait, in seconds."""
        wait = self._traits.queue_max_wait_ms if self.queue_max_wait_ms is None else self.queue_max_wait_ms
        return wait / 1000.0

    def reserved_concurrency(self) -> int:
        return (self.concurrency or 0) if self.traits.reserved else 0

    def reserved_kv(self) -> float:
        return (self.kv_bytes or 0.0) if self.traits.reserved else 0.0


# How the hot path builds a NamedTuple: every field, positionally, without the interpreted __new__ that a call of
# the class runs (make bench-sim: about a tenth of a decision's time under mypyc went to those).
new_tuple = tuple.__new__


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """One request as the client sized it. `slo_target_ms` and `slo_tier` are the client's hints (llm-d's
    headers): `admit` lets them relax the entitlement's SLO and tier, never tighten them."""

    request_id: str
    input_tokens: int
    max_tokens: int | None = None
    slo_target_ms: float | None = None
    slo_tier: SloTier | str | None = None

    # Written out (dataclasses keeps a class's own __init__): mypyc compiles this one, `object.__setattr__` on a
    # field into a plain store, while the __init__ that dataclasses generates stays interpreted; every decision
    # builds a request (make bench-sim).
    def __init__(self, request_id: str, input_tokens: int, max_tokens: int | None = None,
                 slo_target_ms: float | None = None, slo_tier: SloTier | str | None = None) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "input_tokens", input_tokens)
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "slo_target_ms", slo_target_ms)
        object.__setattr__(self, "slo_tier", slo_tier)


class EntitlementUsage(NamedTuple):
    """The entitlement's side of the snapshot (a NamedTuple: immutable and cheap to build per decision). `in_flight` and `kv_bytes_in_flight` include requests
    waiting for a pool slot; `running`/`kv_bytes_running` only those holding one.
    `tokens_available` is the bucket level already refilled to the decision time."""

    in_flight: int = 0
    kv_bytes_in_flight: float = 0.0
    running: int = 0
    kv_bytes_running: float = 0.0
    tokens_available: float = math.inf
    debt: float = 0.0
    burst: float = 0.0


class PoolUsage(NamedTuple):
    concurrency_capacity: int
    kv_capacity: float = math.inf
    running: int = 0
    kv_bytes_running: float = 0.0
    # Unused capacity of reserved (dedicated/guaranteed) entitlements: sum of max(0, r_e - running_e).
    reserved_idle_concurrency: int = 0
    reserved_idle_kv: float = 0.0
    saturation: float = 0.0
    # Minimum priority among admitted requests; -inf when nothing is admitted.
    admission_threshold: float = -math.inf
    mean_slo_ms: float = 1000.0
    # Lowest priority among in-flight evictable (preemptible) requests; None when there are none.
    lowest_evictable_priority: float | None = None
    # Running evictable (preemptible) requests and their KV bytes (included in running above).
    evictable_running: int = 0
    evictable_kv_bytes: float = 0.0
    # The pool's dispatch budget (AIMD) is what is full, not its capacity: every request waits for room then,
    # highest priority first, as under seed 002's budget (the admission threshold refuses only in a full pool).
    budget_bound: bool = False


def dispatch_capacity(capacity: int, budget: int | None) -> int:
    """How many requests the pool may run: its capacity, and under a dispatch budget (AIMD) no more than that."""
    return capacity if budget is None else min(budget, capacity)


def budget_bound(budget: int | None, running: int, capacity: int) -> bool:
    """The dispatch budget is what is full, not the capacity (`PoolUsage.budget_bound`)."""
    return budget is not None and budget <= running < capacity


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    alpha_slo: float = DEFAULT_ALPHA_SLO
    alpha_burst: float = DEFAULT_ALPHA_BURST
    alpha_debt: float = DEFAULT_ALPHA_DEBT
    min_debt_factor: float = DEFAULT_MIN_DEBT_FACTOR
    # Retry-After estimate when the wait is for a slot to free up (no better signal at decision time).
    expected_service_s: float = 1.0
    not_bound_retry_s: float = 30.0
    # Retry-After sent with rejections that retrying cannot fix.
    never_retry_s: float = 3600.0
    # How long a queued request may wait for a slot (the blog's acquire timeout).
    wait_timeout_s: float = 1.0
    # At most this many in-flight preemptible requests are evicted to start one waiting request;
    # when that cannot make room, none is evicted (an eviction that does not help is pure waste).
    max_evictions_per_request: int = 4

    def __post_init__(self) -> None:
        value = self.max_evictions_per_request
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PolicyConfigError(f"max_evictions_per_request must be a non-negative integer, got {value!r}")
        for name in ("alpha_slo", "alpha_burst", "alpha_debt", "min_debt_factor"):
            require_non_negative(name, getattr(self, name))
        for name in ("expected_service_s", "not_bound_retry_s", "never_retry_s", "wait_timeout_s"):
            require_positive(name, getattr(self, name))


DEFAULT_ADMISSION_CONFIG = AdmissionConfig()


class AdmissionDecision(NamedTuple):
    """The outcome of `admit` (a NamedTuple: immutable and cheap to build per decision).

    `queued` means priority exceeded the threshold of a full pool: wait for the next free slot;
    `evict` says lower-priority preemptible work is in flight and may be evicted to make room.
    `check` is the number of the check that decided (0 when the caller rejected it before)."""

    admitted: bool
    reason: str
    retry_after_s: float = 0.0
    queued: bool = False
    evict: bool = False
    retryable: bool = True
    priority: float = 0.0
    max_tokens: int = 0
    token_cost: int = 0
    kv_bytes: float = 0.0
    borrowed: bool = False
    slo_tier: str = ""
    check: int = 0
    # The class the request runs as when lower than its entitlement's (spilled over, demoted); "": its own.
    served_class: str = ""

    @property
    def own_queue(self) -> bool:
        """Waiting in the entitlement's own queue (over its own limits), not in the pool's waiting room."""
        return self.queued and self.check in (3, 4)

    @property
    def outcome(self) -> str:
        if self.admitted:
            return "admitted"
        return "queued" if self.queued else "rejected"


def _reject(
    reason: str,
    check: int,
    retry_after_s: float,
    retryable: bool = True,
    max_tokens: int = 0,
    token_cost: int = 0,
    kv_bytes: float = 0.0,
    slo_tier: str = "",
    priority: float = 0.0,
) -> AdmissionDecision:
    # (admitted, reason, retry_after_s, queued, evict, retryable, priority, max_tokens, token_cost, kv_bytes,
    #  borrowed, slo_tier, check, served_class): `new_tuple`.
    return new_tuple(AdmissionDecision, (False, reason, retry_after_s, False, False, retryable, priority,
                                         max_tokens, token_cost, kv_bytes, False, slo_tier, check, ""))


def request_priority(
    traits: ClassTraits,
    slo_target_ms: float,
    mean_slo_ms: float,
    burst: float,
    debt: float,
    config: AdmissionConfig = DEFAULT_ADMISSION_CONFIG,
) -> float:
    """Formula (1) without re-validating inputs that the frozen limits already validated."""
    if not traits.accrues_debt:
        debt = 0.0
    debt_factor = 1.0 + config.alpha_debt * debt
    if debt_factor < config.min_debt_factor:
        debt_factor = config.min_debt_factor
    return (
        traits.base_weight
        / (1.0 + config.alpha_slo * slo_target_ms / mean_slo_ms)
        / (1.0 + config.alpha_burst * burst)
        * debt_factor
    )



def resolved_max_tokens(limits: EntitlementLimits, request: AdmissionRequest) -> int | None:
    """The output bound check (2) will charge: the request's own `max_tokens` or the entitlement's default
    clipped to what the context leaves; None for a request check (2) rejects (nothing to charge)."""
    n_in, context = request.input_tokens, limits.context_window
    if isinstance(n_in, bool) or not isinstance(n_in, int) or not 0 <= n_in < context:
        return None
    max_tokens = request.max_tokens
    if max_tokens is None:
        return min(limits.default_max_tokens, context - n_in)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1 or n_in + max_tokens > context:
        return None
    return max_tokens


# The reasons `admit` decides with, looked up once (an enum's `.value` is a Python-level property).
_ADMITTED = Reason.ADMITTED.value
_QUEUED = Reason.QUEUED.value
_NOT_BOUND = Reason.ENTITLEMENT_NOT_BOUND.value
_INVALID = Reason.INVALID_REQUEST.value
_CONTEXT_EXCEEDED = Reason.CONTEXT_LENGTH_EXCEEDED.value
_MAX_TOKENS_INVALID = Reason.MAX_TOKENS_INVALID.value
_CONCURRENCY_EXCEEDED = Reason.CONCURRENCY_LIMIT_EXCEEDED.value
_RATE_EXCEEDED = Reason.RATE_LIMIT_EXCEEDED.value
_KV_EXCEEDED = Reason.KV_CACHE_LIMIT_EXCEEDED.value
_CONTENDED = Reason.POOL_CONTENDED.value


def admit(
    limits: EntitlementLimits,
    usage: EntitlementUsage,
    pool: PoolUsage,
    request: AdmissionRequest,
    config: AdmissionConfig = DEFAULT_ADMISSION_CONFIG,
) -> AdmissionDecision:
    """Run the five ordered checks; see the module docstring."""
    # (1) entitlement state
    if limits.state is not EntitlementState.BOUND:
        # Pending and Degraded may bind later; Expired never comes back.
        expired = limits.state is EntitlementState.EXPIRED
        return _reject(
            _NOT_BOUND,
            1,
            config.never_retry_s if expired else config.not_bound_retry_s,
            retryable=not expired,
        )

    # (2) output bound
    n_in = request.input_tokens
    if isinstance(n_in, bool) or not isinstance(n_in, int) or n_in < 0:
        return _reject(_INVALID, 2, config.never_retry_s, retryable=False)
    context = limits.context_window
    if n_in >= context:
        return _reject(_CONTEXT_EXCEEDED, 2, config.never_retry_s, retryable=False)
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, context - n_in)
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        return _reject(_MAX_TOKENS_INVALID, 2, config.never_retry_s, retryable=False)
    elif n_in + max_tokens > context:
        return _reject(_CONTEXT_EXCEEDED, 2, config.never_retry_s, retryable=False)
    requested_slo = request.slo_target_ms
    if requested_slo is not None and (
        isinstance(requested_slo, bool)
        or not isinstance(requested_slo, int | float)
        or not 0 < requested_slo < math.inf
    ):
        return _reject(_INVALID, 2, config.never_retry_s, retryable=False)
    cost = n_in + max_tokens
    kv_needed = cost * limits.kv_bytes_per_token
    traits = limits._traits
    # A request's hints only relax what its entitlement grants (nothing a client sends raises its standing).
    tier = limits._tier if request.slo_tier is None else relaxed_slo_tier(limits._tier, request.slo_tier)

    # Two views of room in the pool. Physical: slots/bytes nobody is using. Entitled: what this
    # request may claim, where idle reservations of other dedicated/guaranteed entitlements are off
    # limits and evictable (preemptible) work counts as room because it gives way. Preemptible work
    # itself may sit in idle reservations: it is evicted as soon as the owner needs them back.
    own_idle_slots = 0
    own_idle_kv = 0.0
    if traits.reserved:
        if limits.concurrency is not None and usage.running < limits.concurrency:
            own_idle_slots = limits.concurrency - usage.running
        if limits.kv_bytes is not None and usage.kv_bytes_running < limits.kv_bytes:
            own_idle_kv = limits.kv_bytes - usage.kv_bytes_running
    physical_slots = pool.concurrency_capacity - pool.running
    physical_kv = pool.kv_capacity - pool.kv_bytes_running
    if traits.evictable:
        entitled_slots, entitled_kv = physical_slots, physical_kv
    else:
        reachable_slots = physical_slots + pool.evictable_running
        reachable_kv = physical_kv + pool.evictable_kv_bytes
        entitled_slots = reachable_slots - (pool.reserved_idle_concurrency - own_idle_slots)
        entitled_kv = reachable_kv - (pool.reserved_idle_kv - own_idle_kv)
        # Within its own reservation a request claims that reservation, whatever the others' idle ones: work
        # admitted before they were bound (or before the pool shrank) may still sit in their room, and
        # deferring to them then would refuse the reservation it is owed.
        if own_idle_slots > 0:
            entitled_slots = max(entitled_slots, min(own_idle_slots, reachable_slots))
        if own_idle_kv > 0:
            entitled_kv = max(entitled_kv, min(own_idle_kv, reachable_kv))
    # Borrowing (checks 3 and 4) takes only room that is both idle and not reserved.
    free_slots = physical_slots if physical_slots < entitled_slots else entitled_slots
    free_kv = physical_kv if physical_kv < entitled_kv else entitled_kv

    # (3) concurrency
    borrowed = False
    r_e = limits.concurrency
    if r_e is not None and usage.in_flight >= r_e:
        ceiling = limits.burst_concurrency
        if not traits.may_burst or (ceiling is not None and usage.in_flight >= ceiling) or free_slots <= 0:
            return _reject(
                _CONCURRENCY_EXCEEDED, 3, config.expected_service_s, True, max_tokens, cost, kv_needed, tier
            )
        borrowed = True

    # (4) token budget
    rate = limits.tokens_per_second
    if rate is not None and usage.tokens_available < cost:
        capacity = limits.bucket_capacity or 0.0
        if cost > capacity or rate <= 0:
            return _reject(
                _RATE_EXCEEDED, 4, config.never_retry_s, False, max_tokens, cost, kv_needed, tier
            )
        return _reject(
            _RATE_EXCEEDED, 4, (cost - usage.tokens_available) / rate, True, max_tokens, cost, kv_needed, tier
        )
    chi = limits.kv_bytes
    if chi is not None and kv_needed > 0 and usage.kv_bytes_in_flight + kv_needed > chi:
        ceiling_kv = limits.burst_kv_bytes if traits.may_burst else chi
        if ceiling_kv is not None and kv_needed > ceiling_kv:
            return _reject(
                _KV_EXCEEDED, 4, config.never_retry_s, False, max_tokens, cost, kv_needed, tier
            )
        if (
            not traits.may_burst
            or (ceiling_kv is not None and usage.kv_bytes_in_flight + kv_needed > ceiling_kv)
            or free_kv < kv_needed
        ):
            return _reject(
                _KV_EXCEEDED, 4, config.expected_service_s, True, max_tokens, cost, kv_needed, tier
            )
        borrowed = True

    # (5) pool contention
    # The client may loosen its entitlement's TTFT target (a larger SLO, a lower priority), never tighten it.
    slo_ms = limits.slo_target_ms
    if requested_slo is not None and requested_slo > slo_ms:
        slo_ms = requested_slo
    priority = request_priority(traits, slo_ms, pool.mean_slo_ms, usage.burst, usage.debt, config)
    # Saturation throttles capacity nobody reserved: a dedicated or guaranteed request within its own
    # baseline runs on capacity the pool promised it (seed 000, Table 1: never shrunk), so a backend's
    # queue alone does not turn it away; only a pool that is really full does.
    within_reservation = traits.reserved and not borrowed
    saturated = pool.saturation >= 1.0 and not within_reservation
    contended = free_slots <= 0 or free_kv < kv_needed or saturated
    if not contended:
        # AdmissionDecision(True, _ADMITTED, priority=..., borrowed=..., max_tokens=..., token_cost=cost,
        # kv_bytes=kv_needed, slo_tier=tier), in field order (`new_tuple`).
        return new_tuple(AdmissionDecision, (True, _ADMITTED, 0.0, False, False, True, priority, max_tokens, cost,
                                             kv_needed, borrowed, tier, 0, ""))
    if priority <= pool.admission_threshold and not pool.budget_bound:
        return _reject(
            _CONTENDED, 5, config.expected_service_s, True, max_tokens, cost, kv_needed, tier, priority
        )
    # Eviction only helps when the request is entitled to the room the victims would free.
    evict = (
        pool.lowest_evictable_priority is not None
        and pool.lowest_evictable_priority < priority
        and entitled_slots >= 1
        and entitled_kv >= kv_needed
    )
    # AdmissionDecision(False, _QUEUED, queued=True, evict=evict, priority=..., borrowed=..., check=5, ...), in
    # field order (`new_tuple`).
    return new_tuple(AdmissionDecision, (False, _QUEUED, 0.0, True, evict, True, priority, max_tokens, cost, kv_needed,
                                         borrowed, tier, 5, ""))

