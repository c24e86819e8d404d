"""Writes of the gateway app (usage records)."""

from __future__ import annotations

import datetime as dt

from django.db import IntegrityError, transaction
from django.db.models import F

from apps.gateway.models import UsageRecord


def usage_record_add(
    *,
    tenant_id: int,
    entitlement: str,
    minute: dt.datetime,
    service_tier: str = "",
    requests: int = 0,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    rejected: int = 0,
) -> None:
    """Add to the (tenant, entitlement, minute, served tier) record, creating it on first use (call inside a
    transaction)."""
    rows = UsageRecord.objects.filter(tenant_id=tenant_id, entitlement=entitlement, minute=minute,
                                      service_tier=service_tier)
    increments = {
        "requests": F("requests") + requests,
        "prompt_tokens": F("prompt_tokens") + prompt_tokens,
        "completion_tokens": F("completion_tokens") + completion_tokens,
        "rejected": F("rejected") + rejected,
    }
    if rows.update(**increments):
        return
    try:
        with transaction.atomic():  # a savepoint: another process may create the row first
            UsageRecord.objects.create(
                tenant_id=tenant_id, entitlement=entitlement, minute=minute, service_tier=service_tier,
                requests=requests,
                prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, rejected=rejected,
            )
    except IntegrityError:
        # Lost the race to create it: add to the row the other process made. If there is none (the
        # tenant was deleted meanwhile) the counts have nobody to belong to and are dropped.
        rows.update(**increments)
