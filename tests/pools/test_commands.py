"""Operator commands: apply, export, create_key and seed_demo."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from apps.pools.models import TokenEntitlement, TokenPool
from apps.tenancy.models import ApiKey, Membership
from apps.tenancy.selectors import apikey_resolve

EXAMPLES = Path(settings.BASE_DIR) / "examples"


def run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.mark.django_db
def test_apply_and_export_commands_round_trip(acme: Any, tmp_path: Path) -> None:
    out, err = run("apply", "-f", str(EXAMPLES / "qwen3-8b.yaml"))
    # The fixture's acme has another name and no quota: the example's Tenant replaces them.
    assert out.splitlines() == ["Tenant/acme updated (fields: spec.displayName, spec.quota.amount, "
                                "spec.quota.currency, spec.quota.window)", "TokenPool/qwen3-8b created",
                                "TokenEntitlement/sample-entitlement created"]
    assert "2 created, 1 updated" in err
    target = tmp_path / "export.yaml"
    run("export", "-o", str(target))
    out, _ = run("apply", "-f", str(target))
    assert out.splitlines() == ["Tenant/acme unchanged", "TokenPool/qwen3-8b unchanged",
                                "TokenEntitlement/sample-entitlement unchanged"]
    out, _ = run("export", "--tenant", "acme")
    assert "sample-entitlement" in out and "qwen3-8b" in out


@pytest.mark.django_db
def test_apply_command_refuses_bad_input_with_nonzero_exit(acme: Any, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "qwen3-8b.yaml").read_text().replace("serviceClass: guaranteed", "serviceClass: gold"))
    with pytest.raises(CommandError, match=r"bad.yaml, document 2 \(TokenEntitlement 'sample-entitlement'\)"
                                           r": spec.qos.serviceClass: unknown service class 'gold'"):
        run("apply", "-f", str(bad))
    # With several files, the error points at the file and its own document number.
    with pytest.raises(CommandError, match=r"bad.yaml, document 2 "):
        run("apply", "-f", str(EXAMPLES / "demo.yaml"), "-f", str(bad))
    (tmp_path / "broken.yaml").write_text("spec: [")
    with pytest.raises(CommandError, match="malformed YAML"):
        run("apply", "-f", str(tmp_path / "broken.yaml"))
    with pytest.raises(CommandError, match="cannot read"):
        run("apply", "-f", str(tmp_path / "missing.yaml"))
    assert TokenPool.objects.count() == 0
    with pytest.raises(CommandError, match="unknown tenant"):
        run("export", "--tenant", "nobody")


@pytest.mark.django_db
def test_apply_as_a_member_is_refused(acme: Any, member: Any, tmp_path: Path) -> None:
    run("apply", "-f", str(EXAMPLES / "qwen3-8b.yaml"))
    text = (EXAMPLES / "qwen3-8b.yaml").read_text().replace("tokensPerSecond: 100", "tokensPerSecond: 50")
    path = tmp_path / "entitlement.yaml"
    path.write_text(text.split("---")[-1])  # the entitlement alone
    with pytest.raises(CommandError, match="owners"):
        run("apply", "-f", str(path), "--as", "mark")
    with pytest.raises(CommandError, match="no active user"):
        run("apply", "-f", str(path), "--as", "ghost")
    assert TokenEntitlement.objects.get().tokens_per_second == 100


@pytest.mark.django_db
def test_create_key_prints_only_the_secret(acme: Any) -> None:
    run("apply", "-f", str(EXAMPLES / "qwen3-8b.yaml"))
    out, _ = run("create_key", "--entitlement", "sample-entitlement")
    secret = out.strip()
    assert out.count("\n") == 1 and secret.startswith("tp-") and len(secret) > 40
    key = apikey_resolve(secret=secret)
    assert key is not None and key.entitlement.name == "sample-entitlement"
    assert secret not in (key.secret_hash, key.prefix) and secret.startswith(key.prefix)
    with pytest.raises(CommandError, match="no entitlement"):
        run("create_key", "--entitlement", "nope")
    with pytest.raises(CommandError, match="positive"):
        run("create_key", "--entitlement", "sample-entitlement", "--expires-in-days", "0")


@pytest.mark.django_db
@override_settings(TOKENPOOLS_ADMIN_PASSWORD="admin-pass-for-tests", TOKENPOOLS_DEMO_PASSWORD="")
def test_seed_demo_is_idempotent() -> None:
    out, _ = run("seed_demo")
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.check_password("admin-pass-for-tests")
    assert "admin-pass-for-tests" not in out
    assert set(Membership.objects.values_list("tenant__slug", "user__username", "role")) == {
        ("acme", "acme-owner", "owner"), ("globex", "globex-owner", "owner")}
    pool = TokenPool.objects.get()
    assert (pool.backend_kind, pool.capacity().slots, pool.replicas.get().url) == ("virtual", 16,
                                                                                   "http://127.0.0.1:8100")
    classes = set(TokenEntitlement.objects.values_list("service_class", flat=True))
    assert {"guaranteed", "elastic", "spot", "preemptible"} <= classes
    assert set(TokenEntitlement.objects.values_list("state", flat=True)) == {"Bound"}
    secrets = [line.rsplit(" ", 1)[1] for line in out.splitlines() if line.startswith("API key for")]
    assert len(secrets) == TokenEntitlement.objects.count() == ApiKey.objects.count()
    assert all(apikey_resolve(secret=s) is not None for s in secrets)

    again, _ = run("seed_demo")
    assert ApiKey.objects.count() == len(secrets)
    assert "tp-" not in again and "already exists" in again
    assert again.count("unchanged") == 3 + TokenEntitlement.objects.count()  # 2 tenants, the pool, the entitlements


@pytest.mark.django_db
@override_settings(TOKENPOOLS_ADMIN_PASSWORD="")
def test_seed_demo_generates_and_prints_a_password_once() -> None:
    out, _ = run("seed_demo")
    line = next(line for line in out.splitlines() if line.startswith("created superuser admin"))
    password = line.rsplit(" ", 1)[1]
    assert get_user_model().objects.get(username="admin").check_password(password)
    again, _ = run("seed_demo")
    assert password not in again


@pytest.mark.django_db
@override_settings(TOKENPOOLS_ADMIN_PASSWORD="admin-pass-for-tests")
def test_seed_demo_write_keys_writes_valid_keys_once_with_mode_0600(tmp_path: Path) -> None:
    import json
    import stat

    keys_file = tmp_path / "var" / "demo-keys.json"
    out, _ = run("seed_demo", "--write-keys", str(keys_file))
    keys = json.loads(keys_file.read_text())
    assert set(keys) == set(TokenEntitlement.objects.values_list("name", flat=True))
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    for name, secret in keys.items():
        key = apikey_resolve(secret=secret)
        assert key is not None and key.entitlement.name == name
    # Still hashed at rest: no secret appears in the key table.
    assert not ApiKey.objects.filter(secret_hash__in=list(keys.values())).exists()

    # A second run finds every key in the file: nothing new, the file keeps its keys.
    again, _ = run("seed_demo", "--write-keys", str(keys_file))
    assert "tp-" not in again and ApiKey.objects.count() == len(keys)
    assert json.loads(keys_file.read_text()) == keys

    # A key lost from the file (or from a database seeded without --write-keys) is replaced by a new one.
    del keys["globex-spot"]
    keys_file.write_text(json.dumps(keys))
    run("seed_demo", "--write-keys", str(keys_file))
    refreshed = json.loads(keys_file.read_text())
    assert {k: v for k, v in refreshed.items() if k != "globex-spot"} == keys
    assert apikey_resolve(secret=refreshed["globex-spot"]).entitlement.name == "globex-spot"
    assert ApiKey.objects.count() == len(refreshed) + 1


@pytest.mark.django_db
@override_settings(TOKENPOOLS_ADMIN_PASSWORD="admin-pass-for-tests")
def test_seed_demo_without_write_keys_writes_no_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    run("seed_demo")
    assert list(tmp_path.rglob("*")) == []


def test_a_generated_demo_password_never_reads_as_an_option() -> None:
    # Without the guard about 1 in 64 start with "-": 500 draws would show one with near certainty.
    from apps.pools.management.commands.seed_demo import generated_password

    passwords = [generated_password() for _ in range(500)]
    assert not any(p.startswith("-") for p in passwords)
    assert len(set(passwords)) == 500 and all(len(p) == 16 for p in passwords)
