"""`delete -f` and `apply --prune`: remove the objects a manifest names, or a tenant's entitlements it no longer
names, through the same services as the REST API's deletes (so keys go with their entitlement and pools rebind,
letting Degraded entitlements bind in the room freed).

Deletion runs entitlements first, then pools, then tenants, in one transaction: a refusal or a failure deletes
nothing. A pool or tenant still used by entitlements the manifest does not name is refused, naming them, unless
``cascade`` (then those are deleted first, and reported). Objects that do not exist, or that the actor may not see,
are reported as not found (as the REST API answers 404). ``dry_run`` makes the very same deletes and rolls them
back (with the on-commit hooks such as the gateway's snapshot reload).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Model

from apps.audit.context import through
from apps.pools.manifests.apply import dry_runnable, manifests_apply
from apps.pools.manifests.limits import excerpt
from apps.pools.manifests.reader import (
    API_VERSION,
    KINDS,
    ApplyResult,
    Collector,
    EntitlementWarning,
    ManifestError,
    ManifestIssue,
    model_errors,
)
from apps.pools.models import EntitlementState, TokenEntitlement
from apps.pools.selectors import entitlement_list, pool_list
from apps.pools.services import entitlement_delete, pool_delete, tenant_delete
from apps.tenancy.actors import AnyUser
from apps.tenancy.models import Tenant
from apps.tenancy.selectors import tenant_list


@dataclass(frozen=True)
class Deleted:
    kind: str
    name: str
    reason: str = ""  # "" when the manifest names it; "cascade" or "pruned" otherwise

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "reason": self.reason}


@dataclass
class DeleteResult:
    deleted: list[Deleted] = field(default_factory=list)
    not_found: list[tuple[str, str]] = field(default_factory=list)  # (kind, name) in document order
    dry_run: bool = False


def _identities(documents: list[Any]) -> list[tuple[int, str, str]]:
    """(index, kind, name) of every document; only what names an object is checked (kubectl delete -f too)."""
    errors = Collector()
    found: list[tuple[int, str, str]] = []
    seen: set[tuple[str, str]] = set()
    for index, doc in enumerate(documents):
        if not isinstance(doc, Mapping):
            errors.add(index, "", "", "", "a document must be a mapping")
            continue
        kind = doc["kind"] if isinstance(doc.get("kind"), str) else ""
        metadata = doc.get("metadata")
        name = metadata["name"] if isinstance(metadata, Mapping) and isinstance(metadata.get("name"), str) else ""
        if doc.get("apiVersion") != API_VERSION:
            errors.add(index, kind, name, "apiVersion", f"must be {API_VERSION!r}, got {excerpt(doc.get('apiVersion'))}")
        elif kind not in KINDS:
            errors.add(index, kind, name, "kind", f"must be one of {', '.join(KINDS)}, got {excerpt(doc.get('kind'))}")
        elif not name:
            errors.add(index, kind, name, "metadata.name", "is required")
        elif (kind, name) not in seen:
            seen.add((kind, name))
            found.append((index, kind, name))
    if errors.issues:
        raise ManifestError(errors.issues, errors.forbidden)
    return found


def _lookup(actor: AnyUser, kind: str, name: str) -> Model | None:
    """The object, if it exists and the actor may see it (others' tenants and entitlements are not found)."""
    if kind == "Tenant":
        return tenant_list(user=actor).filter(slug=name).first()
    if kind == "TokenPool":
        return pool_list(user=actor).filter(name=name).first()
    return entitlement_list(user=actor).filter(name=name).first()


def _name(obj: Model) -> str:
    return str(obj.slug if isinstance(obj, Tenant) else obj.name)  # type: ignore[attr-defined]


def _outside(qs: Any, named: set[str]) -> list[TokenEntitlement]:
    return [ent for ent in qs.order_by("name") if ent.name not in named]


def _dependents(targets: dict[str, list[tuple[int, Model]]]) -> dict[int, tuple[str, str, list[TokenEntitlement]]]:
    """Per document index: the entitlements outside the manifest that still use the pool or tenant it names."""
    named = {obj.name for _i, obj in targets["TokenEntitlement"]}  # type: ignore[attr-defined]
    found: dict[int, tuple[str, str, list[TokenEntitlement]]] = {}
    for kind in ("TokenPool", "Tenant"):
        for index, obj in targets[kind]:
            users = _outside(obj.entitlements.select_related("tenant"), named)  # type: ignore[attr-defined]
            if users:
                found[index] = (kind, _name(obj), users)
    return found


def _refusal(dependents: dict[int, tuple[str, str, list[TokenEntitlement]]], what: str) -> ManifestError:
    issues = []
    for index, (kind, name, users) in sorted(dependents.items()):
        listed = ", ".join(f"TokenEntitlement/{ent.name}" for ent in users[:20])
        more = f" and {len(users) - 20} more" if len(users) > 20 else ""
        issues.append(ManifestIssue(index, kind, name, "", f"still used by {listed}{more}, which {what}"))
    return ManifestError(issues)


def _delete(actor: AnyUser, kind: str, obj: Model) -> None:
    if kind == "TokenEntitlement":
        entitlement_delete(actor=actor, entitlement=obj)  # type: ignore[arg-type]
    elif kind == "TokenPool":
        pool_delete(actor=actor, pool=obj)  # type: ignore[arg-type]
    else:
        tenant_delete(actor=actor, tenant=obj)  # type: ignore[arg-type]


def _run_deletes(actor: AnyUser, steps: list[tuple[int | None, str, Model, str]]) -> list[Deleted]:
    """Delete each object in turn; a service's refusal is raised as a ManifestError naming the document."""
    done: list[Deleted] = []
    for index, kind, obj, reason in steps:
        name = _name(obj)
        try:
            _delete(actor, kind, obj)
        except PermissionDenied as exc:
            raise ManifestError([ManifestIssue(index, kind, name, "", str(exc))], forbidden=True) from exc
        except ValidationError as exc:
            raise ManifestError([ManifestIssue(index, kind, name, f, m) for f, m in model_errors(exc, {})]) from exc
        done.append(Deleted(kind, name, reason))
    return done


def manifests_delete(*, actor: AnyUser, documents: list[Any], cascade: bool = False,
                     dry_run: bool = False) -> DeleteResult:
    """Delete the objects the documents name, all or nothing; raises ManifestError with nothing deleted."""
    if not documents:
        raise ManifestError([ManifestIssue(None, "", "", "", "no documents found")])
    result = DeleteResult(dry_run=dry_run)
    with dry_runnable(dry_run):
        targets: dict[str, list[tuple[int, Model]]] = {kind: [] for kind in KINDS}
        for index, kind, name in _identities(documents):
            obj = _lookup(actor, kind, name)
            if obj is None:
                result.not_found.append((kind, name))
            else:
                targets[kind].append((index, obj))
        dependents = _dependents(targets)
        if dependents and not cascade:
            raise _refusal(dependents, "the files do not name (--cascade deletes them too)")
        steps: list[tuple[int | None, str, Model, str]] = []
        extra = {ent.pk: ent for _k, _n, users in dependents.values() for ent in users}
        steps += [(None, "TokenEntitlement", ent, "cascade") for ent in extra.values()]
        for kind in ("TokenEntitlement", "TokenPool", "Tenant"):
            steps += [(index, kind, obj, "") for index, obj in targets[kind]]
        result.deleted = _run_deletes(actor, steps)
    return result


def _prune(actor: AnyUser, tenant_slug: str, keep: set[str]) -> list[Deleted]:
    """Delete the tenant's entitlements not in ``keep`` (in the caller's transaction)."""
    tenant = tenant_list(user=actor).filter(slug=tenant_slug).first()
    if tenant is None:  # a tenant the manifest declares, in a dry run (not created): it has no entitlements
        return []
    stale = _outside(TokenEntitlement.objects.filter(tenant=tenant).select_related("tenant"), keep)
    with through("prune"):  # the audit log tells pruned objects from deleted ones
        return _run_deletes(actor, [(None, "TokenEntitlement", ent, "pruned") for ent in stale])


def _declares_tenant(documents: list[Any], slug: str) -> bool:
    return any(isinstance(d, Mapping) and d.get("kind") == "Tenant" and isinstance(d.get("metadata"), Mapping)
               and d["metadata"].get("name") == slug for d in documents)


def _still_troubled(warnings: list[EntitlementWarning]) -> list[EntitlementWarning]:
    """The warnings as they stand after pruning: its freed room may have bound some, and it deletes others."""
    names = [w.name for w in warnings]
    now = {e.name: e for e in TokenEntitlement.objects.filter(
        name__in=names, state__in=(EntitlementState.PENDING, EntitlementState.DEGRADED))}
    return [EntitlementWarning(n, now[n].state, now[n].state_reason) for n in names if n in now]


def manifests_apply_prune(*, actor: AnyUser, documents: list[Any], tenant_slug: str,
                          dry_run: bool = False) -> tuple[ApplyResult, list[Deleted]]:
    """Apply the documents, then delete the tenant's entitlements they do not name (``kubectl apply --prune``
    with a selector), all in one transaction; ``dry_run`` does all of it and rolls it back."""
    if not tenant_list(user=actor).filter(slug=tenant_slug).exists() and not _declares_tenant(documents, tenant_slug):
        raise ManifestError([ManifestIssue(None, "", "", "--tenant", f"unknown tenant {excerpt(tenant_slug)}")])
    with dry_runnable(dry_run):
        result = manifests_apply(actor=actor, documents=documents)
        keep = {doc.name for doc in result.documents if doc.kind == "TokenEntitlement"}
        pruned = _prune(actor, tenant_slug, keep)
        result.warnings = _still_troubled(result.warnings)
        result.dry_run = dry_run
    return result, pruned


__all__ = ["DeleteResult", "Deleted", "manifests_apply_prune", "manifests_delete", "tenant_delete"]
