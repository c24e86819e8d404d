"""What applying a manifest would change, object by object, as `kubectl diff` shows it: each object the
manifest names, exported as stored now and as it would be stored after the apply (both through the export
functions, so defaults and field names match and only real changes show), as a unified diff.

`manifests_apply(..., compare=True)` takes the two pictures inside its dry run: the very writes an apply would
make, rolled back.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from apps.pools.manifests.export import entitlement_to_manifest, pool_to_manifest
from apps.pools.manifests.tenants import tenant_to_manifest
from apps.pools.models import TokenEntitlement, TokenPool
from apps.tenancy.models import Tenant

KINDS = ("Tenant", "TokenPool", "TokenEntitlement")


@dataclass(frozen=True, slots=True)
class ObjectDiff:
    kind: str
    name: str
    stored: str  # the object as stored, as a manifest ('' when it does not exist)
    applied: str  # as it would be after the apply

    @property
    def changed(self) -> bool:
        return self.stored != self.applied

    def unified(self) -> str:
        return "".join(difflib.unified_diff(
            self.stored.splitlines(keepends=True), self.applied.splitlines(keepends=True),
            fromfile=f"{self.kind}/{self.name} (stored)", tofile=f"{self.kind}/{self.name} (manifest)"))


def _stored(kind: str, name: str) -> str:
    obj: Any
    if kind == "Tenant":
        obj = Tenant.objects.filter(slug=name).first()
        doc = None if obj is None else tenant_to_manifest(obj)
    elif kind == "TokenPool":
        obj = TokenPool.objects.filter(name=name).first()
        doc = None if obj is None else pool_to_manifest(obj)
    else:
        obj = TokenEntitlement.objects.select_related("tenant", "pool").filter(name=name).first()
        doc = None if obj is None else entitlement_to_manifest(obj)
    return "" if doc is None else yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def stored_manifests(plans: Mapping[str, Sequence[Any]]) -> dict[tuple[str, str], str]:
    """Every object the plans name, exported as it is stored now (kind by kind, in document order)."""
    return {(kind, plan.name): _stored(kind, plan.name) for kind in KINDS for plan in plans.get(kind, ())}


def object_diffs(before: Mapping[tuple[str, str], str], after: Mapping[tuple[str, str], str]) -> list[ObjectDiff]:
    return [ObjectDiff(kind, name, text, after.get((kind, name), "")) for (kind, name), text in before.items()]
