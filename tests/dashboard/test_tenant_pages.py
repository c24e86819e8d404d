"""Tenant pages (superusers only): create, edit, memberships, delete."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from apps.pools.models import TokenEntitlement
from apps.tenancy.models import Membership, Role, Tenant
from tests.dashboard.conftest import client_for

pytestmark = pytest.mark.django_db


def test_superuser_creates_and_edits_a_tenant(superuser: Any) -> None:
    client = client_for(superuser)
    response = client.post(reverse("ui:tenant-create"), {"name": "Initech", "slug": "initech"}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("ui:tenant-detail", kwargs={"slug": "initech"})
    assert Tenant.objects.get(slug="initech").name == "Initech"
    assert b"initech" in client.get(reverse("ui:tenant-list")).content

    edit = reverse("ui:tenant-edit", kwargs={"slug": "initech"})
    assert b'value="Initech"' in client.get(edit).content
    client.post(edit, {"name": "Initech LLC", "slug": "initech"})
    assert Tenant.objects.get(slug="initech").name == "Initech LLC"


def test_bad_or_duplicate_slugs_come_back_on_the_form(superuser: Any, acme: Any) -> None:
    client = client_for(superuser)
    duplicate = client.post(reverse("ui:tenant-create"), {"name": "Acme 2", "slug": "acme"})
    assert duplicate.status_code == 200
    assert b"already exists" in duplicate.content
    bad = client.post(reverse("ui:tenant-create"), {"name": "Bad", "slug": "Not_A_Slug"})
    assert bad.status_code == 200
    assert b"DNS label" in bad.content
    assert Tenant.objects.count() == 1


def test_tenant_detail_lists_members_entitlements_and_keys(superuser: Any, owner: Any, member_key: Any) -> None:
    page = client_for(superuser).get(reverse("ui:tenant-detail", kwargs={"slug": "acme"})).content.decode()
    assert "olivia" in page and "mark" in page
    assert "acme-chat" in page
    assert member_key.prefix in page
    assert client_for(superuser).get(reverse("ui:tenant-detail", kwargs={"slug": "nope"})).status_code == 404


def test_superuser_adds_changes_and_removes_members(superuser: Any, acme: Any, owner: Any, outsider: Any) -> None:
    client = client_for(superuser)
    add = reverse("ui:membership-add", kwargs={"slug": "acme"})
    client.post(add, {"username": "oscar", "role": "member"})
    membership = Membership.objects.get(tenant=acme, user=outsider)
    assert membership.role == Role.MEMBER
    client.post(add, {"username": "oscar", "role": "owner"})
    membership.refresh_from_db()
    assert membership.role == Role.OWNER

    unknown = client.post(add, {"username": "nobody", "role": "member"}, follow=True)
    assert b"No login named" in unknown.content

    remove = reverse("ui:membership-remove", kwargs={"slug": "acme", "membership_id": membership.pk})
    assert client.get(remove).status_code == 405
    client.post(remove)
    assert not Membership.objects.filter(pk=membership.pk).exists()


def test_a_membership_of_another_tenant_cannot_be_removed_through_this_one(
    superuser: Any, acme: Any, globex: Any, outsider: Any
) -> None:
    globex_membership = Membership.objects.get(tenant=globex, user=outsider)
    url = reverse("ui:membership-remove", kwargs={"slug": "acme", "membership_id": globex_membership.pk})
    assert client_for(superuser).post(url).status_code == 404
    assert Membership.objects.filter(pk=globex_membership.pk).exists()


def test_tenant_users_cannot_manage_tenants(owner: Any, acme: Any) -> None:
    client = client_for(owner)
    assert client.post(reverse("ui:tenant-create"), {"name": "X", "slug": "x"}).status_code == 403
    assert client.post(reverse("ui:tenant-edit", kwargs={"slug": "acme"}), {"name": "Y", "slug": "acme"}).status_code == 403
    assert client.post(reverse("ui:tenant-delete", kwargs={"slug": "acme"})).status_code == 403
    assert client.post(reverse("ui:membership-add", kwargs={"slug": "acme"}), {"username": "olivia", "role": "member"}).status_code == 403
    assert not Tenant.objects.filter(slug="x").exists()
    assert Tenant.objects.get(slug="acme").name == "Acme Corp"


def test_deleting_a_tenant_is_post_only_and_takes_its_entitlements(superuser: Any, acme_entitlement: Any) -> None:
    client = client_for(superuser)
    url = reverse("ui:tenant-delete", kwargs={"slug": "acme"})
    assert client.get(url).status_code == 405
    response = client.post(url, follow=True)
    assert response.redirect_chain[-1][0] == reverse("ui:tenant-list")
    assert not Tenant.objects.filter(slug="acme").exists()
    assert not TokenEntitlement.objects.filter(name="acme-chat").exists()
