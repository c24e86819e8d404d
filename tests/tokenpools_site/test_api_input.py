"""Bad input to the REST API is a 4xx, never a 500, on SQLite and on PostgreSQL (`make test-postgres`).

Every list validates ``limit`` and ``offset`` (one pagination class for all); NUL characters, which
PostgreSQL cannot store or compare, are refused before any lookup; a URL no route matches is a JSON 404.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from apps.gateway.models import RequestLogRecord, UsageRecord
from apps.tenancy.apiutils import ApiPagination
from apps.tenancy.models import Membership
from apps.tenancy.services import apikey_create
from tests.pools.factories import make_entitlement
from tests.pools.test_api_isolation import client_as

pytestmark = [pytest.mark.api, pytest.mark.django_db]

LISTS = [
    "/api/v1/tenants/",
    "/api/v1/users/",
    "/api/v1/memberships/",
    "/api/v1/pools/",
    "/api/v1/entitlements/",
    "/api/v1/entitlements/acme-g/history/",
    "/api/v1/keys/",
    "/api/v1/usage/",
    "/api/v1/audit/",
    "/api/v1/requests/",
]

BAD_LIMITS = ["abc", "-1", "0", "1.5", " 7", "+7", "7_0", "\u0663", "", "501", "9223372036854775808",
              "1" * 400]
BAD_OFFSETS = ["-1", "x", "0x10", "2147483648", "9223372036854775808", "99999999999999999999999999"]


@pytest.fixture
def root(admin: Any, owner: Any, acme: Any, pool: Any) -> APIClient:
    ent = make_entitlement(admin, acme, pool, "acme-g")
    apikey_create(actor=owner, entitlement=ent)
    UsageRecord.objects.create(tenant=acme, entitlement="acme-g", minute=timezone.now().replace(second=0),
                               requests=1)
    RequestLogRecord.objects.create(request_id="req_1", arrived_at=timezone.now(), tenant=acme, pool=pool.name,
                                    entitlement="acme-g", service_class="guaranteed", outcome="served")
    return client_as(admin)


def test_the_lists_here_are_every_list_of_the_schema(root: APIClient) -> None:
    schema = root.get("/api/schema/?format=json").json()
    paginated = {
        path.replace("{name}", "acme-g")
        for path, operations in schema["paths"].items()
        for operation in operations.values()
        if any(p["name"] == "limit" for p in operation.get("parameters", []))
    }
    assert paginated == set(LISTS)


@pytest.mark.parametrize("path", LISTS)
def test_every_list_refuses_a_bad_limit_or_offset_with_a_field_error(root: APIClient, path: str) -> None:
    assert root.get(path).status_code == 200
    for name, values in (("limit", BAD_LIMITS), ("offset", BAD_OFFSETS)):
        for value in values:
            response = root.get(path, {name: value})
            assert response.status_code == 400, (path, name, value, response.content[:200])
            body = response.json()
            assert list(body) == [name] and isinstance(body[name], list) and body[name][0]
    twice = root.get(f"{path}?limit=1&limit=2")
    assert twice.status_code == 400 and "limit" in twice.json()


@pytest.mark.parametrize("path", LISTS)
def test_every_list_takes_the_bounds_themselves(root: APIClient, path: str) -> None:
    everything = root.get(path, {"limit": ApiPagination.max_limit}).json()
    assert everything["count"] >= 1 and len(everything["results"]) == everything["count"]
    one = root.get(path, {"limit": 1, "offset": 0}).json()
    assert len(one["results"]) == 1 and one["results"][0] == everything["results"][0]
    far = root.get(path, {"offset": ApiPagination.max_offset}).json()
    assert far["results"] == [] and far["count"] == everything["count"]


def test_a_page_holds_50_by_default_and_at_most_500(admin: Any, acme: Any) -> None:
    for i in range(60):
        Membership.objects.create(tenant=acme, user=type(admin).objects.create_user(f"user{i:02d}"))
    client = client_as(admin)
    first = client.get("/api/v1/memberships/").json()
    assert first["count"] == 60 and len(first["results"]) == 50 and "offset=50" in first["next"]
    assert len(client.get("/api/v1/memberships/?limit=500").json()["results"]) == 60


def test_nul_characters_in_a_body_are_a_400_not_a_database_error(root: APIClient, globex: Any) -> None:
    for content_type in ("json", "multipart"):
        response = root.post("/api/v1/memberships/", {"tenant": "acme\x00", "user": "olivia", "role": "owner"},
                             format=content_type)
        assert response.status_code == 400, response.content[:300]
        assert "NUL" in response.json()["detail"]
    form = root.post("/api/v1/auth/token", "username=olivia%00&password=x",
                     content_type="application/x-www-form-urlencoded")
    assert form.status_code == 400 and "NUL" in form.json()["detail"]
    yaml = root.post("/api/v1/apply", "kind: TokenPool\x00", content_type="application/yaml")
    assert yaml.status_code == 400 and "NUL" in yaml.json()["errors"][0]["message"]
    assert Membership.objects.filter(tenant__slug="globex").count() == 0


@pytest.mark.parametrize("path", ["/api/v1/tenants/ac%00me/", "/api/v1/pools/qwen3-8b%00/",
                                  "/api/v1/entitlements/acme-g%00/history/", "/api/v1/export?tenant=acme%00"])
def test_nul_characters_in_a_path_or_query_name_nothing(root: APIClient, path: str) -> None:
    response = root.get(path)
    assert response.status_code == 404 and response["content-type"] == "application/json"


@pytest.mark.parametrize("path", ["/api/v1/keys/1.5/", "/api/v1/usage/-3e7/", "/api/v1/no-such-thing/"])
def test_a_url_no_route_matches_is_a_json_404(root: APIClient, path: str) -> None:
    response = root.get(path)
    assert response.status_code == 404
    assert response.json() == {"detail": "Not found."}


def test_pages_outside_the_api_keep_their_html_404(root: APIClient) -> None:
    response = root.get("/no-such-page/")
    assert response.status_code == 404 and response["content-type"].startswith("text/html")


@pytest.mark.parametrize(("query", "status"), [
    ("since=0510-02-25T18:33:04-21:56", 200),  # an offset PostgreSQL refuses, taken as the same time in UTC
    ("until=2030-01-01T00:00:00%2B14:00", 200),
    ("since=0001-01-01T00:00:00%2B05:00", 400),  # before year 1 once in UTC
    ("until=9999-12-31T23:00:00-05:00", 400),  # after 9999 once in UTC
    ("since=yesterday", 400),
])
def test_usage_time_filters_take_any_offset_and_refuse_times_off_the_calendar(root: APIClient, query: str,
                                                                              status: int) -> None:
    response = root.get(f"/api/v1/usage/?{query}")
    assert response.status_code == status, response.content[:300]
    if status == 400:
        assert list(response.json()) == [query.split("=")[0]]
    else:
        assert response.json()["count"] == 1  # the one record, of now
