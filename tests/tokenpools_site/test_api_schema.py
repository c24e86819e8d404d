"""The OpenAPI schema at /api/schema/ documents what the API does (schemathesis checks the responses; this
checks the rules the schema class applies to every operation, so a new endpoint inherits them)."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

pytestmark = [pytest.mark.api, pytest.mark.django_db]


@pytest.fixture
def schema() -> dict[str, Any]:
    response = APIClient().get("/api/schema/?format=json")
    assert response.status_code == 200
    return response.json()


def _operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, ops in schema["paths"].items() for method, op in ops.items()]


def test_every_operation_documents_the_errors_it_can_answer(schema: dict[str, Any]) -> None:
    operations = _operations(schema)
    assert len(operations) >= 38
    for method, path, op in operations:
        codes = set(op["responses"])
        label = f"{method} {path}: {sorted(codes)}"
        assert "401" in codes, label
        assert ("403" in codes) == (method != "GET"), label
        assert ("404" in codes) == ("{" in path or path == "/api/v1/export"), label
        if "requestBody" in op:
            assert {"400", "415"} <= codes, label
        if any(p["name"] == "limit" for p in op.get("parameters", [])):
            assert "400" in codes, label
        assert not any(code.startswith("5") for code in codes), label
        for code in codes - {"200", "201", "204"}:
            assert op["responses"][code]["content"]["application/json"]["schema"], label


def test_deletes_a_service_may_refuse_document_their_400(schema: dict[str, Any]) -> None:
    assert "400" in schema["paths"]["/api/v1/pools/{name}/"]["delete"]["responses"]  # entitlements left
    assert "400" in schema["paths"]["/api/v1/memberships/{id}/"]["delete"]["responses"]  # last owner
    assert "400" not in schema["paths"]["/api/v1/keys/{id}/"]["delete"]["responses"]


def test_nullable_fields_are_marked_nullable(schema: dict[str, Any]) -> None:
    key = schema["components"]["schemas"]["ApiKey"]["properties"]
    assert key["created_by"].get("nullable") is True
    for field in ("expires_at", "revoked_at", "last_used_at"):
        assert key[field].get("nullable") is True, field
    assert key["prefix"].get("nullable") is not True


def test_pagination_and_filters_state_what_they_accept(schema: dict[str, Any]) -> None:
    params = {p["name"]: p for p in schema["paths"]["/api/v1/keys/"]["get"]["parameters"]}
    assert params["limit"]["schema"] == {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}
    assert params["offset"]["schema"] == {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
    assert params["status"]["schema"]["enum"] == ["active", "expired", "revoked"]
    # django-filter reads ?status= as no filter; pagination does not take an empty value.
    assert params["status"]["allowEmptyValue"] is True and "allowEmptyValue" not in params["limit"]
    history = {p["name"] for p in schema["paths"]["/api/v1/entitlements/{name}/history/"]["get"]["parameters"]}
    assert history == {"name", "limit", "offset"}


def test_key_deletion_is_described_as_revocation(schema: dict[str, Any]) -> None:
    description = schema["paths"]["/api/v1/keys/{id}/"]["delete"]["description"]
    assert "Revoke" in description and "404" in description and "status=revoked" in description
