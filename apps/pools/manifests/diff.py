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
from functools import cached_property
from typing import Any

import yaml

from apps.pools.manifests.entitlements import in_chunks
from apps.pools.manifests.export import entitlement_to_manifest, pool_to_manifest
from apps.pools.manifests.tenants import tenant_to_manifest
from apps.pools.models import TokenEntitlement, TokenPool
from apps.tenancy.models import Tenant

KINDS = ("Tenant", "TokenPool", "TokenEntitlement")


Doc = dict[str, Any] | None  # an object as a manifest document; None when it does not exist


@dataclass(frozen=True)
class ObjectDiff:
    kind: str
    name: str
    before: Doc  # the object as stored
    after: Doc  # as it would be after the apply

    @cached_property
    def stored(self) -> str:
        """The object as stored, as manifest text ('' when it does not exist)."""
        return _dump(self.before)

    @cached_property
    def applied(self) -> str:
        return _dump(self.after)

    @property
    def changed(self) -> bool:
        # Whether the texts differ; the same repr (types and key order included) is the same text, so the YAML
        # is written only for the objects that change (a diff of thousands of unchanged ones writes none).
        return repr(self.before) != repr(self.after) and self.stored != self.applied

    def unified(self) -> str:
        return "".join(difflib.unified_diff(
            self.stored.splitlines(keepends=True), self.applied.splitlines(keepends=True),
            fromfile=f"{self.kind}/{self.name} (stored)", tofile=f"{self.kind}/{self.name} (manifest)"))


# libyaml's emitter when PyYAML has it (the same text as the pure-Python one, faster).
_DUMPER: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _dump(doc: Doc) -> str:
    return "" if doc is None else yaml.dump(doc, Dumper=_DUMPER, sort_keys=False, default_flow_style=False)


def _stored_of_kind(kind: str, names: list[str]) -> dict[str, Doc]:
    """The objects of one kind with these names, each exported as stored (one query per chunk of names)."""
    docs: dict[str, dict[str, Any]] = {}
    for chunk in in_chunks(names):
        if kind == "Tenant":
            docs.update({t.slug: tenant_to_manifest(t) for t in Tenant.objects.filter(slug__in=chunk)})
        elif kind == "TokenPool":
            docs.update({p.name: pool_to_manifest(p) for p in TokenPool.objects.filter(name__in=chunk)})
        else:
            query = TokenEntitlement.objects.select_related("tenant", "pool").filter(name__in=chunk)
            docs.update({e.name: entitlement_to_manifest(e) for e in query})
    return {name: docs.get(name) for name in names}


def stored_manifests(plans: Mapping[str, Sequence[Any]],
                     known: Mapping[tuple[str, str], Doc] | None = None) -> dict[tuple[str, str], Doc]:
    """Every object the plans name, exported as it is stored now (kind by kind, in document order); those in
    ``known`` (exported from rows already loaded, or unchanged since) are not read again."""
    known = known or {}
    out: dict[tuple[str, str], Doc] = {}
    for kind in KINDS:
        names = [plan.name for plan in plans.get(kind, ())]
        read = _stored_of_kind(kind, [name for name in names if (kind, name) not in known])
        out.update({(kind, name): known[(kind, name)] if (kind, name) in known else read[name] for name in names})
    return out


def object_diffs(before: Mapping[tuple[str, str], Doc], after: Mapping[tuple[str, str], Doc]) -> list[ObjectDiff]:
    return [ObjectDiff(kind, name, doc, after.get((kind, name))) for (kind, name), doc in before.items()]
