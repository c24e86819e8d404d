"""`apply --prune --tenant SLUG`: after applying, the tenant's entitlements the files no longer name are deleted
(through the REST API's delete service: keys go, the pool rebinds) and named; other tenants' are untouched;
--dry-run writes nothing; --prune needs --tenant; the apply and the prune are one transaction."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from apps.pools.models import EntitlementState, TokenEntitlement
from apps.tenancy.models import Membership, Role, Tenant
from tests.pools.test_apply_sources import rows
from tests.pools.test_delete_command import DEMO, QWEN, apply_examples, entitlement_doc, names

pytestmark = pytest.mark.django_db


def apply(*args: str) -> tuple[list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("apply", *args, stdout=out, stderr=err)
    return out.getvalue().splitlines(), err.getvalue()


def test_prune_deletes_the_tenants_entitlements_the_files_no_longer_name() -> None:
    apply_examples()
    out, err = apply("-f", DEMO, "--prune", "--tenant", "acme")  # qwen3-8b.yaml's sample-entitlement is acme's
    assert out[-1] == "TokenEntitlement/sample-entitlement pruned" and "8 unchanged, 1 pruned" in err
    assert "sample-entitlement" not in names(TokenEntitlement)
    assert {"acme-guaranteed", "globex-elastic", "globex-spot"} <= names(TokenEntitlement)
    out, err = apply("-f", QWEN, "--prune", "--tenant", "globex")  # names none of globex's: all of them go
    assert sorted(out[-2:]) == ["TokenEntitlement/globex-elastic pruned", "TokenEntitlement/globex-spot pruned"]
    assert not TokenEntitlement.objects.filter(tenant__slug="globex").exists()
    assert "acme-guaranteed" in names(TokenEntitlement) and "sample-entitlement" in names(TokenEntitlement)


def test_the_room_pruned_binds_a_degraded_entitlement_and_its_warning_goes(tmp_path: Path) -> None:
    apply_examples()
    big = tmp_path / "big.yaml"
    big.write_text(entitlement_doc("acme-big", "acme", concurrency=8))  # 12 of demo-pool's 16 slots reserved
    _out, err = apply("-f", DEMO, "-f", QWEN, "-f", str(big))
    assert "warning: TokenEntitlement/acme-big is Degraded" in err
    kept = tmp_path / "kept.yaml"  # acme keeps only acme-big: its guaranteed and elastic go, and it fits
    kept.write_text(entitlement_doc("acme-big", "acme", concurrency=8))
    out, err = apply("-f", str(kept), "--prune", "--tenant", "acme")
    assert "TokenEntitlement/acme-guaranteed pruned" in out and "warning" not in err
    assert TokenEntitlement.objects.get(name="acme-big").state == EntitlementState.BOUND


def test_prune_dry_run_reports_the_same_and_writes_nothing(django_capture_on_commit_callbacks: Any) -> None:
    apply_examples()
    before = rows()
    with django_capture_on_commit_callbacks() as callbacks:
        out, err = apply("-f", DEMO, "--prune", "--tenant", "acme", "--dry-run")
    assert out[-1] == "TokenEntitlement/sample-entitlement pruned (dry run)" and "(dry run: nothing written)" in err
    assert rows() == before and callbacks == []


def test_prune_needs_a_tenant_that_exists() -> None:
    apply_examples()
    with pytest.raises(CommandError, match="--prune needs --tenant"):
        apply("-f", DEMO, "--prune")
    with pytest.raises(CommandError, match="give --prune too"):
        apply("-f", DEMO, "--tenant", "acme")
    with pytest.raises(CommandError, match="--tenant: unknown tenant 'initech'") as unknown:
        apply("-f", DEMO, "--prune", "--tenant", "initech")
    assert unknown.value.returncode == 1


def test_a_tenant_the_files_create_has_nothing_to_prune(tmp_path: Path) -> None:
    out, _err = apply("-f", DEMO, "--prune", "--tenant", "acme", "--dry-run")
    assert not any(line.endswith("pruned (dry run)") for line in out) and Tenant.objects.count() == 0
    out, _err = apply("-f", DEMO, "--prune", "--tenant", "acme")
    assert not any("pruned" in line for line in out) and Tenant.objects.count() == 2


def test_a_prune_that_fails_leaves_the_apply_undone(tmp_path: Path) -> None:
    """An owner of acme and a member of globex applies acme's entitlements and prunes globex's, which a member
    may not delete: the entitlement the apply created is gone too."""
    apply_examples()
    olivia = get_user_model().objects.create_user("olivia", password="x-pass-123")
    Membership.objects.create(tenant=Tenant.objects.get(slug="acme"), user=olivia, role=Role.OWNER)
    Membership.objects.create(tenant=Tenant.objects.get(slug="globex"), user=olivia, role=Role.MEMBER)
    new = tmp_path / "new.yaml"
    new.write_text(entitlement_doc("acme-new", "acme", concurrency=1))
    before = rows()
    with pytest.raises(CommandError, match="only owners of tenant 'globex'") as failed:
        apply("-f", str(new), "--prune", "--tenant", "globex", "--as", "olivia")
    assert failed.value.returncode == 1 and "nothing applied" in str(failed.value)
    assert rows() == before and "acme-new" not in names(TokenEntitlement)
