"""`manage.py diff -f` (issue 27): what applying would change, as kubectl diff shows it: a unified diff per
object in the manifest's field names, exit 0 (no change), 1 (changes) or 2 (error), and nothing written."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, call_command

from apps.pools.models import TokenEntitlement
from apps.tenancy.models import Tenant
from tests.pools.test_apply_sources import EXAMPLES, rows

pytestmark = pytest.mark.django_db


def diff(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("diff", *args, stdout=out)
    except SystemExit as exit_:
        return int(exit_.code or 0), out.getvalue()
    return 0, out.getvalue()


def test_no_difference_after_apply_and_for_an_export(tmp_path: Path) -> None:
    call_command("apply", "-f", str(EXAMPLES), stdout=io.StringIO(), stderr=io.StringIO())
    assert diff("-f", str(EXAMPLES)) == (0, "")
    exported = tmp_path / "export.yaml"
    out = io.StringIO()
    call_command("export", stdout=out)
    exported.write_text(out.getvalue())
    assert diff("-f", str(exported)) == (0, "")


def test_a_change_is_a_unified_diff_in_manifest_field_names_and_nothing_is_written(tmp_path: Path) -> None:
    call_command("apply", "-f", str(EXAMPLES / "demo.yaml"), stdout=io.StringIO(), stderr=io.StringIO())
    docs = list(yaml.safe_load_all((EXAMPLES / "demo.yaml").read_text()))
    ent = next(d for d in docs if d["kind"] == "TokenEntitlement")
    name, before = ent["metadata"]["name"], ent["spec"]["resources"]["concurrency"]
    ent["spec"]["resources"]["concurrency"] = before + 1
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    counts = rows()
    code, text = diff("-f", str(changed))
    assert code == 1
    assert f"--- TokenEntitlement/{name} (stored)\n+++ TokenEntitlement/{name} (manifest)\n" in text
    assert f"-    concurrency: {before}\n" in text and f"+    concurrency: {before + 1}\n" in text
    assert text.count("--- ") == 1  # only the object that would change
    assert rows() == counts and TokenEntitlement.objects.get(name=name).concurrency == before


def test_a_new_object_is_all_additions_and_is_not_created(tmp_path: Path) -> None:
    code, text = diff("-f", str(EXAMPLES / "demo.yaml"))
    assert code == 1
    assert "--- Tenant/acme (stored)\n+++ Tenant/acme (manifest)\n" in text
    assert "+kind: Tenant\n" in text
    assert Tenant.objects.count() == 0 and TokenEntitlement.objects.count() == 0


def test_bad_input_exits_2_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: tokenpools.io/v1alpha1\nkind: TokenPool\nmetadata: {name: p}\nspec: {model: 3}\n")
    with pytest.raises(CommandError, match="bad.yaml") as raised:
        call_command("diff", "-f", str(bad), stdout=io.StringIO())
    assert raised.value.returncode == 2
    with pytest.raises(CommandError) as missing:
        call_command("diff", "-f", str(tmp_path / "nope.yaml"), stdout=io.StringIO())
    assert missing.value.returncode == 2


def test_the_command_line_exit_codes(tmp_path: Path, settings: Any) -> None:
    """Through manage.py itself: 1 for a difference (what CI scripts branch on), 2 for an error."""
    import subprocess
    import sys

    from tests.support.site import REPO

    env = {"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "PATH": "/usr/bin:/bin", "LOG_LEVEL": "WARNING"}
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=REPO, env=env, check=True,
                   capture_output=True)
    changed = subprocess.run([sys.executable, "manage.py", "diff", "-f", str(EXAMPLES / "demo.yaml")], cwd=REPO,
                             env=env, capture_output=True, text=True)
    assert changed.returncode == 1 and "+++ Tenant/acme (manifest)" in changed.stdout
    error = subprocess.run([sys.executable, "manage.py", "diff", "-f", str(tmp_path / "nope.yaml")], cwd=REPO,
                           env=env, capture_output=True, text=True)
    assert error.returncode == 2 and "nope.yaml" in error.stderr
