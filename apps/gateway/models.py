"""Usage records: what each entitlement consumed, per minute and served tier, written in batches by the gateway."""

from __future__ import annotations

from django.db import models


class UsageRecord(models.Model):
    tenant = models.ForeignKey("tenancy.Tenant", on_delete=models.CASCADE, related_name="usage_records")
    # The entitlement's name (unique, never renamed): records outlive a deleted entitlement.
    entitlement = models.CharField(max_length=253)
    minute = models.DateTimeField()
    # The class that served these requests (issue 24): the entitlement's own, or the lower one they spilled
    # over or were demoted to; blank on records from before tiers were recorded.
    service_tier = models.CharField(max_length=16, blank=True, default="")
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    rejected = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-minute", "entitlement"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "entitlement", "minute", "service_tier"],
                                    name="gateway_usage_unique_minute_tier")
        ]
        indexes = [models.Index(fields=["entitlement", "minute"])]

    def __str__(self) -> str:
        return f"{self.entitlement} @ {self.minute:%Y-%m-%d %H:%M}"


class UsageBatch(models.Model):
    """A batch of usage counts taken from the shared store, applied once: the flush writes the records and
    this row in one transaction, so a batch retried after a crash (or taken over from a gateway that died
    before it could say it was done) is not counted twice."""

    token = models.CharField(max_length=64, unique=True)
    applied_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.token
