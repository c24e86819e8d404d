"""REST twins of `apply --dry-run` and `diff`: ``POST /api/v1/apply?dryRun=true`` reports what applying would do
and writes nothing; ``POST /api/v1/diff`` answers per object the unified diff `manage.py diff` prints; both take
apply's bodies, permissions and errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from apps.pools.models import TokenEntitlement, TokenPool
from tests.pools.test_api_isolation import client_as
from tests.pools.test_apply_sources import rows

pytestmark = [pytest.mark.api, pytest.mark.django_db]

QWEN = (Path(settings.BASE_DIR) / "examples" / "qwen3-8b.yaml").read_text()


def test_dry_run_reports_what_apply_would_do_and_writes_nothing(admin: Any,
                                                                 django_capture_on_commit_callbacks: Any) -> None:
    client = client_as(admin)
    before = rows()
    with django_capture_on_commit_callbacks() as callbacks:
        dry = client.post("/api/v1/apply?dryRun=true", QWEN, content_type="application/yaml")
    assert dry.status_code == 200, dry.json()
    assert (dry.json()["created"], dry.json()["dryRun"]) == (3, True) and rows() == before and callbacks == []
    real = client.post("/api/v1/apply", QWEN, content_type="application/yaml")
    assert real.json()["created"] == 3 and real.json()["dryRun"] is False and TokenPool.objects.count() == 1
    assert client.post("/api/v1/apply?dryRun=All", QWEN, content_type="application/yaml").json()["unchanged"] == 3
    bad = client.post("/api/v1/apply?dryRun=maybe", QWEN, content_type="application/yaml")
    assert bad.status_code == 400 and "dryRun" in bad.json()


def test_diff_answers_the_changes_as_unified_diffs_and_writes_nothing(admin: Any) -> None:
    client = client_as(admin)
    new = client.post("/api/v1/diff", {"manifest": QWEN}, format="json")
    assert new.status_code == 200 and new.json()["changed"] is True and TokenPool.objects.count() == 0
    assert {(d["kind"], d["name"]) for d in new.json()["diffs"]} == {
        ("Tenant", "acme"), ("TokenPool", "qwen3-8b"), ("TokenEntitlement", "sample-entitlement")}
    client.post("/api/v1/apply", QWEN, content_type="application/yaml")
    same = client.post("/api/v1/diff", QWEN, content_type="application/yaml").json()
    assert same == {"changed": False, "unchanged": 3, "diffs": []}
    changed = client.post("/api/v1/diff", QWEN.replace("concurrency: 4", "concurrency: 6"),
                          content_type="application/yaml").json()
    assert [d["name"] for d in changed["diffs"]] == ["sample-entitlement"]
    assert "-    concurrency: 4\n+    concurrency: 6\n" in changed["diffs"][0]["diff"]
    assert TokenEntitlement.objects.get().concurrency == 4


def test_diff_has_applys_permissions_and_errors(admin: Any, owner: Any) -> None:
    forbidden = client_as(owner).post("/api/v1/diff", QWEN, content_type="application/yaml")
    assert forbidden.status_code == 403 and "superusers" in forbidden.json()["errors"][0]["message"]
    bad = client_as(admin).post("/api/v1/diff", "kind: TokenPool\n  oops: [", content_type="application/yaml")
    assert bad.status_code == 400 and "malformed YAML" in bad.json()["errors"][0]["message"]
    anonymous = APIClient().post("/api/v1/diff", QWEN, content_type="application/yaml")
    assert anonymous.status_code in (401, 403) and TokenPool.objects.count() == 0


def test_a_yaml_body_sent_as_curl_sends_it_by_default_is_applied(admin: Any) -> None:
    """`curl --data-binary @file.yaml` (the README's example) says application/x-www-form-urlencoded."""
    client = client_as(admin)
    form = "application/x-www-form-urlencoded"
    raw = client.post("/api/v1/apply?dryRun=true", QWEN, content_type=form)
    assert raw.status_code == 200 and raw.json()["created"] == 3, raw.json()
    # A real form still reads as a form; a bad YAML body still gets apply's error.
    posted = client.post("/api/v1/diff", urlencode({"manifest": QWEN}), content_type=form)
    assert posted.status_code == 200 and posted.json()["changed"] is True, posted.json()
    bad = client.post("/api/v1/apply", "kind: [unclosed", content_type=form)
    assert bad.status_code == 400 and bad.json()["errors"], bad.json()
    assert TokenPool.objects.count() == 0
