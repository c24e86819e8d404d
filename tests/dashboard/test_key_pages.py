"""API key pages: the secret is shown once, only the prefix afterwards; revoke rules; CSRF enforced."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse

from apps.tenancy.models import ApiKey
from apps.tenancy.selectors import apikey_resolve
from apps.tenancy.services import apikey_create
from tests.dashboard.conftest import client_for

pytestmark = pytest.mark.django_db


def _secret_on(page: str) -> str:
    match = re.search(r'<code id="new-secret">([^<]+)</code>', page)
    assert match, "the creation page must show the new secret"
    return match.group(1)


def test_the_secret_is_shown_once_right_after_creation(member: Any, acme_entitlement: Any) -> None:
    client = client_for(member)
    form_page = client.get(reverse("ui:key-create") + "?entitlement=acme-chat").content.decode()
    assert '<option value="acme-chat" selected>' in form_page

    response = client.post(reverse("ui:key-create"), {"entitlement": "acme-chat", "name": "laptop"})
    assert response.status_code == 201
    assert "no-store" in response["Cache-Control"]
    secret = _secret_on(response.content.decode())
    key = ApiKey.objects.get(name="laptop")
    assert key.created_by == member
    assert secret.startswith(key.prefix)
    assert apikey_resolve(secret=secret) == key  # the shown secret is the working one
    assert secret not in key.secret_hash

    for url in (
        reverse("ui:key-list"),
        reverse("ui:entitlement-detail", kwargs={"name": "acme-chat"}),
        reverse("ui:key-create"),
        reverse("ui:home"),
    ):
        page = client.get(url).content.decode()
        assert secret not in page, url
    assert f"{key.prefix}…" in client.get(reverse("ui:key-list")).content.decode()


def test_keys_of_other_tenants_are_invisible(
    owner: Any, outsider: Any, member_key: Any, globex_entitlement: Any
) -> None:
    assert member_key.prefix in client_for(owner).get(reverse("ui:key-list")).content.decode()
    assert member_key.prefix not in client_for(outsider).get(reverse("ui:key-list")).content.decode()


def test_a_key_cannot_be_made_for_another_tenants_entitlement(outsider: Any, acme_entitlement: Any) -> None:
    response = client_for(outsider).post(reverse("ui:key-create"), {"entitlement": "acme-chat"})
    assert response.status_code == 200
    assert b"Select a valid choice" in response.content
    assert not ApiKey.objects.exists()


def test_owner_revokes_a_members_key(owner: Any, member_key: Any) -> None:
    response = client_for(owner).post(reverse("ui:key-revoke", kwargs={"key_id": member_key.pk}), follow=True)
    assert response.redirect_chain[-1][0] == reverse("ui:key-list")
    assert f"Key {member_key.prefix}… revoked." in response.content.decode()
    member_key.refresh_from_db()
    assert member_key.revoked_at is not None


def test_members_revoke_only_their_own_keys(owner: Any, member: Any, member_key: Any, acme_entitlement: Any) -> None:
    owners_key, _ = apikey_create(actor=owner, entitlement=acme_entitlement, name="owner-ci")
    client = client_for(member)
    listing = client.get(reverse("ui:key-list")).content.decode()
    assert reverse("ui:key-revoke", kwargs={"key_id": member_key.pk}) in listing
    assert reverse("ui:key-revoke", kwargs={"key_id": owners_key.pk}) not in listing

    assert client.post(reverse("ui:key-revoke", kwargs={"key_id": owners_key.pk})).status_code == 403
    owners_key.refresh_from_db()
    assert owners_key.revoked_at is None
    assert client.post(reverse("ui:key-revoke", kwargs={"key_id": member_key.pk})).status_code == 302
    member_key.refresh_from_db()
    assert member_key.revoked_at is not None


def test_revoke_is_post_only_and_a_404_for_outsiders(outsider: Any, owner: Any, member_key: Any) -> None:
    url = reverse("ui:key-revoke", kwargs={"key_id": member_key.pk})
    assert client_for(owner).get(url).status_code == 405
    assert client_for(outsider).post(url).status_code == 404
    member_key.refresh_from_db()
    assert member_key.revoked_at is None


def test_csrf_is_enforced_on_revoke(owner: Any, member_key: Any) -> None:
    client = client_for(owner, enforce_csrf_checks=True)
    url = reverse("ui:key-revoke", kwargs={"key_id": member_key.pk})
    assert client.post(url).status_code == 403
    member_key.refresh_from_db()
    assert member_key.revoked_at is None

    # The token the key list page embeds in its revoke form is the one that works.
    listing = client.get(reverse("ui:key-list")).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', listing).group(1)
    assert client.post(url, {"csrfmiddlewaretoken": token}).status_code == 302
    member_key.refresh_from_db()
    assert member_key.revoked_at is not None


def test_csrf_is_enforced_on_key_creation(member: Any, acme_entitlement: Any) -> None:
    client = client_for(member, enforce_csrf_checks=True)
    assert client.post(reverse("ui:key-create"), {"entitlement": "acme-chat"}).status_code == 403
    assert not ApiKey.objects.exists()


def test_rotating_a_key_shows_the_new_secret_once_and_keeps_the_old_for_the_chosen_grace(
        owner: Any, member: Any, outsider: Any, member_key: Any) -> None:
    url = reverse("ui:key-rotate", kwargs={"key_id": member_key.pk})
    listing = client_for(member).get(reverse("ui:key-list")).content.decode()
    assert url in listing and 'name="grace_period_s"' in listing
    assert client_for(outsider).post(url).status_code == 404
    assert client_for(member).get(url).status_code == 405
    assert client_for(member).post(url, {"grace_period_s": "12345"}).status_code == 400
    response = client_for(member).post(url, {"grace_period_s": "3600"})
    assert response.status_code == 201 and "no-store" in response["Cache-Control"]
    page = response.content.decode()
    new_secret = _secret_on(page)
    new_key = apikey_resolve(secret=new_secret)
    assert new_key is not None and new_key.pk != member_key.pk and new_key.entitlement_id == member_key.entitlement_id
    member_key.refresh_from_db()
    assert member_key.expires_at is not None and member_key.revoked_at is None and "keeps working until" in page
    # Rotating the new one with no grace revokes it at once, and an expired key cannot be rotated.
    again = client_for(owner).post(reverse("ui:key-rotate", kwargs={"key_id": new_key.pk}), {"grace_period_s": "0"})
    assert again.status_code == 201 and apikey_resolve(secret=new_secret) is None
