"""Binding through `apply`: which entitlements a manifest leaves Bound, Degraded or oversubscribed, with the
reasons and the state history, exactly as writing them one by one through the services does (the apply
writes in bulk and binds each pool once per write, in memory, so these pin the sequence's outcome)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db.models.signals import post_save

from apps.pools.manifests import manifests_apply
from apps.pools.models import EntitlementStateChange, TokenEntitlement
from apps.tenancy.services import SYSTEM

HEAD = """
apiVersion: tokenpools.io/v1alpha1
kind: Tenant
metadata: {name: t}
spec: {displayName: T}
---
apiVersion: tokenpools.io/v1alpha1
kind: TokenPool
metadata: {name: p}
spec:
  model: m/m
  backend: {kind: vllm, replicas: [{url: 'http://127.0.0.1:9', enabled: true}]}
  scaling: {minReplicas: 1, maxReplicas: 1}
  capacityPerReplica: {slots: SLOTS, tokensPerSecond: 1000, kvCacheGiB: 1}
  kvGeometry: {layers: 4, kvHeads: 4, headDim: 64, bytesPerElement: 2}
"""


def ent(name: str, cls: str, concurrency: int, slo: int = 500) -> str:
    return f"""---
apiVersion: tokenpools.io/v1alpha1
kind: TokenEntitlement
metadata: {{name: {name}}}
spec:
  tenantId: t
  poolRef: {{name: p}}
  qos: {{serviceClass: {cls}, sloTargetMs: {slo}}}
  resources: {{tokensPerSecond: 10, kvCacheGiB: 0.01, concurrency: {concurrency}}}
"""


def _apply(slots: int, *docs: str) -> Any:
    return manifests_apply(actor=SYSTEM, documents=HEAD.replace("SLOTS", str(slots)) + "".join(docs))


def _states() -> list[tuple[str, str, str]]:
    return list(TokenEntitlement.objects.order_by("name").values_list("name", "state", "state_reason"))


def _history() -> list[tuple[str, str, str, str]]:
    return list(EntitlementStateChange.objects.order_by("id").values_list(
        "entitlement__name", "from_state", "to_state", "reason"))


# Recorded from the one-by-one writes (entitlement_create / entitlement_update per document) before the apply
# wrote in bulk: the same states, reasons and history rows, in the same order.
FIRST_HISTORY = [('a', '', 'Pending', 'created'),
 ('a', 'Pending', 'Bound', 'reserved baseline fits pool p'),
 ('b', '', 'Pending', 'created'),
 ('b', 'Pending', 'Bound', 'time-averaged reservation fits pool p'),
 ('c', '', 'Pending', 'created'),
 ('c', 'Pending', 'Bound', 'spot reserves no capacity; bound to pool p'),
 ('d', '', 'Pending', 'created'),
 ('d', 'Pending', 'Degraded', 'baseline does not fit pool p: concurrency 2 > 1 free slots'),
 ('e', '', 'Pending', 'created'),
 ('e', 'Pending', 'Bound', 'reserved baseline fits pool p')]
SECOND_DOCS = [('t', 'unchanged', ()),
 ('p', 'unchanged', ()),
 ('f', 'created', ()),
 ('a', 'updated', ('spec.resources.concurrency',)),
 ('c', 'updated', ('spec.qos.sloTargetMs',)),
 ('b', 'updated', ('spec.resources.concurrency',)),
 ('d', 'unchanged', ()),
 ('e', 'unchanged', ())]
FIRST_STATES = [('a', 'Bound', 'reserved baseline fits pool p'),
 ('b', 'Bound', 'time-averaged reservation fits pool p'),
 ('c', 'Bound', 'spot reserves no capacity; bound to pool p'),
 ('d', 'Degraded', 'baseline does not fit pool p: concurrency 2 > 1 free slots'),
 ('e', 'Bound', 'reserved baseline fits pool p')]
SECOND_STATES = [('a', 'Bound', 'reserved baseline fits pool p (entitlement b updated)'),
 ('b', 'Bound', 'time-averaged reservation fits pool p (entitlement b updated)'),
 ('c', 'Bound', 'spot reserves no capacity; bound to pool p (entitlement b updated)'),
 ('d', 'Degraded', 'baseline does not fit pool p: concurrency 2 > 1 free slots (entitlement b updated)'),
 ('e', 'Bound', 'reserved baseline fits pool p (entitlement b updated)'),
 ('f', 'Degraded', 'baseline does not fit pool p: concurrency 1 > 0 free slots (entitlement b updated)')]
SECOND_NEW_HISTORY = [('f', '', 'Pending', 'created'),
 ('f', 'Pending', 'Degraded', 'baseline does not fit pool p: concurrency 1 > 0 free slots'),
 ('d', 'Degraded', 'Bound', 'reserved baseline fits pool p (entitlement a updated)'),
 ('e', 'Bound', 'Degraded', 'baseline does not fit pool p: concurrency 1 > 0 free slots (entitlement a updated)'),
 ('d', 'Bound', 'Degraded', 'baseline does not fit pool p: concurrency 2 > 1 free slots (entitlement b updated)'),
 ('e', 'Degraded', 'Bound', 'reserved baseline fits pool p (entitlement b updated)')]
THIRD_STATES = [('a', 'Bound', 'reserved baseline fits pool p'),
 ('b', 'Bound', 'time-averaged reservation fits pool p'),
 ('c', 'Bound', 'spot reserves no capacity; bound to pool p'),
 ('d', 'Bound', 'reserved baseline fits pool p'),
 ('e', 'Bound', 'reserved baseline fits pool p'),
 ('f', 'Degraded', 'baseline does not fit pool p: concurrency 1 > 0 free slots'),
 ('g', 'Degraded', 'baseline does not fit pool p: concurrency 1 > 0 free slots')]
THIRD_NEW_HISTORY = [('d', 'Degraded', 'Bound', 'reserved baseline fits pool p (pool updated)'),
 ('g', '', 'Pending', 'created'),
 ('g', 'Pending', 'Degraded', 'baseline does not fit pool p: concurrency 1 > 0 free slots')]


@pytest.mark.django_db
def test_apply_binds_degrades_and_records_history_as_the_one_by_one_writes_did() -> None:
    first = _apply(4, ent("a", "guaranteed", 2), ent("b", "elastic", 1), ent("c", "spot", 1),
                   ent("d", "guaranteed", 2), ent("e", "guaranteed", 1))
    assert _states() == FIRST_STATES
    assert _history() == FIRST_HISTORY
    assert [(w.name, w.state, w.reason) for w in first.warnings] == [s for s in FIRST_STATES if s[0] == "d"]
    # a shrinks (d binds, then e, newer, no longer fits), then b grows (d degrades again, e binds back): the
    # history keeps each step, and every reason ends with the pool's last trigger.
    second = _apply(4, ent("f", "elastic", 1), ent("a", "guaranteed", 1), ent("c", "spot", 1, slo=900),
                    ent("b", "elastic", 2), ent("d", "guaranteed", 2), ent("e", "guaranteed", 1))
    assert [(d.name, d.action, d.fields) for d in second.documents] == SECOND_DOCS
    assert _states() == SECOND_STATES
    assert _history() == FIRST_HISTORY + SECOND_NEW_HISTORY
    assert [(w.name, w.state, w.reason) for w in second.warnings] == [s for s in SECOND_STATES if s[1] == "Degraded"]
    # The pool grows (d binds on the pool's update); e's edit, then g's creation: the last write (a creation,
    # no trigger) leaves every reason without a suffix.
    third = _apply(6, ent("f", "elastic", 1), ent("a", "guaranteed", 1), ent("c", "spot", 1, slo=900),
                   ent("b", "elastic", 2), ent("d", "guaranteed", 2), ent("e", "guaranteed", 1, slo=700),
                   ent("g", "guaranteed", 1))
    assert _states() == THIRD_STATES
    assert _history() == FIRST_HISTORY + SECOND_NEW_HISTORY + THIRD_NEW_HISTORY
    assert [(w.name, w.state, w.reason) for w in third.warnings] == [s for s in THIRD_STATES if s[1] == "Degraded"]


@pytest.mark.django_db
def test_a_state_written_in_bulk_still_sends_post_save_for_that_entitlement() -> None:
    _apply(4, ent("a", "guaranteed", 2), ent("b", "guaranteed", 2))
    seen: list[tuple[str, str, frozenset[str] | None]] = []

    def receiver(sender: Any, instance: TokenEntitlement, update_fields: Any = None, **_: Any) -> None:
        seen.append((instance.name, instance.state, update_fields))

    post_save.connect(receiver, sender=TokenEntitlement, dispatch_uid="test-bulk-state")
    try:
        _apply(3, ent("a", "guaranteed", 2), ent("b", "guaranteed", 2))  # the pool shrinks: b no longer fits
    finally:
        post_save.disconnect(dispatch_uid="test-bulk-state", sender=TokenEntitlement)
    # Each entitlement whose state or reason changed (a's reason now names the pool's update), as each one's
    # own save() sent it.
    fields = frozenset({"state", "state_reason", "state_changed_at"})
    assert seen == [("a", "Bound", fields), ("b", "Degraded", fields)]
    assert TokenEntitlement.objects.get(name="b").state == "Degraded"
