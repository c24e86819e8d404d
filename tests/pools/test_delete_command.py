"""`manage.py delete -f` as kubectl users expect: the objects the files name go (entitlements, then pools, then
tenants) through the REST API's delete services (keys go, pools rebind); a pool or tenant still used outside the
files is refused naming its users unless --cascade; not-found objects are reported, an error only when none was
found; one transaction (a failing delete deletes nothing); bad input is a message naming the file and exit 1."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from apps.pools.models import EntitlementState, Replica, TokenEntitlement, TokenPool
from apps.tenancy.models import ApiKey, Membership, Role, Tenant
from apps.tenancy.services import SYSTEM, apikey_create
from tests.pools.test_apply_sources import EXAMPLES, rows

pytestmark = pytest.mark.django_db

DEMO, QWEN = str(EXAMPLES / "demo.yaml"), str(EXAMPLES / "qwen3-8b.yaml")
HEADER = "apiVersion: tokenpools.io/v1alpha1\n"


def delete(*args: str) -> tuple[list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("delete", *args, stdout=out, stderr=err)
    return out.getvalue().splitlines(), err.getvalue()


def apply_examples() -> None:
    call_command("apply", "-f", DEMO, "-f", QWEN, stdout=io.StringIO(), stderr=io.StringIO())


def entitlement_doc(name: str, tenant: str, pool: str = "demo-pool", concurrency: int = 4) -> str:
    return (f"{HEADER}kind: TokenEntitlement\nmetadata: {{name: {name}}}\nspec:\n  tenantId: {tenant}\n"
            f"  poolRef: {{name: {pool}}}\n  qos: {{serviceClass: guaranteed, sloTargetMs: 200}}\n"
            f"  resources: {{tokensPerSecond: 400, kvCacheGiB: 0.25, concurrency: {concurrency}}}\n")


def names(kind: type) -> set[str]:
    field = "slug" if kind is Tenant else "name"
    return set(kind.objects.values_list(field, flat=True))  # type: ignore[attr-defined]


def test_deletes_what_the_files_name_entitlements_then_pools_then_tenants() -> None:
    apply_examples()
    apikey_create(actor=SYSTEM, entitlement=TokenEntitlement.objects.get(name="acme-guaranteed"))
    out, _err = delete("-f", DEMO, "-f", QWEN)
    kinds = [line.split("/")[0] for line in out]
    assert kinds == ["TokenEntitlement"] * 6 + ["TokenPool"] * 2 + ["Tenant"] * 2
    assert "TokenEntitlement/acme-guaranteed deleted" in out and "Tenant/acme deleted" in out
    assert rows() == {name: 0 for name in rows()} and ApiKey.objects.count() == 0


def test_a_pool_or_tenant_used_outside_the_files_is_refused_naming_them(tmp_path: Path) -> None:
    apply_examples()
    before = rows()
    with pytest.raises(CommandError) as refused:
        delete("-f", QWEN)  # names acme, which demo.yaml's entitlements still use
    message = str(refused.value)
    assert refused.value.returncode == 1 and "nothing deleted" in message
    assert f"{QWEN}, document 0 (Tenant 'acme'): still used by TokenEntitlement/acme-elastic, " in message
    assert "TokenEntitlement/acme-preemptible" in message and "--cascade" in message
    assert "globex" not in message and rows() == before
    pool_file = tmp_path / "pool.yaml"
    pool_file.write_text(f"{HEADER}kind: TokenPool\nmetadata: {{name: demo-pool}}\n")  # no spec needed
    with pytest.raises(CommandError, match="TokenPool 'demo-pool'.*TokenEntitlement/globex-spot"):
        delete("-f", str(pool_file))
    assert rows() == before


def test_cascade_deletes_the_users_first_and_leaves_the_rest() -> None:
    apply_examples()
    out, _err = delete("-f", QWEN, "--cascade")
    assert out[:3] == [f"TokenEntitlement/acme-{c} deleted (cascade)" for c in ("elastic", "guaranteed", "preemptible")]
    assert out[3:] == ["TokenEntitlement/sample-entitlement deleted", "TokenPool/qwen3-8b deleted", "Tenant/acme deleted"]
    assert names(Tenant) == {"globex"} and names(TokenPool) == {"demo-pool"}
    assert names(TokenEntitlement) == {"globex-elastic", "globex-spot"}


def test_deleting_an_entitlement_rebinds_its_pool_as_the_rest_delete_does(tmp_path: Path) -> None:
    apply_examples()
    big = tmp_path / "big.yaml"
    big.write_text(entitlement_doc("globex-big", "globex", concurrency=8))  # 12 of 16 slots are reserved
    call_command("apply", "-f", str(big), stdout=io.StringIO(), stderr=io.StringIO())
    assert TokenEntitlement.objects.get(name="globex-big").state == EntitlementState.DEGRADED
    gone = tmp_path / "gone.yaml"
    gone.write_text(entitlement_doc("acme-guaranteed", "acme"))  # only the identity matters
    assert delete("-f", str(gone))[0] == ["TokenEntitlement/acme-guaranteed deleted"]
    freed = TokenEntitlement.objects.get(name="globex-big")
    assert freed.state == EntitlementState.BOUND and "acme-guaranteed deleted" in freed.state_reason


def test_a_failing_delete_deletes_nothing(django_capture_on_commit_callbacks: Any) -> None:
    """An owner of acme may delete its entitlements but not the pools or tenants: the last step fails, and
    the entitlements deleted before it are back (and the gateway was not told to reload)."""
    apply_examples()
    olivia = get_user_model().objects.create_user("olivia", password="x-pass-123")
    Membership.objects.create(tenant=Tenant.objects.get(slug="acme"), user=olivia, role=Role.OWNER)
    before = rows()
    with django_capture_on_commit_callbacks() as callbacks, pytest.raises(CommandError) as failed:
        delete("-f", QWEN, "--cascade", "--as", "olivia")
    assert failed.value.returncode == 1
    assert f"{QWEN}, document 1 (TokenPool 'qwen3-8b'): only platform operators" in str(failed.value)
    assert rows() == before and callbacks == []


def test_not_found_is_reported_and_an_error_only_when_nothing_was_found(tmp_path: Path) -> None:
    apply_examples()
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(entitlement_doc("ghost", "acme") + "---\n" + entitlement_doc("globex-spot", "globex"))
    out, err = delete("-f", str(mixed))
    assert out == ["TokenEntitlement/globex-spot deleted"] and "TokenEntitlement/ghost not found" in err
    with pytest.raises(CommandError, match="none of the objects") as none:
        delete("-f", str(mixed))
    assert none.value.returncode == 1
    out, err = delete("-f", str(mixed), "--ignore-not-found")
    assert out == [] and err == ""


def test_another_tenants_objects_are_not_found_for_a_user(tmp_path: Path) -> None:
    apply_examples()
    oscar = get_user_model().objects.create_user("oscar", password="x-pass-123")
    Membership.objects.create(tenant=Tenant.objects.get(slug="globex"), user=oscar, role=Role.OWNER)
    theirs = tmp_path / "theirs.yaml"
    theirs.write_text(entitlement_doc("acme-guaranteed", "acme"))
    with pytest.raises(CommandError, match="none of the objects"):
        delete("-f", str(theirs), "--as", "oscar")
    assert TokenEntitlement.objects.filter(name="acme-guaranteed").exists()


def test_dry_run_reports_the_same_and_deletes_nothing(django_capture_on_commit_callbacks: Any) -> None:
    apply_examples()
    before = rows()
    with django_capture_on_commit_callbacks() as callbacks:
        out, _err = delete("-f", DEMO, "-f", QWEN, "--dry-run")
    assert len(out) == 10 and all(line.endswith(" deleted (dry run)") for line in out)
    assert rows() == before and Replica.objects.count() == 2 and callbacks == []


def test_bad_input_names_the_file_and_exits_1(tmp_path: Path) -> None:
    apply_examples()
    before = rows()
    with pytest.raises(CommandError, match="cannot read .*nope.yaml: No such file") as missing:
        delete("-f", str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: [unclosed\n")
    with pytest.raises(CommandError, match="bad.yaml: ") as unparsable:
        delete("-f", str(bad))
    nameless = tmp_path / "nameless.yaml"
    nameless.write_text(f"{HEADER}kind: TokenPool\nmetadata: {{}}\n---\n{HEADER}kind: Pod\nmetadata: {{name: x}}\n")
    with pytest.raises(CommandError) as invalid:
        delete("-f", DEMO, "-f", str(nameless))  # the valid file is not deleted either
    assert f"{nameless}, document 0 (TokenPool ''): metadata.name: is required" in str(invalid.value)
    assert f"{nameless}, document 1 (Pod 'x'): kind: must be one of" in str(invalid.value)
    assert {e.value.returncode for e in (missing, unparsable, invalid)} == {1} and rows() == before
