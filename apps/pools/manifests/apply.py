"""Validate a manifest against the database and itself, then write it in one transaction: tenants, then
pools, then entitlements, whatever the documents' order. Nothing is written if any document is wrong."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator, Mapping
from typing import Any

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from apps.pools.manifests.diff import object_diffs, stored_manifests
from apps.pools.manifests.entitlements import EntitlementWriter, existing_by_name, in_chunks
from apps.pools.manifests.export import entitlement_to_manifest
from apps.pools.manifests.kinds import read_entitlement, read_pool, read_tenant
from apps.pools.manifests.limits import excerpt, structure_problem
from apps.pools.manifests.reader import (
    API_VERSION,
    ENTITLEMENT_PATHS,
    KINDS,
    POOL_PATHS,
    SCHEMAS,
    AppliedDocument,
    ApplyResult,
    Collector,
    EntitlementWarning,
    ManifestError,
    ManifestIssue,
    Plan,
    Reader,
    changed_paths,
    manifests_parse,
    model_errors,
    unknown_fields,
)
from apps.pools.manifests.tenants import apply_tenant, validate_tenants
from apps.pools.models import ENTITLEMENT_NAME_TAKEN, EntitlementState, TokenEntitlement, TokenPool
from apps.pools.services import (
    _check_pool,
    money_quota_problem,
    pool_create,
    pool_update,
)
from apps.tenancy.models import Tenant
from apps.tenancy.selectors import tenant_list, user_role


def _pool_values_of(pool: TokenPool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = {name: getattr(pool, name) for name in POOL_PATHS if name not in ("name", "replicas")}
    replicas = [{"url": r.url, "enabled": r.enabled} for r in pool.replicas.order_by("position", "id")]
    return values, replicas


def _read_documents(documents: list[Any], actor: Any, errors: Collector) -> dict[str, list[Plan]]:
    plans: dict[str, list[Plan]] = {kind: [] for kind in KINDS}
    seen: set[tuple[str, str]] = set()
    is_superuser = bool(getattr(actor, "is_superuser", False))
    for index, doc in enumerate(documents):
        if not isinstance(doc, Mapping):
            errors.add(index, "", "", "", "a document must be a mapping")
            continue
        kind: str = doc["kind"] if isinstance(doc.get("kind"), str) else ""
        metadata = doc.get("metadata")
        name: str = metadata["name"] if isinstance(metadata, Mapping) and isinstance(metadata.get("name"), str) else ""
        if doc.get("apiVersion") != API_VERSION:
            errors.add(index, kind, name, "apiVersion", f"must be {API_VERSION!r}, got {excerpt(doc.get('apiVersion'))}")
        if kind not in KINDS:
            errors.add(index, kind, name, "kind", f"must be one of {', '.join(KINDS)}, got {excerpt(doc.get('kind'))}")
            continue
        if not name:
            errors.add(index, kind, name, "metadata.name", "is required")
            continue
        if (kind, name) in seen:
            errors.add(index, kind, name, "metadata.name", f"duplicate {kind} {excerpt(name)} in this manifest")
            continue
        seen.add((kind, name))
        if not isinstance(doc.get("spec"), Mapping):
            errors.add(index, kind, name, "spec", "is required and must be a mapping")
            continue
        for path in unknown_fields(doc, SCHEMAS[kind]):
            errors.add(index, kind, name, path, "unknown field")
        reader = Reader(doc, index, kind, name, errors)
        if kind == "TokenPool":
            if not is_superuser:
                errors.add(index, kind, name, "", "only platform operators (superusers) may manage pools", True)
                continue
            values, replicas = read_pool(reader)
            plans[kind].append(Plan(index, kind, name, values, replicas, TokenPool.objects.filter(name=name).first()))
        elif kind == "Tenant":
            plans[kind].append(Plan(index, kind, name, read_tenant(reader)))
        else:
            plans[kind].append(Plan(index, kind, name, read_entitlement(reader)))
    return plans


def _validate_pools(pools: list[Plan], errors: Collector) -> None:
    for plan in pools:
        # Validate on a detached copy: the real row changes only when writing.
        candidate = TokenPool.objects.get(pk=plan.existing.pk) if plan.existing is not None else TokenPool(name=plan.name)
        for key, value in plan.values.items():
            setattr(candidate, key, value)
        try:
            _check_pool(candidate, plan.replicas)
        except ValidationError as exc:
            for path, message in model_errors(exc, POOL_PATHS):
                errors.add(plan.index, plan.kind, plan.name, path, message)


def _validate_entitlements(entitlements: list[Plan], tenants: list[Plan], pools: list[Plan], actor: Any,
                           errors: Collector) -> None:
    pool_names_in_file = {p.name for p in pools}
    visible_tenants: dict[str, Tenant] = {t.slug: t for t in tenant_list(user=actor)}
    declared = {plan.name: plan for plan in tenants}
    # Looked up once for the whole manifest (thousands of entitlements): the stored ones (locked), the pools,
    # the actor's role per tenant.
    existing_of = existing_by_name(plan.name for plan in entitlements)
    stored_pools: dict[str, TokenPool] = {}
    for chunk in in_chunks({plan.values["pool_name"] for plan in entitlements}):
        stored_pools.update({p.name: p for p in TokenPool.objects.filter(name__in=chunk)})
    roles: dict[int, str | None] = {}
    for plan in entitlements:
        v = plan.values
        slug = v["tenant_slug"]
        tenant = visible_tenants.get(slug)
        if tenant is None and slug in declared:  # created by this manifest (a superuser's: validated above)
            tenant = Tenant(slug=slug, name=declared[slug].values["name"])
        if tenant is None:
            errors.add(plan.index, plan.kind, plan.name, "spec.tenantId", f"unknown tenant {excerpt(slug)}")
            continue
        if tenant.pk is not None and tenant.pk not in roles:
            roles[tenant.pk] = user_role(user=actor, tenant=tenant)
        if tenant.pk is not None and roles[tenant.pk] != "owner":
            errors.add(plan.index, plan.kind, plan.name, "", f"only owners of tenant {tenant.slug!r} may manage its "
                       "entitlements", True)
            continue
        existing = existing_of.get(plan.name)
        if existing is not None and existing.tenant.slug != slug:
            errors.add(plan.index, plan.kind, plan.name, "metadata.name",
                       ENTITLEMENT_NAME_TAKEN)
            continue
        pool = stored_pools.get(v["pool_name"])
        if pool is None and v["pool_name"] not in pool_names_in_file:
            errors.add(plan.index, plan.kind, plan.name, "spec.poolRef.name", f"unknown pool {excerpt(v['pool_name'])}")
            continue
        plan.existing = existing
        plan.values = {"tenant_slug": slug, "pool_name": v["pool_name"],
                       **{k: val for k, val in v.items() if k not in ("tenant_slug", "pool_name")}}
        fields = {k: val for k, val in plan.values.items() if k not in ("tenant_slug", "pool_name")}
        candidate = TokenEntitlement(name=plan.name, tenant=tenant, pool=pool or TokenPool(name=v["pool_name"]),
                                     **fields)
        # The tenant and the pool were just loaded (or are declared by this manifest), and whether the name is
        # taken is `existing`: full_clean need not query for them.
        exclude = ["state", "state_reason", "state_changed_at", "pool", "tenant"]
        try:
            candidate.full_clean(exclude=exclude, validate_unique=False)
        except ValidationError as exc:
            for path, message in model_errors(exc, ENTITLEMENT_PATHS):
                errors.add(plan.index, plan.kind, plan.name, path, message)


def _check_money_quotas(tenants: list[Plan], pools: list[Plan], entitlements: list[Plan], errors: Collector) -> None:
    """Money quotas are priced at the pools' prices: each must meet pools priced in its currency, with the
    manifest's tenants, pools and entitlements as they will be once applied."""

    pools_as_applied: dict[str, TokenPool | None] = {}
    tenants_as_applied: dict[str, Any] = {}

    def pool_as_applied(name: str) -> TokenPool | None:
        if name not in pools_as_applied:
            plan = next((p for p in pools if p.name == name), None)
            pools_as_applied[name] = TokenPool.objects.filter(name=name).first() if plan is None else TokenPool(
                name=name, **{k: v for k, v in plan.values.items() if k.startswith("price_")})
        return pools_as_applied[name]

    def tenant_as_applied(slug: str) -> Any:
        if slug not in tenants_as_applied:
            plan = next((p for p in tenants if p.name == slug), None)
            tenants_as_applied[slug] = Tenant.objects.filter(slug=slug).first() if plan is None else Tenant(
                slug=slug, **{k: v for k, v in plan.values.items() if k.startswith("quota_")})
        return tenants_as_applied[slug]

    in_file = {plan.name for plan in entitlements}
    checks: list[tuple[Plan, Any, str, str, str]] = []  # (plan, owner, pool name, field, what)
    for plan in entitlements:
        if plan.values.get("quota_amount") is not None:  # else no money quota: nothing to price
            owner = TokenEntitlement(**{k: v for k, v in plan.values.items() if k.startswith("quota_")})
            checks.append((plan, owner, plan.values["pool_name"], "spec.quota", "this entitlement"))
        tenant = tenant_as_applied(plan.values["tenant_slug"])
        if tenant is not None:
            checks.append((plan, tenant, plan.values["pool_name"], "spec.poolRef.name",
                           f"its tenant {tenant.slug!r}"))
    for plan in tenants:
        tenant = tenant_as_applied(plan.name)
        if not tenant.quota_is_money:  # its entitlements need not be read: no price to check
            continue
        for ent in TokenEntitlement.objects.filter(tenant__slug=plan.name).select_related("pool"):
            if ent.name not in in_file:
                checks.append((plan, tenant, ent.pool.name, "spec.quota", f"tenant {plan.name!r} (entitlement "
                               f"{ent.name!r})"))
    for plan, owner, pool_name, field, what in checks:
        pool = pool_as_applied(pool_name)
        problem = None if pool is None else money_quota_problem(owner, pool, what)
        if problem:
            errors.add(plan.index, plan.kind, plan.name, field, problem)


def _validate(documents: list[Any], actor: Any) -> dict[str, list[Plan]]:
    errors = Collector()
    plans = _read_documents(documents, actor, errors)
    if errors.issues:
        raise ManifestError(errors.issues, errors.forbidden)
    validate_tenants(plans["Tenant"], actor, errors)
    _validate_pools(plans["TokenPool"], errors)
    _validate_entitlements(plans["TokenEntitlement"], plans["Tenant"], plans["TokenPool"], actor, errors)
    if not errors.issues:
        _check_money_quotas(plans["Tenant"], plans["TokenPool"], plans["TokenEntitlement"], errors)
    if errors.issues:
        raise ManifestError(errors.issues, errors.forbidden)
    return plans


def _apply_pool(plan: Plan, actor: Any, now: dt.datetime) -> tuple[str, tuple[str, ...]]:
    if plan.existing is None:
        pool_create(actor=actor, name=plan.name, replicas=plan.replicas or [], now=now, **plan.values)
        return "created", ()
    values, replicas = _pool_values_of(plan.existing)
    fields = changed_paths(values, plan.values, POOL_PATHS)
    fields += ("spec.backend.replicas",) if replicas != plan.replicas else ()
    if not fields:
        return "unchanged", ()
    pool_update(actor=actor, pool=plan.existing, replicas=plan.replicas, now=now, **plan.values)
    return "updated", fields


def _warnings(plans: dict[str, list[Plan]]) -> list[EntitlementWarning]:
    """Entitlements left Pending or Degraded: the manifest's own, and those of its pools (a pool it shrank
    degrades entitlements the manifest does not name)."""
    names = {p.name for p in plans["TokenEntitlement"]}
    pools = {p.name for p in plans["TokenPool"]}
    # By pool, not by a list of thousands of names: the manifest's entitlements are in their documents' pools.
    in_pools = pools | {p.values["pool_name"] for p in plans["TokenEntitlement"]}
    troubled = (TokenEntitlement.objects.filter(state__in=(EntitlementState.PENDING, EntitlementState.DEGRADED))
                .filter(pool__name__in=in_pools).select_related("pool").order_by("name"))
    return [EntitlementWarning(e.name, e.state, e.state_reason) for e in troubled
            if e.name in names or e.pool.name in pools]


@contextlib.contextmanager
def dry_runnable(dry_run: bool) -> Iterator[None]:
    """One transaction for the writes; a dry run's is rolled back at its end, its on-commit hooks (the gateway's
    snapshot reload) with it: the very writes, undone, so that what it reports is what doing it would do."""
    with transaction.atomic():
        yield
        if dry_run:
            transaction.set_rollback(True)


def manifests_apply(*, actor: Any, documents: list[Any] | str, now: dt.datetime | None = None,
                    dry_run: bool = False, compare: bool = False) -> ApplyResult:
    """Validate all documents, then write them in one transaction; raises ManifestError with nothing written.

    ``documents`` is YAML text or already-parsed documents. Tenants and pools need a superuser (an owner may
    change their tenant's members); entitlements an owner of the tenant named by ``tenantId`` (an unknown
    or invisible tenant is reported as unknown). ``dry_run`` runs the very same writes and rolls them back
    (with their history rows, and the on-commit hooks such as the gateway's snapshot reload), so what it
    reports is what applying would do. ``compare`` (a dry run) also exports every object the manifest names
    before and after those writes (``result.diffs``: ``manage.py diff``).
    """
    if isinstance(documents, str):
        documents = manifests_parse(documents)
    if not isinstance(documents, list):
        raise ManifestError([ManifestIssue(None, "", "", "", "expected a list of documents")])
    if not documents:  # as for YAML text with no document in it: applying nothing is a mistake, not a success
        raise ManifestError([ManifestIssue(None, "", "", "", "no documents found")])
    problem = structure_problem(documents)  # documents given as data (JSON) meet the bounds YAML's loader sets
    if problem is not None:
        raise ManifestError([ManifestIssue(problem[0], "", "", "", problem[1])])
    now = now or timezone.now()
    dry_run = dry_run or compare
    result = ApplyResult(dry_run=dry_run)
    try:
        with dry_runnable(dry_run):
            plans = _validate(documents, actor)
            # The entitlements as validation loaded them (tenant and pool with them), not read a second time.
            loaded = {("TokenEntitlement", p.name): None if p.existing is None else entitlement_to_manifest(p.existing)
                      for p in plans["TokenEntitlement"]} if compare else {}
            before = stored_manifests(plans, loaded) if compare else {}
            actions: dict[int, AppliedDocument] = {}
            for kind, write in (("Tenant", lambda p: apply_tenant(p, actor)),
                                ("TokenPool", lambda p: _apply_pool(p, actor, now))):
                for plan in plans[kind]:
                    action, fields = write(plan)
                    actions[plan.index] = AppliedDocument(plan.index, plan.kind, plan.name, action, fields)
            writer = EntitlementWriter(actor, now, plans["TokenEntitlement"])  # after the tenants and pools
            for plan in plans["TokenEntitlement"]:
                action, fields = writer.write(plan)
                actions[plan.index] = AppliedDocument(plan.index, plan.kind, plan.name, action, fields)
            writer.finish()
            result.documents = [actions[i] for i in sorted(actions)]
            result.warnings = _warnings(plans)
            if compare:
                # An entitlement reported unchanged was not written (its binding's state is not in the manifest).
                same = {("TokenEntitlement", d.name): before[("TokenEntitlement", d.name)] for d in result.documents
                        if d.kind == "TokenEntitlement" and d.action == "unchanged"}
                result.diffs = object_diffs(before, stored_manifests(plans, same))
    except ValidationError as exc:  # a concurrent writer changed something between validation and write
        raise ManifestError([ManifestIssue(None, "", "", f, m) for f, m in model_errors(exc, {})]) from exc
    except PermissionDenied as exc:
        raise ManifestError([ManifestIssue(None, "", "", "", str(exc))], forbidden=True) from exc
    return result
