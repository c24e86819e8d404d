"""Writes for pools, replicas and entitlements, and the binding of entitlements to pool capacity.

Binding replaces the seed's virtual nodes and lease pods (seed 000, section 4.1). It is one function,
``_evaluate_pool``, run inside a transaction that holds the pool row locked (``select_for_update``), so
two writers never bind against the same free room:

* an entitlement past ``expires_at`` is Expired and reserves nothing;
* spot and preemptible entitlements reserve nothing and are Bound whenever their pool exists;
* dedicated and guaranteed baselines are reserved, elastic baselines count as time-averaged
  reservations; these are walked oldest first (``created_at``, then id) and each one is Bound when its
  baseline fits the room the older Bound ones left on all three dimensions (slots, tokens/s, KV bytes),
  else Degraded. So a shrunk pool degrades the newest reservations first and a grown pool binds them
  back, and creating an entitlement never degrades an older one. (Like the Kubernetes scheduler, a
  smaller newer reservation may still fit where a larger older one did not.)
* except that an elastic entitlement already Bound stays Bound when the pool shrinks under it, as long as
  the pool has any capacity left: its baseline is time-averaged and shrinkable, so the elastic
  entitlements share what is left by priority and debt (seed 000, Experiment 2: copilot and synth both
  keep serving through the outage), as the simulator does. It takes no room from the entitlements
  evaluated after it (it is oversubscribed, not reserved), and it fits again when the pool grows back.

Every state change writes an ``EntitlementStateChange`` row with the reason and the time.

Services take the acting user as ``actor``; pools are changed by superusers only, entitlements by owners
of their tenant (and superusers). Errors: ``ValidationError`` (field -> messages) or ``PermissionDenied``;
each service is atomic, so a failure writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.audit.recorder import record_created
from apps.pools.binding import evaluate_pool
from apps.pools.models import (
    EntitlementState,
    EntitlementStateChange,
    Replica,
    TokenEntitlement,
    TokenPool,
)
from apps.pools.selectors import pool_list_for_tenant
from apps.pools.validators import validate_backend_url
from apps.tenancy.actors import AnyUser
from apps.tenancy.models import Tenant
from apps.tenancy.permissions import require_owner, require_superuser
from apps.tenancy.selectors import user_role

POOL_FIELDS = (
    "model_name",
    "backend_kind",
    "min_replicas",
    "max_replicas",
    "slots_per_replica",
    "tokens_per_second_per_replica",
    "kv_cache_gib_per_replica",
    "kv_layers",
    "kv_heads",
    "head_dim",
    "bytes_per_element",
    "price_input_per_million",
    "price_output_per_million",
    "price_currency",
    "inference_objectives",
)
QUOTA_FIELDS = ("quota_tokens", "quota_amount", "quota_currency", "quota_window", "quota_timezone",
                "quota_on_exceeded")
ENTITLEMENT_FIELDS = (
    "pool",
    "service_class",
    "slo_target_ms",
    "tokens_per_second",
    "kv_cache_gib",
    "concurrency",
    "default_max_tokens",
    "queue_max",
    "queue_max_wait_ms",
    "spillover_class",
    "expires_at",
    *QUOTA_FIELDS,
)
# Pool fields that change capacity, so that editing them re-evaluates the pool's entitlements.
CAPACITY_FIELDS = frozenset({"slots_per_replica", "tokens_per_second_per_replica", "kv_cache_gib_per_replica"})


# --- binding -----------------------------------------------------------------------------------------


def _evaluate_pool(pool: TokenPool, *, now: datetime, trigger: str) -> list[tuple[TokenEntitlement, str, str]]:
    """Recompute every entitlement state of a pool whose row the caller holds locked (``apps.pools.binding``).

    Returns the ``(entitlement, from_state, to_state)`` of each change.
    """
    return evaluate_pool(pool, now=now, trigger=trigger)


def _lock_pool(pool_id: int) -> TokenPool:
    return TokenPool.objects.select_for_update().get(pk=pool_id)


@transaction.atomic
def pool_rebind(*, pool: TokenPool, now: datetime | None = None, reason: str = "") -> list[tuple[TokenEntitlement, str, str]]:
    """Lock the pool and re-evaluate all its entitlements; returns the state changes made."""
    locked = _lock_pool(pool.pk)
    return _evaluate_pool(locked, now=now or timezone.now(), trigger=reason)


@transaction.atomic
def entitlement_bind(*, entitlement: TokenEntitlement, now: datetime | None = None, reason: str = "") -> TokenEntitlement:
    """Bind (or degrade, or expire) one entitlement by re-evaluating its pool under the pool lock."""
    pool_rebind(pool=entitlement.pool, now=now, reason=reason)
    entitlement.refresh_from_db()
    return entitlement


@transaction.atomic
def entitlements_expire(*, now: datetime | None = None) -> int:
    """Mark every entitlement past ``expires_at`` Expired (freeing its reservation); returns how many.

    Meant for a periodic tick. Re-evaluating the pools also binds Degraded entitlements that now fit.
    """
    now = now or timezone.now()
    due = TokenEntitlement.objects.filter(expires_at__lte=now).exclude(state=EntitlementState.EXPIRED)
    pool_ids = sorted(set(due.values_list("pool_id", flat=True)))
    expired = 0
    for pool_id in pool_ids:  # sorted ids: every writer locks pools in the same order, no deadlock
        changes = _evaluate_pool(_lock_pool(pool_id), now=now, trigger="expiry tick")
        expired += sum(1 for _ent, _before, after in changes if after == EntitlementState.EXPIRED)
    return expired


# --- pools -------------------------------------------------------------------------------------------


def _clean_replicas(replicas: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    cleaned: list[dict[str, Any]] = []
    errors: list[str] = []
    seen: set[str] = set()
    for index, raw in enumerate(replicas):
        if not isinstance(raw, Mapping):
            errors.append(f"replica {index}: expected an object with 'url' (and optional 'enabled')")
            continue
        url = raw.get("url")
        enabled = raw.get("enabled", True)
        if not isinstance(url, str) or not url:
            errors.append(f"replica {index}: 'url' is required")
            continue
        try:
            validate_backend_url(url)
        except ValidationError:
            errors.append(f"replica {index}: {url!r} is not an http(s) URL")
            continue
        if not isinstance(enabled, bool):
            errors.append(f"replica {index}: 'enabled' must be true or false")
            continue
        if url in seen:
            errors.append(f"replica {index}: duplicate URL {url!r}")
            continue
        seen.add(url)
        cleaned.append({"url": url, "enabled": enabled})
    if errors:
        raise ValidationError({"replicas": errors})
    return cleaned


def _check_pool(pool: TokenPool, replicas: Sequence[Mapping[str, Any]] | None) -> None:
    errors: dict[str, list[str]] = {}
    try:
        pool.full_clean()
    except ValidationError as exc:
        errors.update(exc.message_dict)
    if isinstance(pool.min_replicas, int) and isinstance(pool.max_replicas, int) and pool.min_replicas > pool.max_replicas:
        errors.setdefault("min_replicas", []).append("must not exceed max_replicas")
    if replicas is not None and isinstance(pool.max_replicas, int) and len(replicas) > pool.max_replicas:
        errors.setdefault("replicas", []).append(f"{len(replicas)} replicas listed but max_replicas is {pool.max_replicas}")
    if pool.pk is not None and "price_currency" not in errors:
        # Money quotas of the pool's entitlements (and of their tenants) are priced here.
        # Only those with an amount (theirs or their tenant's) can have a money quota: thousands need not load.
        priced = Q(quota_amount__isnull=False) | Q(tenant__quota_amount__isnull=False)
        for ent in pool.entitlements.select_related("tenant").filter(priced):
            for owner, what in ((ent, f"entitlement {ent.name!r}"), (ent.tenant, f"tenant {ent.tenant.slug!r}")):
                problem = money_quota_problem(owner, pool, what)
                if problem:
                    errors.setdefault("price_currency", []).append(problem)
    if errors:
        raise ValidationError(errors)


def money_quota_problem(owner: Any, pool: TokenPool, what: str) -> str | None:
    """Why `owner`'s money quota cannot be priced at `pool`'s prices, or None (no money quota, or fine)."""
    if not owner.quota_is_money:
        return None
    if not pool.has_prices:
        return f"{what} has a quota in {owner.quota_currency} but pool {pool.name!r} has no prices"
    if pool.price_currency != owner.quota_currency:
        return (f"{what} has a quota in {owner.quota_currency} but pool {pool.name!r} is priced in "
                f"{pool.price_currency}")
    return None


def _replace_replicas(pool: TokenPool, replicas: list[dict[str, Any]]) -> None:
    current = [(r.url, r.enabled) for r in pool.replicas.order_by("position", "id")]
    if current == [(r["url"], r["enabled"]) for r in replicas]:
        return  # the same list: keep the rows (their scrapes, and no delete/create in the audit log)
    pool.replicas.all().delete()
    created = Replica.objects.bulk_create(
        [Replica(pool=pool, url=r["url"], enabled=r["enabled"], position=i) for i, r in enumerate(replicas)]
    )
    record_created(created)  # bulk_create sends no signals


@transaction.atomic
def pool_create(
    *,
    actor: AnyUser,
    name: str,
    model_name: str,
    slots_per_replica: int,
    tokens_per_second_per_replica: int,
    kv_cache_gib_per_replica: Decimal | int | float | str,
    kv_layers: int,
    kv_heads: int,
    head_dim: int,
    bytes_per_element: int = 2,
    backend_kind: str = "vllm",
    min_replicas: int = 1,
    max_replicas: int = 1,
    replicas: Iterable[Mapping[str, Any]] = (),
    now: datetime | None = None,
    price_input_per_million: Decimal | None = None,
    price_output_per_million: Decimal | None = None,
    price_currency: str = "",
    inference_objectives: dict[str, str] | None = None,
) -> TokenPool:
    """Create a pool with its replicas (each ``{"url": ..., "enabled": bool}``); superusers only."""
    require_superuser(actor, "manage pools")
    now = now or timezone.now()
    cleaned = _clean_replicas(replicas)
    pool = TokenPool(
        name=name,
        model_name=model_name,
        backend_kind=backend_kind,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        slots_per_replica=slots_per_replica,
        tokens_per_second_per_replica=tokens_per_second_per_replica,
        kv_cache_gib_per_replica=kv_cache_gib_per_replica,
        kv_layers=kv_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        bytes_per_element=bytes_per_element,
        price_input_per_million=price_input_per_million,
        price_output_per_million=price_output_per_million,
        price_currency=price_currency,
        inference_objectives=inference_objectives or {},
        created_at=now,
        updated_at=now,
    )
    _check_pool(pool, cleaned)
    pool.save()
    _replace_replicas(pool, cleaned)
    return pool


@transaction.atomic
def pool_update(
    *,
    actor: AnyUser,
    pool: TokenPool,
    replicas: Iterable[Mapping[str, Any]] | None = None,
    now: datetime | None = None,
    **fields: Any,
) -> TokenPool:
    """Change pool fields (any of ``POOL_FIELDS``) and optionally replace its replica list; superusers only.

    The pool row is locked first; if capacity may have changed its entitlements are re-evaluated.
    """
    require_superuser(actor, "manage pools")
    unknown = set(fields) - set(POOL_FIELDS)
    if unknown:
        raise ValidationError({name: ["unknown or read-only field"] for name in sorted(unknown)})
    now = now or timezone.now()
    locked = _lock_pool(pool.pk)
    cleaned = _clean_replicas(replicas) if replicas is not None else None
    for name, value in fields.items():
        setattr(locked, name, value)
    locked.updated_at = now
    _check_pool(locked, cleaned if cleaned is not None else [r for r in locked.replicas.values("url")])
    locked.save()
    if cleaned is not None:
        _replace_replicas(locked, cleaned)
    _evaluate_pool(locked, now=now, trigger="pool updated")
    return locked


@transaction.atomic
def pool_delete(*, actor: AnyUser, pool: TokenPool) -> None:
    """Delete a pool that has no entitlements (superusers only)."""
    require_superuser(actor, "manage pools")
    locked = _lock_pool(pool.pk)
    count = locked.entitlements.count()
    if count:
        raise ValidationError({"pool": [f"pool {locked.name!r} still has {count} entitlement(s); delete them first"]})
    locked.delete()


@transaction.atomic
def replica_add(*, actor: AnyUser, pool: TokenPool, url: str, enabled: bool = True) -> Replica:
    """Add a replica to a pool (superusers only) and re-evaluate the pool."""
    require_superuser(actor, "manage pools")
    locked = _lock_pool(pool.pk)
    (cleaned,) = _clean_replicas([{"url": url, "enabled": enabled}])
    if locked.replicas.filter(url=cleaned["url"]).exists():
        raise ValidationError({"url": [f"pool {locked.name!r} already has replica {url!r}"]})
    if locked.replicas.count() + 1 > locked.max_replicas:
        raise ValidationError({"url": [f"pool {locked.name!r} already has max_replicas={locked.max_replicas}"]})
    position = (locked.replicas.order_by("-position").values_list("position", flat=True).first() or 0) + 1
    replica = Replica.objects.create(pool=locked, url=cleaned["url"], enabled=cleaned["enabled"], position=position)
    _evaluate_pool(locked, now=timezone.now(), trigger="replica added")
    return replica


@transaction.atomic
def replica_set_enabled(*, actor: AnyUser, replica: Replica, enabled: bool) -> Replica:
    """Enable or disable a replica (superusers only); capacity changes, so the pool is re-evaluated."""
    require_superuser(actor, "manage pools")
    locked = _lock_pool(replica.pool_id)
    replica = locked.replicas.get(pk=replica.pk)
    if replica.enabled != enabled:
        replica.enabled = enabled
        replica.save(update_fields=["enabled"])
        _evaluate_pool(locked, now=timezone.now(), trigger=f"replica {replica.url} {'enabled' if enabled else 'disabled'}")
    return replica


@transaction.atomic
def replica_remove(*, actor: AnyUser, replica: Replica) -> None:
    """Remove a replica (superusers only) and re-evaluate the pool."""
    require_superuser(actor, "manage pools")
    locked = _lock_pool(replica.pool_id)
    url = replica.url
    locked.replicas.filter(pk=replica.pk).delete()
    _evaluate_pool(locked, now=timezone.now(), trigger=f"replica {url} removed")


# --- entitlements ------------------------------------------------------------------------------------


def _check_entitlement(ent: TokenEntitlement, *, exclude: Iterable[str] = (), validate_unique: bool = True) -> None:
    """The entitlement's field checks and its money quotas' currency. `exclude` and `validate_unique`: what a
    caller that loaded the answers already (apply, in bulk) leaves out; the binding fields are never checked."""
    try:
        ent.full_clean(exclude=["state", "state_reason", "state_changed_at", *exclude], validate_unique=validate_unique)
    except ValidationError as exc:
        raise ValidationError(exc.message_dict) from exc
    for owner, field, what in ((ent, "quota_amount", "this entitlement"), (ent.tenant, "pool", "its tenant")):
        problem = money_quota_problem(owner, ent.pool, what)
        if problem:
            raise ValidationError({field: [problem]})


@transaction.atomic
def entitlement_create(
    *,
    actor: AnyUser,
    name: str,
    tenant: Tenant,
    pool: TokenPool,
    service_class: str,
    slo_target_ms: int,
    tokens_per_second: int,
    kv_cache_gib: Decimal | int | float | str,
    concurrency: int,
    default_max_tokens: int | None = None,
    queue_max: int | None = None,
    queue_max_wait_ms: int | None = None,
    spillover_class: str = "",
    expires_at: datetime | None = None,
    now: datetime | None = None,
    **quota: Any,
) -> TokenEntitlement:
    """Create an entitlement (owners of ``tenant`` and superusers) and bind it at once; ``quota`` takes
    the ``QUOTA_FIELDS``.

    It is written Pending, then the pool is locked and evaluated, so it leaves as Bound, Degraded or
    Expired, with both transitions in its history.
    """
    require_owner(actor, tenant, "create entitlements")
    unknown = set(quota) - set(QUOTA_FIELDS)
    if unknown:
        raise ValidationError({name: ["unknown or read-only field"] for name in sorted(unknown)})
    now = now or timezone.now()
    ent = TokenEntitlement(
        **quota,
        name=name,
        tenant=tenant,
        pool=pool,
        service_class=service_class,
        slo_target_ms=slo_target_ms,
        tokens_per_second=tokens_per_second,
        kv_cache_gib=kv_cache_gib,
        concurrency=concurrency,
        default_max_tokens=default_max_tokens,
        queue_max=queue_max,
        queue_max_wait_ms=queue_max_wait_ms,
        spillover_class=spillover_class,
        expires_at=expires_at,
        state=EntitlementState.PENDING,
        state_reason="created",
        state_changed_at=now,
        created_at=now,
        updated_at=now,
    )
    _check_entitlement(ent)
    locked = _lock_pool(pool.pk)  # lock before inserting: the insert changes what the pool must hold
    ent.save()
    EntitlementStateChange.objects.create(entitlement=ent, from_state="", to_state=ent.state, reason="created", at=now)
    _evaluate_pool(locked, now=now, trigger="")
    ent.refresh_from_db()
    return ent


@transaction.atomic
def entitlement_update(
    *, actor: AnyUser, entitlement: TokenEntitlement, now: datetime | None = None, **fields: Any
) -> TokenEntitlement:
    """Change an entitlement (any of ``ENTITLEMENT_FIELDS``; owners and superusers) and re-bind it.

    Moving it to another pool re-evaluates both pools (locked in id order). The tenant cannot change.
    """
    require_owner(actor, entitlement.tenant, "change entitlements")
    unknown = set(fields) - set(ENTITLEMENT_FIELDS)
    if unknown:
        raise ValidationError({name: ["unknown or read-only field"] for name in sorted(unknown)})
    now = now or timezone.now()
    ent = TokenEntitlement.objects.select_for_update().get(pk=entitlement.pk)
    old_pool_id = ent.pool_id
    for name, value in fields.items():
        setattr(ent, name, value)
    ent.updated_at = now
    _check_entitlement(ent)
    pool_ids = sorted({old_pool_id, ent.pool_id})
    locked = {pid: _lock_pool(pid) for pid in pool_ids}
    ent.save()
    for pid in pool_ids:
        _evaluate_pool(locked[pid], now=now, trigger=f"entitlement {ent.name} updated")
    ent.refresh_from_db()
    return ent


@transaction.atomic
def entitlement_delete(*, actor: AnyUser, entitlement: TokenEntitlement) -> None:
    """Delete an entitlement and its keys (owners and superusers); its pool's room goes to the others."""
    require_owner(actor, entitlement.tenant, "delete entitlements")
    locked = _lock_pool(entitlement.pool_id)
    name = entitlement.name
    entitlement.delete()
    _evaluate_pool(locked, now=timezone.now(), trigger=f"entitlement {name} deleted")


def can_edit_entitlements(*, user: AnyUser, tenant: Tenant) -> bool:
    """Whether the user may create/change/delete the tenant's entitlements (for UIs to show buttons)."""
    return user_role(user=user, tenant=tenant) == "owner"


@transaction.atomic
def tenant_delete(*, actor: AnyUser, tenant: Tenant) -> None:
    """Delete a tenant with its memberships, entitlements and keys (superusers only), then rebind the pools
    its entitlements held capacity in, so that the Degraded entitlements of other tenants can bind there. The
    one tenant delete: the UI, the REST API and `manage.py delete -f` all call it."""
    require_superuser(actor, "delete tenants")
    pools = pool_list_for_tenant(tenant=tenant)  # before the cascade takes the entitlements away
    tenant.delete()
    for pool in pools:
        pool_rebind(pool=pool, reason=f"tenant {tenant.slug} deleted")
