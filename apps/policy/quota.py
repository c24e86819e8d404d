"""Quotas: totals over calendar windows, the admission state machine's budget transitions.

A quota bounds what a tenant or an entitlement may use per hour, day or month (calendar-aligned in a
timezone), in tokens or in money. Money is priced per token (`input_weight`, `output_weight`: the pool's
price per token), tokens weigh 1 each, so one book counts both in the quota's own unit.

Transitions (the ledger and both gateway stores apply exactly these; `make conformance` checks it):

    reserve  the request's prompt plus `max_tokens`, priced, against every quota it is under, all or
             nothing: refused when `used + reserved + cost > limit` for any of them (quota_exceeded)
    settle   at the end: the reservation is dropped and what was really used is added (never more than
             was reserved, so no window ever counts more than its limit); once per request
    refund   settle with nothing used (rejected, expired or cancelled before anything was produced)
    lease    a hold may carry a lease (a deadline its holder renews while the request lives); `reap`
             settles every hold whose lease lapsed at its whole amount, as a release with its usage unknown
             (the holder died or lost track of it: it may have been served, and counting it spent is the
             side that never lets a window exceed its limit). A live gateway settles its own holds exactly,
             even for requests whose client left or whose offer's reply was lost; the lease is the backstop.

A quota's state is `(window, used, reserved)`; a claim naming a newer window starts the quota over from
`seed_used` (what the usage records say the new window has used so far, for a cold start after a
restart). A reservation made in an older window settles nothing into the new one. Time enters only as
the window ids and reset instants the caller computed (`quota_window_of`), so the book needs no clock.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from zoneinfo import ZoneInfo

QUOTA_WINDOWS = ("hour", "day", "month")
# What a used-up quota does: refuse, or serve the entitlement as spot until the window resets (issue 24).
QUOTA_ON_EXCEEDED = ("reject", "spot")
# A reservation may overshoot a limit by float dust only (money is priced in fractions of a cent).
EPSILON = 1e-9


def quota_window_of(window: str, tz: str, now: dt.datetime) -> tuple[str, dt.datetime]:
    """The id of the calendar window `now` falls in and the instant it resets (aware, UTC)."""
    local = now.astimezone(ZoneInfo(tz))
    if window == "hour":
        # Named by its start in UTC: when clocks go back, a local hour happens twice.
        start = local.replace(minute=0, second=0, microsecond=0).astimezone(dt.UTC)
        return start.strftime("%Y-%m-%dT%HZ"), start + dt.timedelta(hours=1)
    if window == "day":
        # Across a DST change a day lasts 23 or 25 hours: the next midnight in the zone, not start + 24 h.
        nxt = local.date() + dt.timedelta(days=1)
        end = dt.datetime(nxt.year, nxt.month, nxt.day, tzinfo=ZoneInfo(tz)).astimezone(dt.UTC)
        return local.strftime("%Y-%m-%d"), end
    if window == "month":
        year, month = (local.year + 1, 1) if local.month == 12 else (local.year, local.month + 1)
        end = dt.datetime(year, month, 1, tzinfo=ZoneInfo(tz)).astimezone(dt.UTC)
        return local.strftime("%Y-%m"), end
    raise ValueError(f"unknown quota window {window!r}; one of {', '.join(QUOTA_WINDOWS)}")


def quota_window_start(window: str, tz: str, now: dt.datetime) -> dt.datetime:
    """When the window `now` falls in began (aware, UTC): where the usage records are summed from."""
    local = now.astimezone(ZoneInfo(tz))
    if window == "hour":
        start = local.replace(minute=0, second=0, microsecond=0)
    elif window == "day":
        start = dt.datetime(local.year, local.month, local.day, tzinfo=ZoneInfo(tz))
    elif window == "month":
        start = dt.datetime(local.year, local.month, 1, tzinfo=ZoneInfo(tz))
    else:
        raise ValueError(f"unknown quota window {window!r}; one of {', '.join(QUOTA_WINDOWS)}")
    return start.astimezone(dt.UTC)


@dataclass(frozen=True, slots=True)
class QuotaCharge:
    """One quota a request is under, as it stands for this request's window."""

    key: str  # "entitlement:<name>" or "tenant:<slug>"
    limit: float
    window_id: str
    reset_at: float  # epoch seconds (wall clock) when the window ends
    seed_used: float = 0.0
    input_weight: float = 1.0
    output_weight: float = 1.0
    unit: str = "tokens"  # or a currency code
    # What a used-up quota does (issue 24): "reject" (429 quota_exceeded) or "spot" (served as spot until the
    # window resets; those tokens are not charged to this quota).
    on_exceeded: str = "reject"

    def cost(self, input_tokens: float, output_tokens: float) -> float:
        return input_tokens * self.input_weight + output_tokens * self.output_weight


@dataclass(frozen=True, slots=True)
class QuotaRule:
    """A quota as configured (the gateway's snapshot of a tenant's or an entitlement's settings), with
    what the usage records said its window had used when the snapshot was taken."""

    key: str
    limit: float
    window: str
    timezone: str = "UTC"
    input_weight: float = 1.0
    output_weight: float = 1.0
    unit: str = "tokens"
    seed_window_id: str = ""
    seed_used: float = 0.0
    on_exceeded: str = "reject"

    def charge_at(self, now: dt.datetime) -> QuotaCharge:
        window_id, reset = quota_window_of(self.window, self.timezone, now)
        seed = self.seed_used if window_id == self.seed_window_id else 0.0
        return QuotaCharge(self.key, self.limit, window_id, reset.timestamp(), seed, self.input_weight,
                           self.output_weight, self.unit, self.on_exceeded)


@dataclass(frozen=True, slots=True)
class QuotaClaim:
    request_id: str
    input_tokens: int
    max_tokens: int
    charges: tuple[QuotaCharge, ...]
    issued_at: float  # wall clock (epoch seconds), for Retry-After
    # Whose quotas these are (the tenant): a shared store keeps one scope's quotas together, so that a
    # reservation against the tenant's and the entitlement's quota is one atomic step.
    scope: str = ""
    # The hold's lease (seconds; renewed by its holder while the request lives); None: held until settled.
    lease_s: float | None = None


@dataclass(frozen=True, slots=True)
class QuotaStanding:
    """A quota after a transition: what the response headers say."""

    charge: QuotaCharge
    used: float
    reserved: float

    @property
    def remaining(self) -> float:
        return max(0.0, self.charge.limit - self.used - self.reserved)


@dataclass(frozen=True, slots=True)
class QuotaVerdict:
    admitted: bool
    # The binding quota: the one refused, or the one with the least left (by share of its limit).
    standing: QuotaStanding | None = None

    def retry_after_s(self, issued_at: float) -> float:
        return 0.0 if self.standing is None else max(1.0, self.standing.charge.reset_at - issued_at)


@dataclass(slots=True)
class QuotaState:
    window_id: str
    used: float
    reserved: float


@dataclass(frozen=True, slots=True)
class QuotaHold:
    key: str
    window_id: str
    amount: float
    input_weight: float
    output_weight: float


def binding(standings: list[QuotaStanding]) -> QuotaStanding | None:
    """The quota with the least left, as a share of its limit (tokens and money compare that way)."""
    return min(standings, key=lambda s: (s.remaining / s.charge.limit if s.charge.limit else 0.0), default=None)


@dataclass
class QuotaBook:
    states: dict[str, QuotaState] = field(default_factory=dict)
    holds: dict[str, tuple[QuotaHold, ...]] = field(default_factory=dict)
    # Request id -> the deadline of its hold's lease (holds without a lease are not reaped).
    leases: dict[str, float] = field(default_factory=dict)

    def _state(self, charge: QuotaCharge) -> QuotaState:
        state = self.states.get(charge.key)
        if state is None or state.window_id != charge.window_id:
            state = self.states[charge.key] = QuotaState(charge.window_id, float(charge.seed_used), 0.0)
        return state

    def reserve(self, claim: QuotaClaim, now: float | None = None) -> QuotaVerdict:
        """Reserve the claim's prompt plus max_tokens under every quota, or nothing at all; a claim with a
        `lease_s` (and a `now`) holds it until `now + lease_s` unless renewed (`renew`, `reap`)."""
        if not claim.charges:
            return QuotaVerdict(True)
        if claim.request_id in self.holds:
            return QuotaVerdict(False)
        standings = []
        for charge in claim.charges:
            state = self._state(charge)
            cost = charge.cost(claim.input_tokens, claim.max_tokens)
            if state.used + state.reserved + cost > charge.limit + EPSILON:
                return QuotaVerdict(False, QuotaStanding(charge, state.used, state.reserved))
            standings.append((charge, state, cost))
        holds = []
        for charge, state, cost in standings:
            state.reserved += cost
            holds.append(QuotaHold(charge.key, charge.window_id, cost, charge.input_weight, charge.output_weight))
        self.holds[claim.request_id] = tuple(holds)
        if claim.lease_s is not None and now is not None:
            self.leases[claim.request_id] = now + claim.lease_s
        return QuotaVerdict(True, binding([QuotaStanding(c, s.used, s.reserved) for c, s, _ in standings]))

    def settle(self, request_id: str, input_tokens: float, output_tokens: float) -> bool:
        """Drop the request's reservations and count what it used; False if it held none (or settled)."""
        self.leases.pop(request_id, None)
        holds = self.holds.pop(request_id, None)
        if holds is None:
            return False
        for hold in holds:
            state = self.states.get(hold.key)
            if state is None or state.window_id != hold.window_id:
                continue  # reserved in a window that has ended: it counts in neither
            used = input_tokens * hold.input_weight + output_tokens * hold.output_weight
            state.reserved = max(0.0, state.reserved - hold.amount)
            state.used += min(max(used, 0.0), hold.amount)
        return True

    def refund(self, request_id: str) -> bool:
        return self.settle(request_id, 0, 0)

    def renew(self, request_ids: Iterable[str], lease_until: float) -> None:
        """Extend the leases of holds that have one (a settled or unknown id changes nothing)."""
        for request_id in request_ids:
            if request_id in self.leases:
                self.leases[request_id] = lease_until

    def reap(self, now: float) -> list[str]:
        """Settle every hold whose lease lapsed by `now` at its whole amount; returns their ids (by deadline)."""
        lapsed = sorted((deadline, request_id) for request_id, deadline in self.leases.items() if deadline <= now)
        for _, request_id in lapsed:
            self.leases.pop(request_id, None)
            for hold in self.holds.pop(request_id, ()):
                state = self.states.get(hold.key)
                if state is not None and state.window_id == hold.window_id:
                    state.reserved = max(0.0, state.reserved - hold.amount)
                    state.used += hold.amount
        return [request_id for _, request_id in lapsed]

    def verdict(self, claim: QuotaClaim) -> QuotaVerdict:
        """Where the claim's quotas stand now, without reserving (after a refund, for the headers)."""
        return QuotaVerdict(True, binding([self.standing(charge) for charge in claim.charges]))

    def standing(self, charge: QuotaCharge) -> QuotaStanding:
        """Where a quota stands for a request in `charge`'s window (a newer window starts from its seed)."""
        state = self.states.get(charge.key)
        if state is None or state.window_id != charge.window_id:
            return QuotaStanding(charge, float(charge.seed_used), 0.0)
        return QuotaStanding(charge, state.used, state.reserved)
