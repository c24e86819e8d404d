"""Owner / member / outsider isolation on every REST endpoint (token auth, as scripts use it).

acme has an owner (olivia) and a member (mark); the outsider (oscar) owns globex. Objects of a tenant the
user does not belong to answer 404; visible objects the user may not change answer 403.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from apps.pools.models import TokenEntitlement
from apps.tenancy.models import ApiKey, Membership
from apps.tenancy.services import apikey_create
from tests.pools.factories import make_entitlement

pytestmark = [pytest.mark.api, pytest.mark.django_db]

ENT_DOC = """
apiVersion: tokenpools.io/v1alpha1
kind: TokenEntitlement
metadata: {name: acme-from-apply}
spec:
  tenantId: acme
  poolRef: {name: qwen3-8b}
  qos: {serviceClass: spot, sloTargetMs: 500}
  resources: {tokensPerSecond: 10, kvCacheGiB: 1, concurrency: 1}
"""
POOL_DOC = """
apiVersion: tokenpools.io/v1alpha1
kind: TokenPool
metadata: {name: another-pool}
spec:
  model: m
  backend: {kind: virtual, replicas: [{url: "http://127.0.0.1:8100"}]}
  capacityPerReplica: {slots: 4, tokensPerSecond: 100, kvCacheGiB: 1}
  kvGeometry: {layers: 2, kvHeads: 2, headDim: 64, bytesPerElement: 2}
"""


@dataclass
class World:
    owner_key: ApiKey
    member_key: ApiKey
    member_membership: Membership
    users: dict[str, Any]


@pytest.fixture
def world(admin: Any, acme: Any, globex: Any, owner: Any, member: Any, outsider: Any, pool: Any) -> World:
    ent = make_entitlement(admin, acme, pool, "acme-g", "guaranteed")
    globex_ent = make_entitlement(admin, globex, pool, "globex-e", "elastic")
    apikey_create(actor=outsider, entitlement=globex_ent)
    owner_key, _ = apikey_create(actor=owner, entitlement=ent, name="owner's")
    member_key, _ = apikey_create(actor=member, entitlement=ent, name="member's")
    return World(owner_key, member_key, Membership.objects.get(user=member),
                 {"owner": owner, "member": member, "outsider": outsider, "admin": admin})


def client_as(user: Any) -> APIClient:
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


@dataclass(frozen=True)
class Case:
    method: str
    url: Callable[[World], str]
    body: Any = None
    owner: int = 200
    member: int = 200
    outsider: int = 404
    content_type: str | None = None


CASES: dict[str, Case] = {
    "tenant-get": Case("get", lambda w: "/api/v1/tenants/acme/"),
    "tenant-patch": Case("patch", lambda w: "/api/v1/tenants/acme/", {"name": "x"}, 403, 403, 404),
    "tenant-delete": Case("delete", lambda w: "/api/v1/tenants/acme/", None, 403, 403, 404),
    "tenant-create": Case("post", lambda w: "/api/v1/tenants/", {"slug": "new", "name": "New"}, 403, 403, 403),
    "user-get": Case("get", lambda w: f"/api/v1/users/{w.users['member'].pk}/"),
    "user-create": Case("post", lambda w: "/api/v1/users/", {"username": "zed", "password": "long-pass-987"},
                        403, 403, 403),
    "membership-get": Case("get", lambda w: f"/api/v1/memberships/{w.member_membership.pk}/"),
    "membership-patch": Case("patch", lambda w: f"/api/v1/memberships/{w.member_membership.pk}/",
                             {"role": "owner"}, 200, 403, 404),
    "membership-delete": Case("delete", lambda w: f"/api/v1/memberships/{w.member_membership.pk}/", None,
                              204, 403, 404),
    "membership-create": Case("post", lambda w: "/api/v1/memberships/",
                              {"tenant": "acme", "user": "root", "role": "member"}, 201, 403, 400),
    "pool-get": Case("get", lambda w: "/api/v1/pools/qwen3-8b/", None, 200, 200, 200),
    "pool-patch": Case("patch", lambda w: "/api/v1/pools/qwen3-8b/", {"slots_per_replica": 8}, 403, 403, 403),
    "pool-delete": Case("delete", lambda w: "/api/v1/pools/qwen3-8b/", None, 403, 403, 403),
    "pool-create": Case("post", lambda w: "/api/v1/pools/", {"name": "p2"}, 403, 403, 403),
    "entitlement-get": Case("get", lambda w: "/api/v1/entitlements/acme-g/"),
    "entitlement-history": Case("get", lambda w: "/api/v1/entitlements/acme-g/history/"),
    "entitlement-patch": Case("patch", lambda w: "/api/v1/entitlements/acme-g/", {"concurrency": 5}, 200, 403, 404),
    "entitlement-put": Case("put", lambda w: "/api/v1/entitlements/acme-g/", {
        "name": "acme-g", "tenant": "acme", "pool": "qwen3-8b", "service_class": "elastic", "slo_target_ms": 300,
        "tokens_per_second": 50, "kv_cache_gib": "1.5", "concurrency": 2}, 200, 403, 404),
    "entitlement-delete": Case("delete", lambda w: "/api/v1/entitlements/acme-g/", None, 204, 403, 404),
    "entitlement-create": Case("post", lambda w: "/api/v1/entitlements/", {
        "name": "acme-new", "tenant": "acme", "pool": "qwen3-8b", "service_class": "spot", "slo_target_ms": 300,
        "tokens_per_second": 50, "kv_cache_gib": "1", "concurrency": 2}, 201, 403, 400),
    "key-get": Case("get", lambda w: f"/api/v1/keys/{w.owner_key.pk}/"),
    "key-create": Case("post", lambda w: "/api/v1/keys/", {"entitlement": "acme-g", "name": "ci"}, 201, 201, 400),
    "key-revoke-owners": Case("post", lambda w: f"/api/v1/keys/{w.owner_key.pk}/revoke/", None, 200, 403, 404),
    "key-revoke-members": Case("post", lambda w: f"/api/v1/keys/{w.member_key.pk}/revoke/", None, 200, 200, 404),
    "key-delete-owners": Case("delete", lambda w: f"/api/v1/keys/{w.owner_key.pk}/", None, 204, 403, 404),
    "apply-entitlement": Case("post", lambda w: "/api/v1/apply", ENT_DOC, 200, 403, 400, "application/yaml"),
    "apply-pool": Case("post", lambda w: "/api/v1/apply", POOL_DOC, 403, 403, 403, "application/yaml"),
    "export-tenant": Case("get", lambda w: "/api/v1/export?tenant=acme"),
}


def _snapshot() -> tuple:
    """What a forbidden request must leave untouched."""
    return (
        sorted(TokenEntitlement.objects.values_list("name", "concurrency", "service_class")),
        sorted(ApiKey.objects.values_list("id", "revoked_at")),
        sorted(Membership.objects.values_list("id", "role")),
    )


@pytest.mark.parametrize("persona", ["owner", "member", "outsider"])
@pytest.mark.parametrize("case_name", list(CASES))
def test_endpoint_isolation(world: World, persona: str, case_name: str) -> None:
    case = CASES[case_name]
    client = client_as(world.users[persona])
    before = _snapshot()
    kwargs: dict[str, Any] = {}
    if case.body is not None:
        kwargs = {"data": case.body, "content_type": case.content_type} if case.content_type else \
            {"data": case.body, "format": "json"}
    response = getattr(client, case.method)(case.url(world), **kwargs)
    expected = getattr(case, persona)
    assert response.status_code == expected, response.content[:500]
    if expected >= 400 and case.method != "get":
        assert _snapshot() == before


@pytest.mark.parametrize(
    ("url", "key"),
    [
        ("/api/v1/tenants/", "slug"),
        ("/api/v1/entitlements/", "name"),
        ("/api/v1/keys/", "entitlement"),
        ("/api/v1/memberships/", "tenant"),
    ],
)
@pytest.mark.parametrize("persona", ["owner", "member", "outsider"])
def test_lists_show_only_the_users_tenants(world: World, persona: str, url: str, key: str) -> None:
    body = client_as(world.users[persona]).get(url).json()
    values = {row[key] for row in body["results"]}
    acme_values = {"acme", "acme-g"}
    if persona == "outsider":
        assert not values & acme_values
        assert values  # the outsider does see their own tenant's objects
    else:
        assert values & acme_values
        assert not values & {"globex", "globex-e"}


@pytest.mark.parametrize("persona", ["owner", "member", "outsider"])
def test_user_list_and_export_are_scoped(world: World, persona: str) -> None:
    client = client_as(world.users[persona])
    usernames = {u["username"] for u in client.get("/api/v1/users/").json()["results"]}
    exported = client.get("/api/v1/export").content.decode()
    if persona == "outsider":
        assert usernames == {"oscar"}
        assert "acme-g" not in exported and "globex-e" in exported
    else:
        assert usernames == {"olivia", "mark"}
        assert "acme-g" in exported and "globex-e" not in exported


def test_superuser_sees_and_manages_everything(world: World) -> None:
    client = client_as(world.users["admin"])
    assert client.get("/api/v1/entitlements/").json()["count"] == 2
    assert client.post("/api/v1/tenants/", {"slug": "initech", "name": "Initech"}, format="json").status_code == 201
    assert client.patch("/api/v1/pools/qwen3-8b/", {"slots_per_replica": 8}, format="json").status_code == 200
    assert client.post("/api/v1/apply", POOL_DOC, content_type="application/yaml").status_code == 200


def test_anonymous_requests_are_refused(world: World) -> None:
    for url in ("/api/v1/tenants/", "/api/v1/pools/", "/api/v1/entitlements/", "/api/v1/keys/"):
        assert APIClient().get(url).status_code in (401, 403)


def test_session_auth_works_for_the_browser(world: World) -> None:
    client = APIClient()
    assert client.login(username="olivia", password="olivia-pass-123")
    assert client.get("/api/v1/entitlements/acme-g/").status_code == 200


ENT_BODY = {"tenant": "acme", "pool": "qwen3-8b", "service_class": "spot", "slo_target_ms": 300,
            "tokens_per_second": 50, "kv_cache_gib": "1", "concurrency": 2}


@pytest.mark.parametrize("persona", ["owner", "outsider"])
def test_a_taken_entitlement_name_says_nothing_of_whose_it_is(world: World, persona: str) -> None:
    """Names are unique across tenants; the refusal is the same for one's own name and another tenant's."""
    client = client_as(world.users[persona])
    tenant = "acme" if persona == "owner" else "globex"
    answers = {}
    for name in ("acme-g", "globex-e"):
        response = client.post("/api/v1/entitlements/", {**ENT_BODY, "tenant": tenant, "name": name}, format="json")
        assert response.status_code == 400, response.content
        answers[name] = response.json()
    assert answers["acme-g"] == answers["globex-e"] == {"name": ["this name is not available; choose another"]}
    # The manifests path: another tenant's name is refused with the same words, naming nobody.
    doc = ENT_DOC.replace("acme-from-apply", "globex-e" if persona == "owner" else "acme-g").replace(
        "tenantId: acme", f"tenantId: {tenant}")
    applied = client.post("/api/v1/apply", doc, content_type="application/yaml")
    assert applied.status_code == 400
    text = applied.content.decode()
    assert "this name is not available" in text and "exists" not in text
    assert ("globex" if persona == "owner" else "acme") not in text.replace(
        "globex-e" if persona == "owner" else "acme-g", "")


@pytest.mark.parametrize("persona", ["owner", "member", "outsider"])
def test_users_see_the_email_and_superuser_flag_of_no_one_but_themselves(world: World, persona: str) -> None:
    me = world.users[persona]
    me.email = f"{me.username}@example.com"
    me.save()
    for other in world.users.values():
        if other != me:
            other.email = f"{other.username}@private.example"
            other.save()
    # The site's superuser added to the persona's tenant: that must not reveal that the login is a superuser.
    Membership.objects.create(tenant=Membership.objects.filter(user=me).first().tenant, user=world.users["admin"],
                              role="member")
    client = client_as(me)
    rows = {row["username"]: row for row in client.get("/api/v1/users/").json()["results"]}
    assert rows[me.username]["email"] == f"{me.username}@example.com"
    assert rows[me.username]["is_superuser"] is False
    others = [row for name, row in rows.items() if name != me.username]
    assert others  # everyone shares a tenant with someone
    for row in others:
        assert "email" not in row and "is_superuser" not in row, row
        assert client.get(f"/api/v1/users/{row['id']}/").json().keys() == row.keys()
    assert client.get("/api/v1/users/me/").json()["email"] == f"{me.username}@example.com"
    assert "private.example" not in client.get("/api/v1/users/").content.decode()


def test_the_site_operator_sees_every_users_email_and_flag(world: World) -> None:
    rows = client_as(world.users["admin"]).get("/api/v1/users/").json()["results"]
    assert all("email" in row and "is_superuser" in row for row in rows)
    assert {row["username"]: row["is_superuser"] for row in rows}["root"] is True
