"""Serving at a lower tier in manifests (issue 24): `spec.qos.spillover`, `spec.quota.onExceeded` on
entitlements and tenants, and an llm-d pool's `spec.backend.objectives`: stored, exported, applied back
unchanged, shown by dry runs and diffs, and bad values refused with the document and field named."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command

from apps.pools.manifests import ManifestError, manifests_apply, manifests_export
from apps.pools.models import TokenEntitlement, TokenPool
from apps.tenancy.models import Tenant
from apps.tenancy.services import SYSTEM
from tests.pools.test_manifests import _docs

pytestmark = pytest.mark.django_db


def _tiered() -> list[Any]:
    """The example with everything issue 24 adds: the tenant's quota demotes, the entitlement spills over to
    spot and demotes on its own quota, the pool is an llm-d gateway with two objectives named."""
    docs = _docs("qwen3-8b.yaml", tenants=True)
    docs[0]["spec"]["quota"]["onExceeded"] = "spot"
    docs[1]["spec"]["backend"] = {"kind": "llm-d", "replicas": [{"url": "http://gateway.llm-d:80"}],
                                  "objectives": {"guaranteed": "premium", "spot": "batch"}}
    docs[2]["spec"]["qos"]["spillover"] = "spot"
    docs[2]["spec"]["quota"]["onExceeded"] = "spot"
    return docs


def _exported(kind: str) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(manifests_export(user=SYSTEM)) if d["kind"] == kind)


def test_tier_fields_are_stored_exported_and_reapply_unchanged(acme: Any) -> None:
    docs = _tiered()
    manifests_apply(actor=SYSTEM, documents=docs)
    ent = TokenEntitlement.objects.get()
    assert (ent.spillover_class, ent.quota_on_exceeded) == ("spot", "spot")
    assert Tenant.objects.get(slug="acme").quota_on_exceeded == "spot"
    pool = TokenPool.objects.get()
    assert (pool.backend_kind, pool.inference_objectives) == ("llm-d", {"guaranteed": "premium", "spot": "batch"})

    assert _exported("TokenEntitlement")["spec"]["qos"]["spillover"] == "spot"
    assert _exported("TokenEntitlement")["spec"]["quota"]["onExceeded"] == "spot"
    assert _exported("Tenant")["spec"]["quota"]["onExceeded"] == "spot"
    assert _exported("TokenPool")["spec"]["backend"]["objectives"] == {"guaranteed": "premium", "spot": "batch"}
    # What export writes, apply reads back unchanged.
    exported = list(yaml.safe_load_all(manifests_export(user=SYSTEM)))
    assert manifests_apply(actor=SYSTEM, documents=exported).summary() == {"created": 0, "updated": 0,
                                                                          "unchanged": 3}
    assert manifests_apply(actor=SYSTEM, documents=docs).summary()["unchanged"] == 3


def test_defaults_are_left_out_of_the_export_and_dropping_a_field_resets_it(acme: Any) -> None:
    manifests_apply(actor=SYSTEM, documents=_tiered())
    plain = _docs("qwen3-8b.yaml", tenants=True)
    result = manifests_apply(actor=SYSTEM, documents=plain)
    assert [d.fields for d in result.documents] == [
        ("spec.quota.onExceeded",),
        ("spec.backend.kind", "spec.backend.objectives", "spec.backend.replicas"),
        ("spec.qos.spillover", "spec.quota.onExceeded"),
    ]
    ent = TokenEntitlement.objects.get()
    assert (ent.spillover_class, ent.quota_on_exceeded) == ("", "reject")
    assert TokenPool.objects.get().inference_objectives == {}
    # reject and no spillover are the defaults: nothing written for them, so older exports stay the same.
    assert "spillover" not in _exported("TokenEntitlement")["spec"]["qos"]
    assert "onExceeded" not in _exported("TokenEntitlement")["spec"]["quota"]
    assert "onExceeded" not in _exported("Tenant")["spec"]["quota"]
    assert "objectives" not in _exported("TokenPool")["spec"]["backend"]
    # onExceeded: reject written out is the default, not a change.
    explicit = copy.deepcopy(plain)
    explicit[2]["spec"]["quota"]["onExceeded"] = "reject"
    assert manifests_apply(actor=SYSTEM, documents=explicit).summary()["unchanged"] == 3


def test_an_elastic_entitlement_may_spill_over_to_preemptible(acme: Any) -> None:
    docs = _tiered()
    docs[2]["spec"]["qos"].update(serviceClass="elastic", spillover="preemptible")
    manifests_apply(actor=SYSTEM, documents=docs)
    assert TokenEntitlement.objects.get().spillover_class == "preemptible"


def _bad(path: list[Any], value: Any) -> list[Any]:
    docs = _tiered()
    node = docs
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return docs


@pytest.mark.parametrize(
    ("path", "value", "index", "field", "words"),
    [
        ([2, "spec", "qos", "spillover"], "cheap", 2, "spec.qos.spillover", "unknown class 'cheap'"),
        ([2, "spec", "qos", "spillover"], "guaranteed", 2, "spec.qos.spillover", "is not lower than 'guaranteed'"),
        ([2, "spec", "qos", "spillover"], "dedicated", 2, "spec.qos.spillover", "is not lower than 'guaranteed'"),
        ([2, "spec", "qos", "spillover"], 3, 2, "spec.qos.spillover", "must be a string"),
        ([2, "spec", "quota", "onExceeded"], "throttle", 2, "spec.quota.onExceeded", "expected reject"),
        ([2, "spec", "quota", "onExceeded"], ["spot"], 2, "spec.quota.onExceeded", "must be a string"),
        ([0, "spec", "quota", "onExceeded"], "Spot", 0, "spec.quota.onExceeded", "unknown value 'Spot'"),
        ([1, "spec", "backend", "objectives", "gold"], "premium", 1, "spec.backend.objectives.gold",
         "unknown service class 'gold'"),
        ([1, "spec", "backend", "objectives", "spot"], "Batch_Jobs", 1, "spec.backend.objectives.spot",
         "not a Kubernetes object name"),
        ([1, "spec", "backend", "objectives", "spot"], 7, 1, "spec.backend.objectives.spot",
         "not a Kubernetes object name"),
        ([1, "spec", "backend", "objectives"], ["premium"], 1, "spec.backend.objectives", "must be a mapping"),
        ([1, "spec", "backend", "kind"], "llmd", 1, "spec.backend.kind", "one of vllm, engine, virtual, llm-d"),
    ],
)
def test_bad_tier_values_name_the_document_and_field(acme: Any, path: list[Any], value: Any, index: int,
                                                     field: str, words: str) -> None:
    with pytest.raises(ManifestError) as err:
        manifests_apply(actor=SYSTEM, documents=_bad(path, value))
    issues = [i for i in err.value.issues if i.field == field]
    assert issues, [str(i) for i in err.value.issues]
    assert issues[0].index == index and issues[0].name == ("acme", "qwen3-8b", "sample-entitlement")[index]
    assert words in str(issues[0]), str(issues[0])
    assert TokenEntitlement.objects.count() == 0 and TokenPool.objects.count() == 0


@pytest.mark.parametrize("service_class", ["spot", "preemptible"])
def test_spot_and_preemptible_entitlements_cannot_spill_over(acme: Any, service_class: str) -> None:
    docs = _tiered()
    docs[2]["spec"]["qos"].update(serviceClass=service_class, spillover="preemptible")
    with pytest.raises(ManifestError) as err:
        manifests_apply(actor=SYSTEM, documents=docs)
    (issue,) = err.value.issues
    assert (issue.index, issue.field) == (2, "spec.qos.spillover")
    assert f"a {service_class} entitlement cannot spill over" in issue.message


def test_dry_run_and_diff_show_tier_changes(acme: Any, tmp_path: Path) -> None:
    docs = _tiered()
    manifests_apply(actor=SYSTEM, documents=docs)
    changed = copy.deepcopy(docs)
    changed[1]["spec"]["backend"]["objectives"] = {"guaranteed": "gold"}
    changed[2]["spec"]["qos"]["spillover"] = "elastic"
    dry = manifests_apply(actor=SYSTEM, documents=changed, dry_run=True)
    assert [d.fields for d in dry.documents] == [(), ("spec.backend.objectives",), ("spec.qos.spillover",)]
    assert TokenEntitlement.objects.get().spillover_class == "spot"  # rolled back

    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump_all(changed, sort_keys=False))
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_:
        call_command("diff", "-f", str(path), stdout=out)
    assert exit_.value.code == 1
    text = out.getvalue()
    assert "-    spillover: spot\n" in text and "+    spillover: elastic\n" in text
    assert "-      guaranteed: premium\n" in text and "+      guaranteed: gold\n" in text
    assert "-      spot: batch\n" in text
    assert TokenPool.objects.get().inference_objectives == {"guaranteed": "premium", "spot": "batch"}
