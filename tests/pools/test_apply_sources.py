"""`apply -f` as kubectl users expect: directories (-R), stdin, repeated -f, identical documents merged and
conflicting ones refused naming both places, per-object output with the fields that changed, a warning for
every entitlement left Pending or Degraded, and --dry-run writing nothing (rows and on-commit hooks)."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from apps.gateway import snapshot
from apps.pools.models import EntitlementStateChange, Replica, TokenEntitlement, TokenPool
from apps.tenancy.models import Membership, Tenant

EXAMPLES = Path(settings.BASE_DIR) / "examples"
MANIFESTS = ("demo.yaml", "qwen3-8b.yaml")


def run(*args: str, stdin: str | None = None, monkeypatch: Any = None) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    call_command("apply", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def rows() -> dict[str, int]:
    return {model.__name__: model.objects.count()
            for model in (Tenant, Membership, TokenPool, Replica, TokenEntitlement, EntitlementStateChange)}


def examples_in(folder: Path) -> Path:
    """The two example manifests (not the load scenario) copied into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in MANIFESTS:
        shutil.copy(EXAMPLES / name, folder / name)
    return folder


DEMO_OBJECTS = 8  # 2 tenants, 1 pool, 5 entitlements
ALL_OBJECTS = DEMO_OBJECTS + 2  # qwen3-8b.yaml adds its pool and entitlement (acme is the same document)


@pytest.mark.django_db
def test_the_two_examples_apply_together_and_keep_acmes_quota() -> None:
    out, err = run("-f", str(EXAMPLES / "demo.yaml"), "-f", str(EXAMPLES / "qwen3-8b.yaml"))
    assert len(out.splitlines()) == ALL_OBJECTS and "10 created, 0 updated, 0 unchanged" in err
    assert "Tenant/acme created" in out.splitlines()
    acme = Tenant.objects.get(slug="acme")
    assert (acme.quota_amount, acme.quota_currency, acme.quota_window) == (50, "USD", "month")
    # One after the other, in either order, acme keeps its quota: the files declare it identically.
    out, _ = run("-f", str(EXAMPLES / "qwen3-8b.yaml"))
    assert out.splitlines()[0] == "Tenant/acme unchanged"
    assert Tenant.objects.get(slug="acme").quota_amount == 50


@pytest.mark.django_db
def test_a_directory_applies_its_manifest_files_and_R_descends(tmp_path: Path) -> None:
    examples_in(tmp_path / "nested" / "deeper")
    (tmp_path / "notes.txt").write_text("not a manifest")
    with pytest.raises(CommandError, match=r"no \.yaml, \.yml, \.json files in this directory \(-R descends"):
        run("-f", str(tmp_path))
    assert rows()["Tenant"] == 0
    out, _ = run("-f", str(tmp_path), "-R")
    assert len(out.splitlines()) == ALL_OBJECTS and TokenPool.objects.count() == 2
    # The shipped folder itself applies as a whole (the same objects: all unchanged); its load scenario, not a
    # manifest, lives in examples/loadgen/, which only -R reads (and then names in its error).
    out, _ = run("-f", str(EXAMPLES))
    assert len(out.splitlines()) == ALL_OBJECTS and all(line.endswith(" unchanged") for line in out.splitlines())
    with pytest.raises(CommandError, match=r"demo.yaml, document 0"):
        run("-f", str(EXAMPLES), "-R")


@pytest.mark.django_db
def test_json_files_and_stdin_and_repeated_f(tmp_path: Path, monkeypatch: Any) -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "qwen3-8b.yaml").read_text()))
    tenant, pool, ent = docs
    (tmp_path / "pool.json").write_text(json.dumps(pool))
    (tmp_path / "rest.json").write_text(json.dumps([tenant, ent]))  # an array of documents
    out, _ = run("-f", str(tmp_path / "pool.json"), "-f", "-", "-f", str(tmp_path / "rest.json"),
                 stdin=(EXAMPLES / "demo.yaml").read_text(), monkeypatch=monkeypatch)
    assert len(out.splitlines()) == ALL_OBJECTS and TokenEntitlement.objects.count() == 6
    with pytest.raises(CommandError, match="standard input"):
        run("-f", "-", "-f", "-", stdin="", monkeypatch=monkeypatch)


@pytest.mark.django_db
def test_conflicting_documents_name_both_places_and_write_nothing(tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text((EXAMPLES / "qwen3-8b.yaml").read_text().replace("displayName: Acme Corp", "displayName: ACME"))
    with pytest.raises(CommandError) as caught:
        run("-f", str(EXAMPLES / "demo.yaml"), "-f", str(other))
    assert str(caught.value) == (f"Tenant 'acme' is declared differently in {EXAMPLES / 'demo.yaml'}, document 0 "
                                 f"and in {other}, document 0")
    assert all(n == 0 for n in rows().values())
    # The same file twice (or through its directory) is one set of documents, applied once.
    out, _ = run("-f", str(other), "-f", str(other), "-f", str(tmp_path))
    assert len(out.splitlines()) == 3


@pytest.mark.django_db
def test_updates_name_the_changed_fields_and_degraded_entitlements_are_warned(tmp_path: Path) -> None:
    run("-f", str(EXAMPLES / "qwen3-8b.yaml"))
    text = (EXAMPLES / "qwen3-8b.yaml").read_text()
    changed = tmp_path / "changed.yaml"
    changed.write_text(text.replace("capacityPerReplica: {slots: 16,", "capacityPerReplica: {slots: 2,")
                       .replace("concurrency: 4", "concurrency: 3").replace("sloTargetMs: 200", "sloTargetMs: 300"))
    out, err = run("-f", str(changed))
    assert out.splitlines() == [
        "Tenant/acme unchanged",
        "TokenPool/qwen3-8b updated (fields: spec.capacityPerReplica.slots)",
        "TokenEntitlement/sample-entitlement updated (fields: spec.qos.sloTargetMs, spec.resources.concurrency)",
    ]
    reason = TokenEntitlement.objects.get(name="sample-entitlement").state_reason
    assert reason.startswith("baseline does not fit pool qwen3-8b: concurrency 3 > 2 free slots")
    assert f"warning: TokenEntitlement/sample-entitlement is Degraded: {reason}" in err.splitlines()
    # Nothing to warn about once it fits again.
    _, err = run("-f", str(EXAMPLES / "qwen3-8b.yaml"))
    assert "warning" not in err


@pytest.mark.django_db
def test_dry_run_reports_the_same_and_writes_nothing(tmp_path: Path, django_capture_on_commit_callbacks: Any) -> None:
    run("-f", str(EXAMPLES / "demo.yaml"))
    examples_in(tmp_path / "both")  # demo.yaml changed (a pool too small for acme-guaranteed), qwen3-8b.yaml new
    (tmp_path / "both" / "demo.yaml").write_text((EXAMPLES / "demo.yaml").read_text()
                                                 .replace("    slots: 16", "    slots: 2")
                                                 .replace("concurrency: 2", "concurrency: 1"))
    before, version = rows(), snapshot.local_version()
    state = list(TokenEntitlement.objects.values_list("name", "state", "state_reason", "updated_at"))
    with django_capture_on_commit_callbacks() as hooks:
        dry_out, dry_err = run("-f", str(tmp_path / "both"), "--dry-run")
    assert rows() == before and snapshot.local_version() == version and hooks == []
    assert list(TokenEntitlement.objects.values_list("name", "state", "state_reason", "updated_at")) == state
    lines = dry_out.splitlines()
    assert "TokenPool/demo-pool updated (fields: spec.capacityPerReplica.slots) (dry run)" in lines
    assert "TokenPool/qwen3-8b created (dry run)" in lines
    assert "TokenEntitlement/acme-preemptible updated (fields: spec.resources.concurrency) (dry run)" in lines
    assert dry_err.splitlines()[0].startswith("warning: TokenEntitlement/acme-guaranteed is Degraded: baseline does "
                                              "not fit pool demo-pool: concurrency 4 > 2 free slots")
    assert "(dry run: nothing written)" in dry_err
    # The real apply reports exactly what the dry run said.
    out, err = run("-f", str(tmp_path / "both"))
    assert out.splitlines() == [line.removesuffix(" (dry run)") for line in lines]
    assert [w for w in err.splitlines() if w.startswith("warning")] == [
        w for w in dry_err.splitlines() if w.startswith("warning")]
    assert rows() != before
