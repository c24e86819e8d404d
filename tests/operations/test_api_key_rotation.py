"""Key rotation (issue 27): a new secret, shown once, for the same entitlement; the replaced key keeps working
for a grace period the caller chooses (0: revoked at once); both listed with their expiry. Through the REST API
and `manage.py create_key --rotate`, with the three personas."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from apps.tenancy.models import ApiKey
from apps.tenancy.selectors import apikey_resolve
from apps.tenancy.services import apikey_create
from tests.pools.factories import make_entitlement
from tests.pools.test_api_isolation import client_as

pytestmark = [pytest.mark.api, pytest.mark.django_db]


@pytest.fixture
def ent(admin: Any, acme: Any, pool: Any) -> Any:
    return make_entitlement(admin, acme, pool, "acme-g")


def test_rotation_issues_a_new_secret_and_keeps_the_old_one_for_the_grace_period(owner: Any, ent: Any) -> None:
    old, old_secret = apikey_create(actor=owner, entitlement=ent, name="ci")
    before = timezone.now()
    response = client_as(owner).post(f"/api/v1/keys/{old.pk}/rotate/", {"grace_period_s": 3600}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    new_secret = body["secret"]
    assert new_secret != old_secret and body["name"] == "ci" and body["entitlement"] == "acme-g"
    assert body["replaced"]["id"] == old.pk and "secret" not in body["replaced"]
    # Both work now; the old one until its new expiry, an hour away.
    assert apikey_resolve(secret=new_secret) is not None and apikey_resolve(secret=old_secret) is not None
    old.refresh_from_db()
    assert old.expires_at is not None and 3590 <= (old.expires_at - before).total_seconds() <= 3610
    assert not old.is_active(old.expires_at)
    listed = {k["id"]: k for k in client_as(owner).get("/api/v1/keys/").json()["results"]}
    assert listed[old.pk]["expires_at"] and listed[body["id"]]["expires_at"] is None
    # The secret is never shown again.
    assert "secret" not in client_as(owner).get(f"/api/v1/keys/{body['id']}/").json()


def test_a_grace_of_zero_revokes_at_once_and_the_default_is_a_day(owner: Any, ent: Any) -> None:
    now_key, now_secret = apikey_create(actor=owner, entitlement=ent)
    assert client_as(owner).post(f"/api/v1/keys/{now_key.pk}/rotate/", {"grace_period_s": 0},
                                 format="json").status_code == 201
    assert apikey_resolve(secret=now_secret) is None
    day_key, _ = apikey_create(actor=owner, entitlement=ent)
    before = timezone.now()
    assert client_as(owner).post(f"/api/v1/keys/{day_key.pk}/rotate/").status_code == 201
    day_key.refresh_from_db()
    assert day_key.expires_at is not None and abs((day_key.expires_at - before).total_seconds() - 86400) < 10


@pytest.mark.parametrize("grace", [-1, 30 * 86400 + 1, "soon", True])
def test_a_bad_grace_period_is_a_field_error_and_changes_nothing(owner: Any, ent: Any, grace: Any) -> None:
    key, secret = apikey_create(actor=owner, entitlement=ent)
    response = client_as(owner).post(f"/api/v1/keys/{key.pk}/rotate/", {"grace_period_s": grace}, format="json")
    assert response.status_code == 400 and "grace_period_s" in response.json()
    assert ApiKey.objects.filter(entitlement=ent).count() == 1
    assert apikey_resolve(secret=secret) is not None


def test_who_may_rotate_is_who_may_revoke(owner: Any, member: Any, outsider: Any, ent: Any) -> None:
    owners_key, _ = apikey_create(actor=owner, entitlement=ent)
    members_key, _ = apikey_create(actor=member, entitlement=ent)
    assert client_as(outsider).post(f"/api/v1/keys/{owners_key.pk}/rotate/").status_code == 404
    assert client_as(member).post(f"/api/v1/keys/{owners_key.pk}/rotate/").status_code == 403
    assert client_as(member).post(f"/api/v1/keys/{members_key.pk}/rotate/").status_code == 201
    assert client_as(owner).post(f"/api/v1/keys/{members_key.pk}/rotate/").status_code == 201
    assert ApiKey.objects.filter(entitlement=ent).count() == 4


def test_a_revoked_key_cannot_be_rotated(owner: Any, ent: Any) -> None:
    key, _ = apikey_create(actor=owner, entitlement=ent)
    assert client_as(owner).delete(f"/api/v1/keys/{key.pk}/").status_code == 204
    assert client_as(owner).post(f"/api/v1/keys/{key.pk}/rotate/").status_code == 404
    assert ApiKey.objects.filter(entitlement=ent).count() == 1


def test_the_command_line_rotates_and_prints_only_the_new_secret(owner: Any, ent: Any) -> None:
    key, old_secret = apikey_create(actor=owner, entitlement=ent, name="batch")
    out = StringIO()
    call_command("create_key", "--rotate", str(key.pk), "--grace-s", "0", stdout=out)
    new_secret = out.getvalue().strip()
    assert apikey_resolve(secret=new_secret) is not None and apikey_resolve(secret=old_secret) is None
    with pytest.raises(CommandError, match="revoked key cannot be rotated"):
        call_command("create_key", "--rotate", str(key.pk))
    with pytest.raises(CommandError, match="no key with id"):
        call_command("create_key", "--rotate", "999999")
    with pytest.raises(CommandError, match="give only --grace-s"):
        call_command("create_key", "--rotate", str(key.pk), "--entitlement", "acme-g")
