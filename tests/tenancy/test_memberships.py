"""Tenants, users and roles through the services and the API."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError

from apps.tenancy.models import Membership
from apps.tenancy.selectors import tenant_list, user_role
from apps.tenancy.services import membership_remove, membership_set, tenant_create, user_create
from tests.pools.test_api_isolation import client_as


@pytest.mark.django_db
def test_roles_and_tenant_visibility(acme: Any, globex: Any, owner: Any, member: Any, outsider: Any,
                                     admin: Any) -> None:
    assert user_role(user=owner, tenant=acme) == "owner"
    assert user_role(user=member, tenant=acme) == "member"
    assert user_role(user=outsider, tenant=acme) is None
    assert list(tenant_list(user=member)) == [acme]
    assert set(tenant_list(user=admin)) == {acme, globex}


@pytest.mark.django_db
def test_last_owner_is_kept(acme: Any, owner: Any, member: Any) -> None:
    membership = Membership.objects.get(user=owner)
    with pytest.raises(ValidationError):
        membership_set(actor=owner, tenant=acme, user=owner, role="member")
    with pytest.raises(ValidationError):
        membership_remove(actor=owner, membership=membership)
    membership_set(actor=owner, tenant=acme, user=member, role="owner")
    membership_set(actor=owner, tenant=acme, user=owner, role="member")
    assert user_role(user=owner, tenant=acme) == "member"
    with pytest.raises(PermissionDenied):
        membership_set(actor=owner, tenant=acme, user=owner, role="owner")
    with pytest.raises(ValidationError):
        membership_set(actor=member, tenant=acme, user=owner, role="admin")


@pytest.mark.django_db
def test_only_superusers_create_tenants_and_users(owner: Any, admin: Any) -> None:
    with pytest.raises(PermissionDenied):
        tenant_create(actor=owner, name="X", slug="x")
    with pytest.raises(PermissionDenied):
        user_create(actor=owner, username="x", password="long-pass-987")
    with pytest.raises(ValidationError) as err:
        tenant_create(actor=admin, name="Bad", slug="Bad Slug")
    assert "slug" in err.value.message_dict
    with pytest.raises(ValidationError) as err:
        tenant_create(actor=admin, name="Dup", slug="acme")
    assert "slug" in err.value.message_dict
    with pytest.raises(ValidationError) as err:
        user_create(actor=admin, username="weak", password="123")
    assert "password" in err.value.message_dict
    assert not get_user_model().objects.filter(username="weak").exists()
    user = user_create(actor=admin, username="newbie", password="a-much-longer-pass-987")
    assert user.check_password("a-much-longer-pass-987") and not user.is_superuser


@pytest.mark.api
@pytest.mark.django_db
def test_membership_and_user_api(admin: Any, acme: Any, owner: Any, member: Any) -> None:
    su = client_as(admin)
    created = su.post("/api/v1/users/", {"username": "newbie", "password": "a-much-longer-pass-987"}, format="json")
    assert created.status_code == 201 and "password" not in created.json()
    assert su.post("/api/v1/users/", {"username": "newbie", "password": "a-much-longer-pass-987"},
                   format="json").status_code == 400
    client = client_as(owner)
    added = client.post("/api/v1/memberships/", {"tenant": "acme", "user": "newbie", "role": "member"}, format="json")
    assert added.status_code == 201, added.json()
    roles = {u["username"]: u["roles"] for u in client.get("/api/v1/users/").json()["results"]}
    assert roles["newbie"] == [{"tenant": "acme", "role": "member"}]
    mine = Membership.objects.get(user=owner)
    last_owner = client.patch(f"/api/v1/memberships/{mine.pk}/", {"role": "member"}, format="json")
    assert last_owner.status_code == 400 and "role" in last_owner.json()
    assert client.get("/api/v1/memberships/?tenant=acme&role=member").json()["count"] == 2
    bad = client.post("/api/v1/memberships/", {"tenant": "acme", "user": "ghost", "role": "member"}, format="json")
    assert bad.status_code == 400 and "user" in bad.json()


@pytest.mark.api
@pytest.mark.django_db
@pytest.mark.parametrize(("persona", "role"), [("owner", "owner"), ("member", "member"), ("outsider", None)])
def test_me_and_my_role(acme: Any, owner: Any, member: Any, outsider: Any, persona: str, role: str | None) -> None:
    user = {"owner": owner, "member": member, "outsider": outsider}[persona]
    client = client_as(user)
    me = client.get("/api/v1/users/me/").json()
    assert me["username"] == user.username
    assert ({"tenant": "acme", "role": role} in me["roles"]) == (role is not None)
    tenants = {t["slug"]: t["my_role"] for t in client.get("/api/v1/tenants/").json()["results"]}
    assert tenants.get("acme") == role


@pytest.mark.api
@pytest.mark.django_db
def test_scripts_obtain_a_token_with_their_password(owner: Any) -> None:
    from rest_framework.test import APIClient

    anonymous = APIClient()
    response = anonymous.post("/api/v1/auth/token", {"username": "olivia", "password": "olivia-pass-123"}, format="json")
    assert response.status_code == 200
    token = response.json()["token"]
    anonymous.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert anonymous.get("/api/v1/users/me/").json()["username"] == "olivia"
    wrong = APIClient().post("/api/v1/auth/token", {"username": "olivia", "password": "nope"}, format="json")
    assert wrong.status_code == 400
