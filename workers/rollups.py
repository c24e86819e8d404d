"""Usage rollups: per-minute `UsageRecord` rows older than a day are folded into one row per hour.

The hourly row is the record whose `minute` is the hour's start, so every reader that sums records
over a time range keeps working unchanged (a sum over the hour is the same before and after), and
the table stops growing by 1,440 rows per entitlement per day. Idempotent: a second run finds
nothing left to fold. (A service of the gateway's usage records; it lives here until apps/gateway
takes it into its services module.)
"""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.db.models import Sum
from django.db.models.functions import TruncHour
from django.utils import timezone

DEFAULT_KEEP_MINUTES = dt.timedelta(hours=24)


@transaction.atomic
def usage_rollup(*, now: dt.datetime | None = None, keep: dt.timedelta = DEFAULT_KEEP_MINUTES) -> int:
    """Fold minute records of whole hours that ended more than `keep` ago; returns how many rows the
    table shrank by (minutes deleted less hourly rows created)."""
    from apps.gateway.models import UsageRecord

    now = now or timezone.now()
    # Only whole hours: the hour containing the cutoff keeps its minutes until it is entirely old.
    cutoff = (now - keep).replace(minute=0, second=0, microsecond=0)
    old = UsageRecord.objects.filter(minute__lt=cutoff)
    groups = (
        old.exclude(minute=TruncHour("minute"))
        .annotate(hour=TruncHour("minute"))
        .values("tenant_id", "entitlement", "hour")
        .annotate(
            requests_sum=Sum("requests"), prompt_sum=Sum("prompt_tokens"),
            completion_sum=Sum("completion_tokens"), rejected_sum=Sum("rejected"),
        )
        .order_by("tenant_id", "entitlement", "hour")
    )
    removed = 0
    for group in list(groups):
        hour = group["hour"]
        record, created = UsageRecord.objects.select_for_update().get_or_create(
            tenant_id=group["tenant_id"], entitlement=group["entitlement"], minute=hour,
        )
        record.requests += group["requests_sum"] or 0
        record.prompt_tokens += group["prompt_sum"] or 0
        record.completion_tokens += group["completion_sum"] or 0
        record.rejected += group["rejected_sum"] or 0
        record.save(update_fields=["requests", "prompt_tokens", "completion_tokens", "rejected"])
        deleted, _ = (
            UsageRecord.objects.filter(
                tenant_id=group["tenant_id"], entitlement=group["entitlement"],
                minute__gte=hour, minute__lt=hour + dt.timedelta(hours=1),
            )
            .exclude(pk=record.pk)
            .delete()
        )
        removed += deleted - (1 if created else 0)
    return removed
