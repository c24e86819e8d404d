"""Quota windows on the calendar (UTC and local time across DST changes) and the quota book's transitions:
all-or-nothing reservations, settling at most what was reserved, once; a new window starting from its seed."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest

from apps.policy.quota import (
    QuotaBook,
    QuotaCharge,
    QuotaClaim,
    QuotaRule,
    quota_window_of,
    quota_window_start,
)

UTC = dt.UTC
PARIS = ZoneInfo("Europe/Paris")


@pytest.mark.parametrize(("window", "tz", "now", "window_id", "reset"), [
    ("hour", "UTC", dt.datetime(2026, 11, 24, 13, 59, 59, tzinfo=UTC), "2026-11-24T13Z",
     dt.datetime(2026, 11, 24, 14, tzinfo=UTC)),
    ("day", "UTC", dt.datetime(2026, 11, 24, 23, 59, tzinfo=UTC), "2026-11-24", dt.datetime(2026, 11, 25, tzinfo=UTC)),
    ("month", "UTC", dt.datetime(2026, 12, 31, 23, 0, tzinfo=UTC), "2026-12", dt.datetime(2027, 1, 1, tzinfo=UTC)),
    # 23:30 UTC on 24 Nov is already the 25th in Paris (UTC+1): that day ends at 23:00 UTC on the 25th.
    ("day", "Europe/Paris", dt.datetime(2026, 11, 24, 23, 30, tzinfo=UTC), "2026-11-25",
     dt.datetime(2026, 11, 25, 23, tzinfo=UTC)),
    # The day clocks go forward in Paris (29 March 2026) lasts 23 hours.
    ("day", "Europe/Paris", dt.datetime(2026, 3, 29, 12, tzinfo=UTC), "2026-03-29",
     dt.datetime(2026, 3, 29, 22, tzinfo=UTC)),
    ("month", "Europe/Paris", dt.datetime(2026, 3, 31, 22, 30, tzinfo=UTC), "2026-04",
     dt.datetime(2026, 4, 30, 22, tzinfo=UTC)),
])
def test_windows_follow_the_calendar(window: str, tz: str, now: dt.datetime, window_id: str,
                                     reset: dt.datetime) -> None:
    assert quota_window_of(window, tz, now) == (window_id, reset)
    start = quota_window_start(window, tz, now)
    assert start <= now < reset
    assert quota_window_of(window, tz, start)[0] == window_id
    assert quota_window_of(window, tz, start - dt.timedelta(microseconds=1))[0] != window_id


def test_an_hour_that_happens_twice_is_two_windows() -> None:
    # 25 October 2026, 02:00-03:00 happens twice in Paris; each is its own hour, named in UTC.
    first = dt.datetime(2026, 10, 25, 2, 30, tzinfo=PARIS).replace(fold=0)
    second = first.replace(fold=1)
    assert quota_window_of("hour", "Europe/Paris", first)[0] != quota_window_of("hour", "Europe/Paris", second)[0]


def test_unknown_window_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown quota window"):
        quota_window_of("week", "UTC", dt.datetime.now(UTC))


def _claim(rid: str, *charges: QuotaCharge, prompt: int = 10, max_tokens: int = 20) -> QuotaClaim:
    return QuotaClaim(rid, prompt, max_tokens, charges, issued_at=0.0)


def test_reservations_are_all_or_nothing_and_settle_once() -> None:
    book = QuotaBook()
    ent = QuotaCharge("entitlement:a", 100.0, "w", reset_at=60.0)
    tenant = QuotaCharge("tenant", 50.0, "w", reset_at=60.0, input_weight=1.0, output_weight=2.0)
    assert book.reserve(_claim("r1", ent, tenant)).admitted  # 30 and 10 + 40 = 50
    refused = book.reserve(_claim("r2", ent, tenant, prompt=1, max_tokens=1))
    assert not refused.admitted and refused.standing is not None and refused.standing.charge.key == "tenant"
    assert refused.retry_after_s(issued_at=0.0) == 60.0
    assert book.standing(ent).reserved == 30.0  # nothing of r2 was kept anywhere
    assert book.settle("r1", 10, 5)
    assert (book.standing(ent).used, book.standing(tenant).used) == (15.0, 20.0)
    assert not book.settle("r1", 10, 5)  # a second settle changes nothing
    assert book.standing(tenant).reserved == 0.0


def test_settling_never_counts_more_than_was_reserved_and_old_windows_stay_old() -> None:
    book = QuotaBook()
    old = QuotaCharge("entitlement:a", 100.0, "w1", reset_at=60.0, seed_used=7.0)
    assert book.reserve(_claim("r1", old)).admitted
    assert book.standing(old).used == 7.0
    new = QuotaCharge("entitlement:a", 100.0, "w2", reset_at=120.0, seed_used=3.0)
    assert book.reserve(_claim("r2", new)).admitted  # the new window starts from its seed
    assert book.settle("r1", 500, 500)  # reserved in w1: counts in neither
    assert (book.standing(new).used, book.standing(new).reserved) == (3.0, 30.0)
    assert book.settle("r2", 500, 500)
    assert book.standing(new).used == 33.0  # clamped to the 30 reserved


def test_a_rule_charges_its_seed_only_in_the_window_it_was_read_for() -> None:
    rule = QuotaRule("tenant", 10.0, "day", seed_window_id="2026-11-24", seed_used=4.0)
    assert rule.charge_at(dt.datetime(2026, 11, 24, 12, tzinfo=UTC)).seed_used == 4.0
    assert rule.charge_at(dt.datetime(2026, 11, 25, 0, 1, tzinfo=UTC)).seed_used == 0.0


def test_a_lapsed_lease_settles_the_hold_at_its_whole_amount_and_a_renewed_one_stays() -> None:
    book = QuotaBook()
    charge = QuotaCharge("entitlement:chat", 100.0, "w1", reset_at=3600.0)
    for rid in ("a", "b"):
        assert book.reserve(QuotaClaim(rid, 10, 20, (charge,), 0.0, lease_s=2.0), now=0.0).admitted
    book.renew(["a", "unknown"], 1.5 + 2.0)
    assert book.reap(1.0) == []
    assert book.reap(2.0) == ["b"]
    assert (book.standing(charge).used, book.standing(charge).reserved) == (30.0, 30.0)
    assert not book.settle("b", 1, 1)  # its release after the reap settles nothing
    assert book.settle("a", 5, 5)
    assert book.reap(10.0) == []
    assert (book.standing(charge).used, book.standing(charge).reserved) == (40.0, 0.0)
