"""API keys: shown once, stored hashed, resolvable by the gateway until revoked or expired."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.utils import timezone

from apps.tenancy.models import ApiKey
from apps.tenancy.selectors import apikey_resolve
from apps.tenancy.services import apikey_create, apikey_mark_used, apikey_revoke
from tests.pools.factories import make_entitlement
from tests.pools.test_api_isolation import client_as


@pytest.fixture
def ent(admin: Any, acme: Any, pool: Any) -> Any:
    return make_entitlement(admin, acme, pool, "acme-g")


@pytest.mark.django_db
def test_secret_is_stored_only_as_a_hash(owner: Any, ent: Any) -> None:
    key, secret = apikey_create(actor=owner, entitlement=ent, name="ci")
    assert secret.startswith("tp-") and len(secret) >= 40
    stored = ApiKey.objects.get(pk=key.pk)
    assert stored.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret.startswith(stored.prefix) and len(stored.prefix) < len(secret) // 2
    row = ApiKey.objects.filter(pk=key.pk).values().get()
    assert all(secret != value for value in row.values())
    second, other_secret = apikey_create(actor=owner, entitlement=ent)
    assert other_secret != secret and second.secret_hash != stored.secret_hash


@pytest.mark.django_db
def test_resolve_unknown_revoked_and_expired(owner: Any, ent: Any) -> None:
    key, secret = apikey_create(actor=owner, entitlement=ent)
    resolved = apikey_resolve(secret=secret)
    assert resolved is not None and resolved.pk == key.pk
    assert resolved.entitlement.pool.name == "qwen3-8b" and resolved.tenant.slug == "acme"
    assert apikey_resolve(secret=secret + "x") is None
    assert apikey_resolve(secret="") is None
    assert apikey_resolve(secret=None) is None  # type: ignore[arg-type]
    apikey_mark_used(key=key)
    key.refresh_from_db()
    assert key.last_used_at is not None
    apikey_revoke(actor=owner, key=key)
    assert apikey_resolve(secret=secret) is None

    now = timezone.now()
    expiring, secret2 = apikey_create(actor=owner, entitlement=ent, expires_at=now + timedelta(hours=1))
    assert apikey_resolve(secret=secret2, now=now) is not None
    assert apikey_resolve(secret=secret2, now=now + timedelta(hours=2)) is None
    with pytest.raises(ValidationError):
        apikey_create(actor=owner, entitlement=ent, expires_at=now - timedelta(seconds=1))


@pytest.mark.django_db
def test_who_may_create_and_revoke(owner: Any, member: Any, outsider: Any, ent: Any) -> None:
    owners_key, _ = apikey_create(actor=owner, entitlement=ent)
    members_key, _ = apikey_create(actor=member, entitlement=ent)
    with pytest.raises(PermissionDenied):
        apikey_create(actor=outsider, entitlement=ent)
    with pytest.raises(PermissionDenied):
        apikey_revoke(actor=member, key=owners_key)
    with pytest.raises(PermissionDenied):
        apikey_revoke(actor=outsider, key=members_key)
    apikey_revoke(actor=member, key=members_key)
    apikey_revoke(actor=owner, key=owners_key)
    first_revocation = ApiKey.objects.get(pk=owners_key.pk).revoked_at
    apikey_revoke(actor=owner, key=owners_key)  # twice: no-op
    assert ApiKey.objects.get(pk=owners_key.pk).revoked_at == first_revocation


@pytest.mark.api
@pytest.mark.django_db
def test_secret_appears_only_in_the_creation_response(member: Any, ent: Any) -> None:
    client = client_as(member)
    created = client.post("/api/v1/keys/", {"entitlement": "acme-g", "name": "laptop"}, format="json")
    assert created.status_code == 201
    secret = created.json()["secret"]
    assert secret.startswith(created.json()["prefix"])
    listed = client.get("/api/v1/keys/").content.decode()
    detail = client.get(f"/api/v1/keys/{created.json()['id']}/").content.decode()
    assert secret not in listed and secret not in detail and "secret" not in detail
    assert apikey_resolve(secret=secret) is not None
    revoked = client.post(f"/api/v1/keys/{created.json()['id']}/revoke/")
    assert revoked.json()["status"] == "revoked" and revoked.json()["revoked_at"]
    assert apikey_resolve(secret=secret) is None
    assert client.get("/api/v1/keys/?revoked=false").json()["count"] == 0
    assert client.get("/api/v1/keys/?revoked=true").json()["count"] == 1
    bad = client.post("/api/v1/keys/", {"entitlement": "acme-g", "expires_at": "2001-01-01T00:00:00Z"}, format="json")
    assert bad.status_code == 400 and "expires_at" in bad.json()
