"""Model signals -> audit entries, written in the transaction of the change (a rolled-back change, such as a dry
run, leaves none).

What is audited, per model (``SPECS``): every concrete field except those the control loops keep (a pool's
measurements and desired replicas, a replica's scrape, an entitlement's binding state, a key's last use) and
the bookkeeping times; a user only for their roles (username, email, is_staff, is_superuser, is_active: not
the password, not last_login). A key's secret is never stored; its hash is never audited. A save that changes
no audited field writes no entry, and a save whose ``update_fields`` are all unaudited (binding, scrapes) does
not even read the row before.

Writes that bypass signals (``QuerySet.update``, ``bulk_create``) must call ``record_created`` /
``record_change`` themselves, or touch only unaudited fields (the scrape, autoscaling and last-use updates do).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import models
from django.db.models.signals import post_delete, post_save, pre_save

from apps.audit.context import current
from apps.audit.models import Action, AuditEntry

BOOKKEEPING = frozenset({"id", "created_at", "updated_at"})


@dataclass(frozen=True)
class Spec:
    kind: str
    name: Callable[[Any], str]
    ignored: frozenset[str] = frozenset()
    only: tuple[str, ...] = ()  # when set: the only audited fields

    def fields(self, model: type[models.Model]) -> tuple[str, ...]:
        if self.only:
            return self.only
        return tuple(f.attname for f in model._meta.concrete_fields
                     if f.attname not in BOOKKEEPING and f.attname not in self.ignored)


def _related(obj: Any, field: str, attr: str) -> str:
    """``obj.<field>.<attr>`` without a query when the related object is loaded; "" when it is gone."""
    try:
        return str(getattr(getattr(obj, field), attr))
    except models.ObjectDoesNotExist:
        return ""


SPECS: dict[str, Spec] = {
    "tenancy.Tenant": Spec("Tenant", lambda o: o.slug),
    "tenancy.Membership": Spec("Membership", lambda o: f"{_related(o, 'user', 'username')}@{_related(o, 'tenant', 'slug')}"),
    "tenancy.ApiKey": Spec("ApiKey", lambda o: o.prefix, ignored=frozenset({"secret_hash", "last_used_at"})),
    "pools.TokenPool": Spec("TokenPool", lambda o: o.name, ignored=frozenset({
        "measured_kv_cache_tokens_per_replica", "measured_kv_cache_bytes_per_replica", "measured_at",
        "desired_replicas", "desired_replicas_reason", "desired_replicas_at"})),
    "pools.Replica": Spec("Replica", lambda o: o.url, ignored=frozenset({
        "healthy", "scrape_error", "scraped_at", "num_requests_running", "num_requests_waiting", "kv_cache_usage",
        "kv_cache_tokens", "kv_cache_bytes"})),
    "pools.TokenEntitlement": Spec("TokenEntitlement", lambda o: o.name,
                                   ignored=frozenset({"state", "state_reason", "state_changed_at"})),
}
USER_SPEC = Spec("User", lambda o: o.get_username(),
                 only=("username", "email", "is_staff", "is_superuser", "is_active"))

_fields: dict[type[models.Model], tuple[Spec, tuple[str, ...]]] = {}


def connect() -> None:
    """Connect the receivers for every audited model (AppConfig.ready)."""
    labels = {**SPECS, settings.AUTH_USER_MODEL: USER_SPEC}
    for label, spec in labels.items():
        model = apps.get_model(label)
        _fields[model] = (spec, spec.fields(model))
        uid = f"audit:{label}"
        pre_save.connect(_before_save, sender=model, dispatch_uid=uid)
        post_save.connect(_after_save, sender=model, dispatch_uid=uid)
        post_delete.connect(_after_delete, sender=model, dispatch_uid=uid)


def _json(value: Any) -> Any:
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    return value


def _values(obj: models.Model, fields: Iterable[str]) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in fields}


def _tenant(obj: models.Model) -> tuple[int | None, str]:
    label = obj._meta.label
    if label == "tenancy.Tenant":
        return obj.pk, obj.slug  # type: ignore[attr-defined]
    tenant_id = getattr(obj, "tenant_id", None)
    if tenant_id is None:
        return None, ""
    return tenant_id, _related(obj, "tenant", "slug")


def _write(obj: models.Model, spec: Spec, action: str, before: dict[str, Any] | None,
           after: dict[str, Any] | None) -> None:
    actor_id, username = current().actor()
    tenant_id, tenant_slug = _tenant(obj)
    AuditEntry.objects.create(
        actor_id=actor_id, actor_username=username, through=current().channel, kind=spec.kind,
        object_id=str(obj.pk), object_name=spec.name(obj)[:300], tenant_id=tenant_id, tenant_slug=tenant_slug,
        action=action,
        before=None if before is None else {k: _json(v) for k, v in before.items()},
        after=None if after is None else {k: _json(v) for k, v in after.items()},
    )


def _before_save(sender: type[models.Model], instance: models.Model, raw: bool = False,
                 update_fields: Iterable[str] | None = None, **_: Any) -> None:
    instance._audit_before = None  # type: ignore[attr-defined]
    if raw or instance.pk is None or instance._state.adding:
        return
    _spec, fields = _fields[sender]
    if update_fields is not None:
        named = {getattr(sender._meta.get_field(f), "attname", f) for f in update_fields}
        fields = tuple(f for f in fields if f in named)
        if not fields:  # only unaudited fields (binding state, scrapes): nothing to read or record
            return
    instance._audit_before = (sender._base_manager.filter(pk=instance.pk)  # type: ignore[attr-defined]
                              .values(*fields).first())


def _after_save(sender: type[models.Model], instance: models.Model, created: bool, raw: bool = False,
                **_: Any) -> None:
    if raw:
        return
    spec, fields = _fields[sender]
    if created:
        _write(instance, spec, Action.CREATE, None, _values(instance, fields))
        return
    before = getattr(instance, "_audit_before", None)
    instance._audit_before = None  # type: ignore[attr-defined]
    if before is not None:
        record_change(instance, before)


def _after_delete(sender: type[models.Model], instance: models.Model, **_: Any) -> None:
    spec, fields = _fields[sender]
    _write(instance, spec, Action.DELETE, _values(instance, fields), None)


def record_change(obj: models.Model, before: dict[str, Any]) -> None:
    """An update of ``obj`` from the audited values in ``before`` (field -> value) to its values now; only the
    fields that differ are written, and nothing when none does."""
    spec, _fields_all = _fields[type(obj)]
    changed = [name for name, old in before.items() if getattr(obj, name) != old]
    if changed:
        _write(obj, spec, Action.UPDATE, {n: before[n] for n in changed}, {n: getattr(obj, n) for n in changed})


def record_created(objs: Iterable[models.Model]) -> None:
    """Creations written with ``bulk_create`` (which sends no signals); the objects must have their pks."""
    for obj in objs:
        spec, fields = _fields[type(obj)]
        _write(obj, spec, Action.CREATE, None, _values(obj, fields))
