"""Manifests: apply (idempotent, all-or-nothing, located errors), export, and the round trip."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from hypothesis import HealthCheck, given
from hypothesis import settings as settings_h
from hypothesis import strategies as st

from apps.pools.manifests import ManifestError, manifests_apply, manifests_export, manifests_parse
from apps.pools.models import EntitlementStateChange, Replica, TokenEntitlement, TokenPool
from apps.tenancy.services import SYSTEM
from tests.pools.test_api_isolation import client_as

EXAMPLES = Path(settings.BASE_DIR) / "examples"


def _docs(name: str, tenants: bool = False) -> list[Any]:
    """An example's documents; without its Tenant documents unless asked (these tests use the fixtures')."""
    return [d for d in manifests_parse((EXAMPLES / name).read_text()) if tenants or d["kind"] != "Tenant"]


def _state() -> tuple:
    return (
        sorted(TokenPool.objects.values_list("name", "slots_per_replica", "kv_cache_gib_per_replica")),
        sorted(Replica.objects.values_list("url", "enabled")),
        sorted(TokenEntitlement.objects.values_list("name", "concurrency", "state", "service_class")),
        EntitlementStateChange.objects.count(),
    )


@pytest.mark.django_db
def test_example_applies_then_is_unchanged_then_updates(acme: Any) -> None:
    docs = _docs("qwen3-8b.yaml")
    first = manifests_apply(actor=SYSTEM, documents=docs)
    assert [(d.kind, d.name, d.action) for d in first.documents] == [
        ("TokenPool", "qwen3-8b", "created"), ("TokenEntitlement", "sample-entitlement", "created")]
    ent = TokenEntitlement.objects.get(name="sample-entitlement")
    assert (ent.tenant, ent.service_class, ent.slo_target_ms, ent.tokens_per_second, ent.concurrency) == (
        acme, "guaranteed", 200, 100, 4)
    assert ent.kv_cache_bytes == 2 * 1024**3 and ent.state == "Bound"
    pool = TokenPool.objects.get(name="qwen3-8b")
    assert pool.capacity().slots == 16 and pool.bytes_per_token == 147456

    before = _state()
    assert manifests_apply(actor=SYSTEM, documents=docs).summary() == {"created": 0, "updated": 0, "unchanged": 2}
    assert _state() == before

    changed = copy.deepcopy(docs)
    changed[0]["spec"]["capacityPerReplica"]["slots"] = 2  # shrink below the entitlement's 4
    result = manifests_apply(actor=SYSTEM, documents=changed)
    assert result.summary() == {"created": 0, "updated": 1, "unchanged": 1}
    ent.refresh_from_db()
    assert ent.state == "Degraded"


@pytest.mark.django_db
def test_export_round_trip(admin: Any, acme: Any, globex: Any) -> None:
    manifests_apply(actor=SYSTEM, documents=_docs("demo.yaml"))
    manifests_apply(actor=SYSTEM, documents=_docs("qwen3-8b.yaml"))
    exported = manifests_export(user=admin)
    docs = manifests_parse(exported)
    assert [d["kind"] for d in docs].count("TokenPool") == 2
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "TokenEntitlement"} == {
        "acme-guaranteed", "acme-elastic", "acme-preemptible", "globex-elastic", "globex-spot", "sample-entitlement"}
    before = _state()
    assert manifests_apply(actor=SYSTEM, documents=exported).count("unchanged") == len(docs)
    assert _state() == before

    # Into an empty database the export recreates the same objects.
    TokenEntitlement.objects.all().delete()
    TokenPool.objects.all().delete()
    # (the tenants stay: they are the fixtures', unchanged)
    assert manifests_apply(actor=SYSTEM, documents=exported).count("created") == len(docs) - 2
    assert manifests_export(user=admin) == exported


@pytest.mark.django_db
def test_optional_fields_round_trip(acme: Any) -> None:
    docs = _docs("qwen3-8b.yaml")
    docs[1]["spec"]["limits"] = {"defaultMaxTokens": 512, "queueMax": 8}
    docs[1]["spec"]["expiresAt"] = "2099-01-01T00:00:00Z"
    docs[1]["spec"]["resources"]["kvCacheGiB"] = 0.5
    manifests_apply(actor=SYSTEM, documents=docs)
    ent = TokenEntitlement.objects.get()
    assert (ent.default_max_tokens, ent.queue_max, ent.expires_at.year, float(ent.kv_cache_gib)) == (512, 8, 2099, 0.5)
    exported = yaml.safe_load_all(manifests_export(user=SYSTEM))
    spec = [d for d in exported if d["kind"] == "TokenEntitlement"][0]["spec"]
    # queueMax is read as the old name of spec.qos.queue.max; export writes the new form
    assert spec["limits"] == {"defaultMaxTokens": 512} and spec["qos"]["queue"] == {"max": 8}
    assert spec["resources"]["kvCacheGiB"] == 0.5
    assert manifests_apply(actor=SYSTEM, documents=docs).summary()["unchanged"] == 2


def _broken(path: list[str], value: Any) -> list[Any]:
    docs = _docs("qwen3-8b.yaml")
    target = docs[0] if path[0] == "pool" else docs[1]
    node = target
    for key in path[1:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return docs


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("path", "value", "index", "field"),
    [
        (["pool", "spec", "capacityPerReplica", "slots"], 0, 0, "spec.capacityPerReplica.slots"),
        (["pool", "spec", "capacityPerReplica", "tokensPerSecond"], -240, 0, "spec.capacityPerReplica.tokensPerSecond"),
        (["pool", "spec", "capacityPerReplica", "kvCacheGiB"], 0, 0, "spec.capacityPerReplica.kvCacheGiB"),
        (["pool", "spec", "kvGeometry", "layers"], "many", 0, "spec.kvGeometry.layers"),
        (["pool", "spec", "backend", "kind"], "tpu", 0, "spec.backend.kind"),
        (["pool", "spec", "model"], KeyError, 0, "spec.model"),
        (["pool", "apiVersion"], "tokens.datarobot.com/v1alpha1", 0, "apiVersion"),
        (["ent", "spec", "qos", "serviceClass"], "platinum", 1, "spec.qos.serviceClass"),
        (["ent", "spec", "poolRef", "name"], "no-such-pool", 1, "spec.poolRef.name"),
        (["ent", "spec", "tenantId"], "nobody", 1, "spec.tenantId"),
        (["ent", "spec", "resources", "concurrency"], 0, 1, "spec.resources.concurrency"),
        (["ent", "spec", "resources", "kvCacheGiB"], "lots", 1, "spec.resources.kvCacheGiB"),
        (["ent", "spec", "expiresAt"], "tomorrow", 1, "spec.expiresAt"),
        (["ent", "metadata", "name"], "Not_A_Name", 1, "metadata.name"),
        (["ent", "spec", "qos", "serviceclass"], "spot", 1, "spec.qos.serviceclass"),
        (["pool", "spec", "scalling"], {"maxReplicas": 3}, 0, "spec.scalling"),
        (["pool", "spec", "qos"], "fast", 0, "spec.qos"),
    ],
)
def test_bad_documents_write_nothing_and_errors_say_where(acme: Any, path: list, value: Any, index: int,
                                                          field: str) -> None:
    docs = _broken(path, value)
    with pytest.raises(ManifestError) as err:
        manifests_apply(actor=SYSTEM, documents=docs)
    issues = err.value.issues
    assert any(i.index == index and i.field == field for i in issues), [str(i) for i in issues]
    kind = "TokenPool" if index == 0 else "TokenEntitlement"
    assert all(i.kind == kind for i in issues if i.index == index)
    assert TokenPool.objects.count() == 0 and TokenEntitlement.objects.count() == 0


@pytest.mark.django_db
def test_a_valid_pool_is_not_written_when_a_later_document_fails(acme: Any) -> None:
    docs = _broken(["ent", "spec", "qos", "serviceClass"], "gold")
    with pytest.raises(ManifestError):
        manifests_apply(actor=SYSTEM, documents=docs)
    assert TokenPool.objects.count() == 0


@pytest.mark.django_db
def test_duplicate_names_in_one_manifest_are_rejected(acme: Any) -> None:
    docs = _docs("qwen3-8b.yaml")
    with pytest.raises(ManifestError) as err:
        manifests_apply(actor=SYSTEM, documents=docs + [copy.deepcopy(docs[1])])
    assert any(i.index == 2 and "duplicate" in i.message for i in err.value.issues)
    assert TokenEntitlement.objects.count() == 0


@pytest.mark.parametrize("text", ["kind: [unclosed", "", "- just\n- a list\n", "42"])
def test_malformed_yaml_is_reported(text: str) -> None:
    with pytest.raises(ManifestError):
        docs = manifests_parse(text)
        _validate_only(docs)


def _validate_only(docs: list[Any]) -> None:
    from apps.pools.manifests import _validate

    _validate(docs, SYSTEM)


@pytest.mark.api
@pytest.mark.django_db
def test_apply_endpoint_reports_and_errors(admin: Any, acme: Any) -> None:
    client = client_as(admin)
    text = (EXAMPLES / "qwen3-8b.yaml").read_text()
    first = client.post("/api/v1/apply", text, content_type="application/yaml")
    assert first.status_code == 200, first.json()
    assert (first.json()["created"], first.json()["updated"]) == (2, 1)  # the fixture's acme gets its displayName
    again = client.post("/api/v1/apply", {"manifest": text}, format="json")
    assert again.json()["unchanged"] == 3
    docs = manifests_parse(text)
    assert client.post("/api/v1/apply", {"documents": docs}, format="json").json()["unchanged"] == 3
    assert client.post("/api/v1/apply", docs, format="json").json()["unchanged"] == 3
    upload = SimpleUploadedFile("m.yaml", text.encode(), content_type="application/yaml")
    assert client.post("/api/v1/apply", {"file": upload}, format="multipart").json()["unchanged"] == 3
    docs = _docs("qwen3-8b.yaml")
    bad = client.post("/api/v1/apply", "kind: TokenPool\n  oops: [", content_type="application/yaml")
    assert bad.status_code == 400 and "malformed YAML" in bad.json()["errors"][0]["message"]
    docs[1]["spec"]["qos"]["serviceClass"] = "gold"
    docs[0]["spec"]["capacityPerReplica"]["slots"] = 99
    bad = client.post("/api/v1/apply", {"documents": docs}, format="json")
    assert bad.status_code == 400
    assert bad.json()["errors"] == [{"index": 1, "kind": "TokenEntitlement", "name": "sample-entitlement",
                                     "field": "spec.qos.serviceClass",
                                     "message": bad.json()["errors"][0]["message"]}]
    assert TokenPool.objects.get().slots_per_replica == 16  # the valid pool change was not written either
    assert client.post("/api/v1/apply", {}, format="json").status_code == 400


@pytest.mark.django_db
@settings_h(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    slots=st.integers(1, 64),
    tps=st.integers(1, 10_000),
    kv_milli=st.integers(1, 200_000),
    service_class=st.sampled_from(["dedicated", "guaranteed", "elastic", "spot", "preemptible"]),
    ent_kv_milli=st.integers(1, 50_000),
    concurrency=st.integers(1, 64),
    replicas=st.lists(st.booleans(), min_size=0, max_size=3),
)
def test_any_valid_manifest_round_trips(acme: Any, slots: int, tps: int, kv_milli: int, service_class: str,
                                        ent_kv_milli: int, concurrency: int, replicas: list[bool]) -> None:
    TokenEntitlement.objects.all().delete()
    TokenPool.objects.all().delete()
    docs = _docs("qwen3-8b.yaml")
    spec = docs[0]["spec"]
    spec["capacityPerReplica"] = {"slots": slots, "tokensPerSecond": tps, "kvCacheGiB": kv_milli / 1000}
    spec["backend"]["replicas"] = [{"url": f"http://10.0.0.{i}:8000", "enabled": on} for i, on in enumerate(replicas)]
    ent = docs[1]["spec"]
    ent["qos"]["serviceClass"] = service_class
    ent["resources"] = {"tokensPerSecond": tps, "kvCacheGiB": ent_kv_milli / 1000, "concurrency": concurrency}
    manifests_apply(actor=SYSTEM, documents=docs)
    exported = manifests_export(user=SYSTEM)
    assert manifests_apply(actor=SYSTEM, documents=exported).summary()["unchanged"] == 3  # tenant, pool, entitlement
    again = [d for d in manifests_parse(exported) if d["kind"] != "Tenant"]
    assert again[0]["spec"]["capacityPerReplica"] == spec["capacityPerReplica"]
    assert again[1]["spec"]["resources"] == ent["resources"]
    pool = TokenPool.objects.get()
    assert pool.capacity().slots == slots * sum(replicas)
