"""One change to an audited object: who, when, through what, which object, what action, the fields before and
after. Plain columns, no foreign keys: entries outlive the users, tenants and objects they name."""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.utils import timezone

from apps.audit.context import CHANNELS


class Action(models.TextChoices):
    CREATE = "create", "create"
    UPDATE = "update", "update"
    DELETE = "delete", "delete"


class AuditEntry(models.Model):
    at = models.DateTimeField(default=timezone.now)
    actor_id = models.BigIntegerField(null=True, blank=True)  # the user's id; null for "system"
    actor_username = models.CharField(max_length=150, db_index=True)
    through = models.CharField(max_length=16, choices=[(c, c) for c in CHANNELS])
    kind = models.CharField(max_length=32)
    object_id = models.CharField(max_length=64)
    object_name = models.CharField(max_length=300, db_index=True)
    # The tenant the object belongs to (its owners may read the entry); null for platform objects
    # (pools, replicas, users), which only superusers see.
    tenant_id = models.BigIntegerField(null=True, blank=True)
    tenant_slug = models.CharField(max_length=63, blank=True, default="")
    action = models.CharField(max_length=8, choices=Action.choices)
    # Field -> value (JSON: decimals and times as strings): every audited field on create (after) and delete
    # (before), only the changed ones on update.
    before = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    after = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["tenant_id", "at"]), models.Index(fields=["kind", "at"]),
                   models.Index(fields=["at"])]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_username} {self.action} {self.kind}/{self.object_name}"
