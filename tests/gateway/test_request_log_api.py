"""GET /api/v1/requests/ (issue 26): the request log, tenant-scoped (owner, member, outsider, operator),
filtered by time, entitlement and outcome, paginated; `?format=jsonl` streams the filtered window."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from rest_framework.test import APIClient

from apps.gateway.request_log import Entry, request_log_write

pytestmark = [pytest.mark.api, pytest.mark.django_db]

T0 = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC).timestamp()


def _entry(request_id: str, tenant: Any, entitlement: str, outcome: str, minutes: int) -> Entry:
    reason = "" if outcome == "served" else "concurrency_limit_exceeded"
    return Entry(request_id, T0 + minutes * 60 + 0.123, tenant.pk, "tiny", entitlement, "guaranteed",
                 "guaranteed" if outcome == "served" else "", outcome == "served", 5, 16, 7 if outcome == "served" else 0,
                 outcome, reason, 0.0, 40.0 if outcome == "served" else None, 55.5)


@pytest.fixture
def records(acme: Any, globex: Any) -> None:
    request_log_write([
        _entry("req_a1", acme, "acme-chat", "served", 0),
        _entry("req_a2", acme, "acme-chat", "rejected", 1),
        _entry("req_a3", acme, "acme-batch", "served", 2),
        _entry("req_g1", globex, "globex-chat", "served", 1),
    ])


def _client(user: Any) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _ids(user: Any, **params: Any) -> list[str]:
    response = _client(user).get("/api/v1/requests/", params)
    assert response.status_code == 200, response.content
    return [r["request_id"] for r in response.json()["results"]]


def test_each_persona_sees_its_tenants_records_only(records: None, owner: Any, member: Any, outsider: Any,
                                                    admin: Any) -> None:
    assert _ids(owner) == ["req_a1", "req_a2", "req_a3"]
    assert _ids(member) == ["req_a1", "req_a2", "req_a3"]
    assert _ids(outsider) == ["req_g1"]  # globex's owner
    assert _ids(admin) == ["req_a1", "req_a2", "req_g1", "req_a3"]  # by arrival
    assert APIClient().get("/api/v1/requests/").status_code in (401, 403)


def test_a_record_reads_as_the_gateway_wrote_it(records: None, owner: Any) -> None:
    first = _client(owner).get("/api/v1/requests/", {"limit": 1}).json()
    assert first["count"] == 3 and first["next"]
    assert first["results"] == [{
        "request_id": "req_a1", "arrived_at": "2026-11-26T12:00:00.123000Z", "tenant": "acme", "pool": "tiny",
        "entitlement": "acme-chat", "service_class": "guaranteed", "service_tier": "guaranteed", "stream": True,
        "prompt_tokens": 5, "max_tokens": 16, "completion_tokens": 7, "outcome": "served", "reason": "",
        "queue_ms": 0.0, "ttft_ms": 40.0, "duration_ms": 55.5,
    }]


def test_filters_by_time_entitlement_and_outcome(records: None, admin: Any) -> None:
    assert _ids(admin, since="2026-11-26T12:01:00Z") == ["req_a2", "req_g1", "req_a3"]
    assert _ids(admin, since="2026-11-26T12:01:00Z", until="2026-11-26T12:02:00Z") == ["req_a2", "req_g1"]
    assert _ids(admin, entitlement="acme-chat") == ["req_a1", "req_a2"]
    assert _ids(admin, outcome="rejected") == ["req_a2"]
    assert _ids(admin, entitlement="acme-chat", outcome="served") == ["req_a1"]


def test_bad_filters_are_field_errors(records: None, admin: Any) -> None:
    client = _client(admin)
    response = client.get("/api/v1/requests/", {"since": "yesterday", "until": "2026-13-01"})
    assert response.status_code == 400
    assert set(response.json()) == {"since", "until"}
    response = client.get("/api/v1/requests/", {"outcome": "won"})
    assert response.status_code == 400 and "outcome" in response.json()
    unknown = client.get("/api/v1/requests/", {"format": "csv"})
    assert unknown.status_code == 400 and "format" in unknown.json()
    jsonl = client.get("/api/v1/requests/", {"format": "jsonl", "since": "nope"})
    assert jsonl.status_code == 400 and "since" in json.loads(jsonl.content)


def test_jsonl_streams_the_filtered_window(records: None, owner: Any) -> None:
    response = _client(owner).get("/api/v1/requests/", {"format": "jsonl", "until": "2026-11-26T12:02:00Z"})
    assert response.status_code == 200
    assert response["Content-Type"] == "application/x-ndjson"
    assert response.streaming
    lines = b"".join(response.streaming_content).decode().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["request_id"] for r in rows] == ["req_a1", "req_a2"]  # acme's only, before 12:02
    assert rows[0]["tenant"] == "acme" and rows[0]["arrived_at"] == "2026-11-26T12:00:00.123000Z"
    assert rows[1]["outcome"] == "rejected" and rows[1]["ttft_ms"] is None
