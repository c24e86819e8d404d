"""Usage rollups: old per-minute records fold into hourly ones, sums unchanged, idempotent."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db.models import Sum

from apps.gateway.models import UsageRecord
from apps.tenancy.models import Tenant
from workers.rollups import usage_rollup

NOW = datetime(2026, 11, 22, 12, 30, tzinfo=UTC)


@pytest.mark.django_db
def test_old_minutes_fold_into_their_hour_and_recent_ones_stay() -> None:
    acme = Tenant.objects.create(name="Acme", slug="acme")
    old_hour = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)
    for minute in (0, 1, 59):  # the hour's first minute already holds a record: it becomes the hourly row
        UsageRecord.objects.create(tenant=acme, entitlement="e", minute=old_hour + timedelta(minutes=minute),
                                   requests=1, prompt_tokens=10, completion_tokens=5, rejected=minute % 2)
    UsageRecord.objects.create(tenant=acme, entitlement="other", minute=old_hour + timedelta(minutes=7),
                               requests=2, prompt_tokens=3, completion_tokens=4)
    recent = NOW - timedelta(hours=2)
    UsageRecord.objects.create(tenant=acme, entitlement="e", minute=recent + timedelta(minutes=3), requests=9)
    totals = UsageRecord.objects.aggregate(r=Sum("requests"), p=Sum("prompt_tokens"), c=Sum("completion_tokens"))

    removed = usage_rollup(now=NOW)

    assert removed == 2
    hourly = UsageRecord.objects.get(entitlement="e", minute=old_hour)
    assert (hourly.requests, hourly.prompt_tokens, hourly.completion_tokens, hourly.rejected) == (3, 30, 15, 2)
    other = UsageRecord.objects.get(entitlement="other")
    assert other.minute == old_hour and other.requests == 2
    assert UsageRecord.objects.filter(minute=recent + timedelta(minutes=3)).exists()
    assert UsageRecord.objects.aggregate(r=Sum("requests"), p=Sum("prompt_tokens"),
                                         c=Sum("completion_tokens")) == totals
    assert usage_rollup(now=NOW) == 0
