"""An entitlement's own queue in manifests (issue 23): `spec.qos.queue: {max, maxWaitMs}`, the old
`spec.limits.queueMax` read as `max`, export in the new form, diffs and dry runs naming the fields, and bad
values refused with the document and field named."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command

from apps.pools.manifests import ManifestError, manifests_apply, manifests_export
from apps.pools.models import TokenEntitlement
from apps.tenancy.services import SYSTEM
from tests.pools.test_manifests import _docs

pytestmark = pytest.mark.django_db


def _with_queue(queue: Any = None, limits: Any = None) -> list[Any]:
    docs = _docs("qwen3-8b.yaml")
    if queue is not None:
        docs[1]["spec"]["qos"]["queue"] = queue
    if limits is not None:
        docs[1]["spec"]["limits"] = limits
    return docs


def _exported_spec() -> dict[str, Any]:
    docs = yaml.safe_load_all(manifests_export(user=SYSTEM))
    return next(d for d in docs if d["kind"] == "TokenEntitlement")["spec"]


def test_queue_is_stored_exported_and_reapplies_unchanged(acme: Any) -> None:
    docs = _with_queue({"max": 2, "maxWaitMs": 500})
    manifests_apply(actor=SYSTEM, documents=docs)
    ent = TokenEntitlement.objects.get()
    assert (ent.queue_max, ent.queue_max_wait_ms) == (2, 500)
    spec = _exported_spec()
    assert spec["qos"]["queue"] == {"max": 2, "maxWaitMs": 500} and "limits" not in spec
    assert manifests_apply(actor=SYSTEM, documents=docs).summary()["unchanged"] == 2


def test_zero_is_a_queue_of_none_and_absent_is_the_class_default(acme: Any) -> None:
    manifests_apply(actor=SYSTEM, documents=_with_queue({"max": 0, "maxWaitMs": 0}))
    ent = TokenEntitlement.objects.get()
    assert (ent.queue_max, ent.queue_max_wait_ms) == (0, 0)
    assert _exported_spec()["qos"]["queue"] == {"max": 0, "maxWaitMs": 0}  # 0 is a value, not "unset"
    # Dropping the queue from the manifest goes back to the class default (null), and exports no queue key.
    result = manifests_apply(actor=SYSTEM, documents=_with_queue())
    assert result.documents[1].fields == ("spec.qos.queue.max", "spec.qos.queue.maxWaitMs")
    ent.refresh_from_db()
    assert (ent.queue_max, ent.queue_max_wait_ms) == (None, None)
    assert "queue" not in _exported_spec()["qos"]


def test_old_queue_max_is_read_as_max_and_agreeing_duplicates_are_accepted(acme: Any) -> None:
    manifests_apply(actor=SYSTEM, documents=_with_queue(limits={"queueMax": 3}))
    assert TokenEntitlement.objects.get().queue_max == 3
    assert _exported_spec()["qos"]["queue"] == {"max": 3}
    same = manifests_apply(actor=SYSTEM, documents=_with_queue({"max": 3}, {"queueMax": 3}))
    assert same.summary()["unchanged"] == 2


def test_old_and_new_names_that_disagree_are_an_error(acme: Any) -> None:
    with pytest.raises(ManifestError) as err:
        manifests_apply(actor=SYSTEM, documents=_with_queue({"max": 4}, {"queueMax": 3}))
    issue = next(i for i in err.value.issues if i.field == "spec.qos.queue.max")
    assert issue.index == 1 and issue.kind == "TokenEntitlement" and issue.name == "sample-entitlement"
    assert "spec.limits.queueMax" in issue.message and "3" in issue.message and "4" in issue.message
    assert TokenEntitlement.objects.count() == 0


@pytest.mark.parametrize(
    ("queue", "field", "words"),
    [
        ({"max": -1}, "spec.qos.queue.max", "at least 0"),
        ({"max": 2.5}, "spec.qos.queue.max", "must be an integer"),
        ({"max": True}, "spec.qos.queue.max", "must be an integer"),
        ({"max": "8"}, "spec.qos.queue.max", "must be an integer"),
        ({"maxWaitMs": -5}, "spec.qos.queue.maxWaitMs", "at least 0"),
        ({"maxWaitMs": 1.5}, "spec.qos.queue.maxWaitMs", "must be an integer"),
        ({"maxWaitMs": 600_001}, "spec.qos.queue.maxWaitMs", "at most 600000 (10 minutes)"),
        ({"max": 2, "maxWait": 500}, "spec.qos.queue.maxWait", "unknown field"),
        (5, "spec.qos.queue", "must be a mapping"),
    ],
)
def test_bad_queue_values_name_the_document_and_field(acme: Any, queue: Any, field: str, words: str) -> None:
    with pytest.raises(ManifestError) as err:
        manifests_apply(actor=SYSTEM, documents=_with_queue(queue))
    issues = [i for i in err.value.issues if i.field == field]
    assert issues, [str(i) for i in err.value.issues]
    assert issues[0].index == 1 and issues[0].name == "sample-entitlement"
    assert words in str(issues[0]), str(issues[0])
    assert TokenEntitlement.objects.count() == 0


def test_old_name_negative_is_refused_there(acme: Any) -> None:
    with pytest.raises(ManifestError) as err:
        manifests_apply(actor=SYSTEM, documents=_with_queue(limits={"queueMax": -2}))
    assert [i.field for i in err.value.issues] == ["spec.limits.queueMax"]


def test_the_longest_wait_is_accepted(acme: Any) -> None:
    manifests_apply(actor=SYSTEM, documents=_with_queue({"maxWaitMs": 600_000}))
    assert TokenEntitlement.objects.get().queue_max_wait_ms == 600_000


def test_dry_run_and_diff_show_a_queue_change(acme: Any, tmp_path: Path) -> None:
    docs = _with_queue({"max": 2})
    manifests_apply(actor=SYSTEM, documents=docs)
    changed = copy.deepcopy(docs)
    changed[1]["spec"]["qos"]["queue"] = {"max": 5, "maxWaitMs": 250}
    dry = manifests_apply(actor=SYSTEM, documents=changed, dry_run=True)
    assert dry.documents[1].action == "updated"
    assert dry.documents[1].fields == ("spec.qos.queue.max", "spec.qos.queue.maxWaitMs")
    assert TokenEntitlement.objects.get().queue_max == 2  # rolled back

    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump_all(changed, sort_keys=False))
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_:
        call_command("diff", "-f", str(path), stdout=out)
    assert exit_.value.code == 1
    text = out.getvalue()
    assert "-      max: 2\n" in text and "+      max: 5\n" in text and "+      maxWaitMs: 250\n" in text
    assert TokenEntitlement.objects.get().queue_max_wait_ms is None
