"""What DELETE means for an API key: it revokes the key, which then leaves the API's view but not the audit."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.gateway.selectors import gateway_active_keys
from apps.tenancy.models import ApiKey
from apps.tenancy.selectors import apikey_resolve
from apps.tenancy.services import apikey_create
from tests.pools.factories import make_entitlement
from tests.pools.test_api_isolation import client_as

pytestmark = [pytest.mark.api, pytest.mark.django_db]


@pytest.fixture
def ent(admin: Any, acme: Any, pool: Any) -> Any:
    return make_entitlement(admin, acme, pool, "acme-g")


def _ids(response: Any) -> set[int]:
    assert response.status_code == 200, response.content[:300]
    return {k["id"] for k in response.json()["results"]}


def test_delete_revokes_the_key_and_takes_it_out_of_the_apis_view(owner: Any, ent: Any) -> None:
    client = client_as(owner)
    created = client.post("/api/v1/keys/", {"entitlement": "acme-g", "name": "ci"}, format="json").json()
    kept, _ = apikey_create(actor=owner, entitlement=ent, name="kept")
    key_id, secret = created["id"], created["secret"]
    assert apikey_resolve(secret=secret) is not None

    assert client.delete(f"/api/v1/keys/{key_id}/").status_code == 204
    # The gateway refuses it: the per-request lookup and the snapshot's source both leave it out.
    assert apikey_resolve(secret=secret) is None
    assert key_id not in {k.pk for k in gateway_active_keys()}
    # Gone from the API's default view...
    assert client.get(f"/api/v1/keys/{key_id}/").status_code == 404
    assert _ids(client.get("/api/v1/keys/")) == {kept.pk}
    assert client.delete(f"/api/v1/keys/{key_id}/").status_code == 404
    assert client.post(f"/api/v1/keys/{key_id}/revoke/").status_code == 404
    # ...but listed for audit, with when it was revoked; the row stays.
    revoked = client.get("/api/v1/keys/?status=revoked").json()["results"]
    assert [(k["id"], k["status"], k["created_by"]) for k in revoked] == [(key_id, "revoked", "olivia")]
    assert revoked[0]["revoked_at"]
    assert _ids(client.get("/api/v1/keys/?revoked=true")) == {key_id}
    assert _ids(client.get("/api/v1/keys/?revoked=false")) == {kept.pk}
    assert ApiKey.objects.filter(pk=key_id, revoked_at__isnull=False).exists()


def test_post_revoke_still_revokes_and_answers_with_the_revoked_key(owner: Any, ent: Any) -> None:
    key, secret = apikey_create(actor=owner, entitlement=ent)
    response = client_as(owner).post(f"/api/v1/keys/{key.pk}/revoke/")
    assert response.status_code == 200
    assert response.json()["status"] == "revoked" and response.json()["revoked_at"]
    assert apikey_resolve(secret=secret) is None
    assert client_as(owner).get(f"/api/v1/keys/{key.pk}/").status_code == 404


def test_status_filter_tells_active_expired_and_revoked_apart(owner: Any, member: Any, ent: Any) -> None:
    now = timezone.now()
    active, _ = apikey_create(actor=owner, entitlement=ent)
    expired, _ = apikey_create(actor=member, entitlement=ent, expires_at=now + timedelta(seconds=5))
    ApiKey.objects.filter(pk=expired.pk).update(expires_at=now - timedelta(seconds=1))
    revoked, _ = apikey_create(actor=member, entitlement=ent)
    assert client_as(member).delete(f"/api/v1/keys/{revoked.pk}/").status_code == 204
    client = client_as(owner)
    # Expired keys stay in the default view (nobody deleted them); their status says so.
    assert _ids(client.get("/api/v1/keys/")) == {active.pk, expired.pk}
    assert _ids(client.get("/api/v1/keys/?status=active")) == {active.pk}
    assert _ids(client.get("/api/v1/keys/?status=expired")) == {expired.pk}
    assert _ids(client.get("/api/v1/keys/?status=revoked")) == {revoked.pk}
    assert _ids(client.get("/api/v1/keys/?status=")) == {active.pk, expired.pk}


def test_members_still_may_not_delete_keys_of_others(owner: Any, member: Any, ent: Any) -> None:
    key, secret = apikey_create(actor=owner, entitlement=ent)
    assert client_as(member).delete(f"/api/v1/keys/{key.pk}/").status_code == 403
    assert apikey_resolve(secret=secret) is not None
    assert client_as(member).get(f"/api/v1/keys/{key.pk}/").status_code == 200


@pytest.mark.parametrize(("query", "field"), [("revoked=maybe", "revoked"), ("revoked=null", "revoked"),
                                              ("status=gone", "status")])
def test_bad_key_filters_are_field_errors(owner: Any, ent: Any, query: str, field: str) -> None:
    response = client_as(owner).get(f"/api/v1/keys/?{query}")
    assert response.status_code == 400 and field in response.json()
