"""`GET /api/v1/audit/` and the UI's audit page: newest first, paginated, filtered (kind, object, actor, since,
through); a tenant's owners see their tenant's entries only, members and other tenants' owners none of them,
superusers everything; read-only; the page needs a login."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.audit.models import AuditEntry
from tests.pools.factories import make_entitlement
from tests.pools.test_api_isolation import client_as

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(admin: Any, acme: Any, globex: Any, owner: Any, member: Any, outsider: Any, pool: Any) -> None:
    make_entitlement(admin, acme, pool, "acme-g")
    make_entitlement(admin, globex, pool, "globex-g")


def listed(user: Any, query: str = "") -> list[dict[str, Any]]:
    response = client_as(user).get(f"/api/v1/audit/{query}")
    assert response.status_code == 200, response.content
    return response.json()["results"]


def test_owners_see_their_tenants_entries_only(world: None, admin: Any, owner: Any, member: Any,
                                                outsider: Any) -> None:
    mine = listed(owner, "?limit=500")
    assert mine and {e["tenant_slug"] for e in mine} == {"acme"}
    assert {"acme", "acme-g"} <= {e["object_name"] for e in mine}
    assert "globex-g" not in {e["object_name"] for e in mine}
    theirs = listed(outsider, "?limit=500")
    assert {e["tenant_slug"] for e in theirs} == {"globex"}
    assert listed(member) == []  # members read the tenant's objects, not who changed them
    everything = listed(admin, "?limit=500")
    assert {"TokenPool", "User", "Tenant", "TokenEntitlement"} <= {e["kind"] for e in everything}
    assert len(everything) == AuditEntry.objects.count()
    assert client_as(owner).get("/api/v1/audit/?tenant=globex").json()["results"] == []
    assert Client().get("/api/v1/audit/").status_code in (401, 403)


def test_newest_first_paginated_and_read_only(world: None, admin: Any) -> None:
    api = client_as(admin)
    page = api.get("/api/v1/audit/?limit=2").json()
    assert page["count"] == AuditEntry.objects.count() and len(page["results"]) == 2 and page["next"]
    ids = [e["id"] for e in listed(admin, "?limit=500")]
    assert ids == sorted(ids, reverse=True)
    assert api.get("/api/v1/audit/?limit=0").status_code == 400
    assert api.post("/api/v1/audit/", {}, format="json").status_code == 405
    assert api.delete(f"/api/v1/audit/{ids[0]}/").status_code in (404, 405)


def test_filters(world: None, admin: Any) -> None:
    client_as(admin).patch("/api/v1/entitlements/acme-g/", {"concurrency": 2}, format="json")
    only = listed(admin, "?kind=TokenEntitlement&object=acme-g")
    assert [e["action"] for e in only] == ["update", "create"]
    assert only[0]["before"] == {"concurrency": 4} and only[0]["after"] == {"concurrency": 2}
    assert {e["actor_username"] for e in listed(admin, "?actor=root&limit=500")} == {"root"}
    assert {e["through"] for e in listed(admin, "?through=api")} == {"api"}
    assert len(listed(admin, "?through=api")) == 1
    AuditEntry.objects.filter(object_name="acme").update(at=timezone.now() - timedelta(days=2))
    since = (timezone.now() - timedelta(days=1)).isoformat()
    recent = listed(admin, "?limit=500&since=" + since.replace("+", "%2B"))
    assert recent and "acme" not in {e["object_name"] for e in recent if e["kind"] == "Tenant"}
    api = client_as(admin)
    assert api.get("/api/v1/audit/?kind=Nope").status_code == 400
    assert api.get("/api/v1/audit/?since=yesterday").status_code == 400
    assert api.get("/api/v1/audit/?through=ftp").status_code == 400


def test_the_page_renders_with_filters_and_needs_a_login(world: None, owner: Any, outsider: Any) -> None:
    assert Client().get("/audit/").status_code == 302
    client = Client()
    client.force_login(owner)
    page = client.get("/audit/?kind=TokenEntitlement").content.decode()
    assert 'id="audit-entries"' in page and "acme-g" in page and "globex-g" not in page
    assert 'href="/audit/"' in page  # linked from the navigation
    other = Client()
    other.force_login(outsider)
    assert "acme-g" not in other.get("/audit/").content.decode()
    assert "No entries." in client.get("/audit/?object=nothing-here").content.decode()
