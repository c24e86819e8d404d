"""Manifests are bounded: a YAML alias bomb, an oversized body, a deeply nested document and long values are
refused with small errors that name the document (REST as a plain member, and the CLI), never expanded."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from apps.pools.manifests import ManifestError, manifests_apply, manifests_parse
from apps.pools.manifests.limits import EXCERPT_CHARS, MAX_DEPTH, MAX_ISSUES, excerpt
from apps.tenancy.services import SYSTEM
from bench.manifest_bomb import bomb
from tests.pools.test_api_isolation import client_as

# 9**8 = 43 million strings once expanded: before aliases were refused, a 312 MB error answer.
BOMB = bomb(8)


def _nested(depth: int) -> str:
    return "apiVersion: tokenpools.io/v1alpha1\nkind: Tenant\nmetadata:\n  name: deep\n  labels:\n    x: " + \
        "[" * depth + "]" * depth + "\n"


@pytest.mark.django_db
def test_alias_bomb_is_a_small_400_naming_the_document_for_a_member(member: Any) -> None:
    response = client_as(member).post("/api/v1/apply", BOMB, content_type="application/yaml")
    assert response.status_code == 400
    assert len(response.content) < 500
    (issue,) = response.json()["errors"]
    assert issue["index"] == 0
    assert "YAML aliases (*a) are not accepted" in issue["message"] and "line 2" in issue["message"]


@pytest.mark.django_db
def test_alias_bomb_through_the_cli_exits_nonzero_with_a_short_message(member: Any, tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text("kind: Tenant\n---\n" + BOMB)  # the bomb is the second document
    with pytest.raises(CommandError) as caught:
        call_command("apply", "-f", str(path), "--as", "mark", stdout=io.StringIO(), stderr=io.StringIO())
    assert caught.value.returncode == 1
    message = str(caught.value)
    assert message.startswith(f"{path}: document 1: YAML aliases") and len(message) < 300


def test_an_anchor_without_alias_is_fine_and_a_merge_key_is_an_alias() -> None:
    assert manifests_parse("a: &x 1\nb: 2\n") == [{"a": 1, "b": 2}]
    with pytest.raises(ManifestError, match="aliases"):
        manifests_parse("base: &b {x: 1}\nother:\n  <<: *b\n")


@pytest.mark.django_db
def test_oversized_body_is_413_before_it_is_read(member: Any, settings: Any) -> None:
    settings.MANIFEST_MAX_BYTES = 1000
    client = client_as(member)
    text = "# padding\n" * 150
    for response in (client.post("/api/v1/apply", text, content_type="application/yaml"),
                     client.post("/api/v1/apply", {"manifest": text}, format="json")):
        assert response.status_code == 413
        (issue,) = response.json()["errors"]
        assert "the limit is 1000 bytes (MANIFEST_MAX_BYTES)" in issue["message"]
    # Just under the limit it is read (and refused for what it says, not for its size).
    assert client.post("/api/v1/apply", text[:990], content_type="application/yaml").status_code == 400


@pytest.mark.django_db
def test_oversized_file_is_refused_by_the_cli_naming_the_file(acme: Any, settings: Any, tmp_path: Path) -> None:
    settings.MANIFEST_MAX_BYTES = 1000
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * 150)
    with pytest.raises(CommandError, match=rf"^{path}: larger than the limit of 1000 bytes \(MANIFEST_MAX_BYTES\)$"):
        call_command("apply", "-f", str(path), stdout=io.StringIO(), stderr=io.StringIO())


@pytest.mark.django_db
@pytest.mark.parametrize("depth", [MAX_DEPTH, 5000])
def test_deeply_nested_yaml_is_a_400_naming_the_document(member: Any, depth: int) -> None:
    response = client_as(member).post("/api/v1/apply", "kind: Tenant\n---\n" + _nested(depth),
                                      content_type="application/yaml")
    assert response.status_code == 400
    (issue,) = response.json()["errors"]
    assert issue["index"] == 1 and issue["message"].startswith(f"nested deeper than {MAX_DEPTH} levels")


@pytest.mark.django_db
def test_deeply_nested_json_is_a_400(member: Any) -> None:
    client = client_as(member)
    doc = {"apiVersion": "tokenpools.io/v1alpha1", "kind": "Tenant", "metadata": {"name": "x", "labels": {}}}
    inner: Any = doc["metadata"]["labels"]
    for _ in range(MAX_DEPTH):
        inner["x"] = {}
        inner = inner["x"]
    response = client.post("/api/v1/apply", {"documents": [{"kind": "Tenant"}, doc]}, format="json")
    assert response.status_code == 400
    assert response.json()["errors"][0]["index"] == 1
    assert response.json()["errors"][0]["message"] == f"nested deeper than {MAX_DEPTH} levels"
    # Deeper than Python's own recursion limit: refused by the body parser, not a RecursionError (a 500).
    deep = '{"documents": [' + "[" * 5000 + "]" * 5000 + "]}"
    response = client.post("/api/v1/apply", deep, content_type="application/json")
    assert response.status_code == 400 and "nested deeper than" in response.json()["detail"]


@pytest.mark.django_db
def test_long_values_are_quoted_as_short_excerpts(acme: Any, member: Any) -> None:
    long = "v" * 100_000
    text = f"apiVersion: {long}\nkind: TokenEntitlement\nmetadata: {{name: {'n' * 100_000}}}\nspec: {{}}\n"
    response = client_as(member).post("/api/v1/apply", text, content_type="application/yaml")
    assert response.status_code == 400 and len(response.content) < 2000  # a 200 kB document, ~10 issues
    issue = response.json()["errors"][0]
    assert issue["field"] == "apiVersion"
    assert issue["message"].startswith("must be 'tokenpools.io/v1alpha1', got 'vvvv") and issue["message"].endswith("…'")
    assert len(issue["message"]) < 2 * EXCERPT_CHARS
    assert len(issue["name"]) == EXCERPT_CHARS and issue["name"].endswith("…")
    with pytest.raises(ManifestError) as caught:
        manifests_apply(actor=SYSTEM, documents=[{"apiVersion": "tokenpools.io/v1alpha1", "kind": "Tenant",
                                                  "metadata": {"name": "t"}, "spec": {"displayName": [long] * 1000}}])
    assert "must be a string, got ['vvv" in str(caught.value) and len(str(caught.value)) < 300


def test_excerpt_never_builds_the_whole_repr() -> None:
    assert excerpt("short") == "'short'"
    assert len(excerpt(list(range(10**6)))) <= EXCERPT_CHARS
    assert "integer of" in excerpt(10**5000)  # repr() itself raises past 4,300 digits


@pytest.mark.django_db
def test_problems_past_the_cap_are_counted_not_listed(member: Any) -> None:
    doc = {"apiVersion": "tokenpools.io/v1alpha1", "kind": "Tenant", "metadata": {"name": "t"},
           "spec": {f"typo{i}": 1 for i in range(5000)}}
    response = client_as(member).post("/api/v1/apply", json.dumps([doc]), content_type="application/json")
    errors = response.json()["errors"]
    assert response.status_code == 400 and len(errors) == MAX_ISSUES + 1
    assert errors[-1]["message"] == "more problems left out"


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["2024-13-45", "9" * 5000])
def test_values_yaml_cannot_build_are_malformed_yaml_not_a_500(member: Any, value: str) -> None:
    response = client_as(member).post("/api/v1/apply", f"a: {value}\n", content_type="application/yaml")
    assert response.status_code == 400
    assert response.json()["errors"][0]["message"].startswith("malformed YAML")


@pytest.mark.django_db
def test_an_empty_list_of_documents_is_refused(member: Any) -> None:
    client = client_as(member)
    response = client.post("/api/v1/apply", {"documents": []}, format="json")
    assert response.status_code == 400 and "documents" in response.json()
    response = client.post("/api/v1/apply", [], format="json")
    assert response.status_code == 400 and response.json()["errors"][0]["message"] == "no documents found"
