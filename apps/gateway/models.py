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


class RequestOutcome(models.TextChoices):
    """How a request the gateway decided ended (the request log's `outcome`)."""

    SERVED = "served"  # a backend answered it in full
    REJECTED = "rejected"  # refused by admission (429/400 with its reason), its wait ran out, or shed upstream
    ERROR = "error"  # no answer or a broken one: no healthy replica, the store away, a backend failing
    CANCELLED = "cancelled"  # the client went away (or the server shut down) before the end of the answer
    PREEMPTED = "preempted"  # evicted to make room for higher-priority work
    TIMEOUT = "timeout"  # the backend did not answer within GATEWAY_READ_TIMEOUT_S / connect timeout


class RequestLogRecord(models.Model):
    """One request the gateway decided (issue 26): what it asked for, how admission answered and how long
    it took. Written in batches off the request path (apps/gateway/request_log.py), kept
    GATEWAY_REQUEST_LOG_DAYS days; what a replay turns back into a workload."""

    # The gateway's `x-request-id`: unique, so that a batch written twice (a flush retried after a crash) is
    # written once.
    request_id = models.CharField(max_length=64, unique=True)
    # When the request reached the gateway (wall clock, ms precision).
    arrived_at = models.DateTimeField()
    # No database constraint: a record of a tenant deleted since is dropped by the join, not by the batch
    # it came in (which a constraint would fail whole).
    tenant = models.ForeignKey("tenancy.Tenant", on_delete=models.DO_NOTHING, db_constraint=False, db_index=False,
                               related_name="+")
    pool = models.CharField(max_length=253)
    entitlement = models.CharField(max_length=253)
    # The entitlement's own class when the request came, and the class that served it (a lower one when it
    # spilled over or was demoted); blank when nothing served it.
    service_class = models.CharField(max_length=16)
    service_tier = models.CharField(max_length=16, blank=True, default="")
    stream = models.BooleanField(default=False)
    # The prompt's tokens as admission counted them, `max_tokens` as the client asked (null: not given), and
    # the completion tokens served.
    prompt_tokens = models.PositiveIntegerField(default=0)
    max_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(default=0)
    outcome = models.CharField(max_length=16, choices=RequestOutcome.choices)
    # The refusal's or error's code (e.g. concurrency_limit_exceeded, queue_timeout, upstream_error); blank
    # when served.
    reason = models.CharField(max_length=64, blank=True, default="")
    # Milliseconds waited in the entitlement's queue or the pool's waiting room; to the first token (from
    # arrival, waits included; null when none came); from arrival to the end.
    queue_ms = models.FloatField(default=0.0)
    ttft_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(default=0.0)

    class Meta:
        ordering = ["arrived_at", "id"]
        # By time, and by entitlement and time (the API's and a replay's windows). No more: every index is
        # paid by every insert (the flush), and a tenant's window is read through the time index.
        indexes = [
            models.Index(fields=["arrived_at"], name="gateway_reqlog_arrived"),
            models.Index(fields=["entitlement", "arrived_at"], name="gateway_reqlog_ent_arrived"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.outcome}"
