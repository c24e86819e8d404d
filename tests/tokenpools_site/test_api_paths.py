"""Every REST path answers alike with and without its trailing slash, for every method, and never with a 500 or
a debug page: unknown /api/ paths are a JSON 404 (DEBUG on or off), a server error shows nothing of the settings."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.views import LoginView
from django.db import transaction
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token

from apps.audit.models import AuditEntry
from apps.gateway.models import UsageRecord
from apps.operations.api import TenantViewSet
from apps.tenancy.apiutils import MAX_BODY_DEPTH
from apps.tenancy.models import Membership
from apps.tenancy.services import apikey_create
from tests.pools.factories import make_entitlement
from tokenpools_site.api_urls import router

METHODS = ("get", "post", "put", "patch", "delete")
SECRETS = (b"REDIS_URL", b"SECRET_KEY", b"DATABASES", b"Traceback")


def _paths(ids: dict[str, Any]) -> list[str]:
    """Every router endpoint (list and detail, with a real object) plus the plain views, slashed as routed."""
    paths = ["/api/v1/apply", "/api/v1/diff", "/api/v1/export", "/api/v1/auth/token"]
    for prefix, viewset, _ in router.registry:
        paths.append(f"/api/v1/{prefix}/")
        paths.append(f"/api/v1/{prefix}/{ids[prefix]}/")
        paths.extend(f"/api/v1/{prefix}/{ids[prefix]}/{a.url_path}/" for a in viewset.get_extra_actions() if a.detail)
    return paths


def _call(client: Client, method: str, path: str) -> tuple[int, str, bytes]:
    """One request, rolled back after (a DELETE on one form of the path must not change what the other sees)."""
    with transaction.atomic():
        kwargs = {} if method == "get" else {"data": "{}", "content_type": "application/json"}
        response = getattr(client, method)(path, **kwargs)
        transaction.set_rollback(True)
    return response.status_code, response.get("Content-Type", ""), response.content


@pytest.mark.django_db
def test_every_endpoint_answers_alike_with_and_without_the_trailing_slash(
        admin: Any, acme: Any, member: Any, pool: Any) -> None:
    ent = make_entitlement(admin, acme, pool, "acme-g")
    key, _ = apikey_create(actor=admin, entitlement=ent)
    usage = UsageRecord.objects.create(tenant=acme, entitlement="acme-g", minute=timezone.now().replace(second=0))
    membership = Membership.objects.get(user=member)
    ids = {"tenants": acme.slug, "users": member.pk, "memberships": membership.pk, "pools": pool.name,
           "entitlements": ent.name, "keys": key.pk, "usage": usage.pk,
           "audit": AuditEntry.objects.latest("id").pk,
           "requests": 1}  # the request log has no detail route: its detail path is a JSON 404 either way
    client = Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=admin).key}")
    checked = 0
    for path in _paths(ids):
        other = path[:-1] if path.endswith("/") else path + "/"
        for method in METHODS:
            routed, unrouted = _call(client, method, path), _call(client, method, other)
            assert routed[0] < 500 and routed[1] in ("application/json", "application/yaml", ""), (method, path, routed)
            assert unrouted[:2] == routed[:2], (method, other, unrouted, routed)
            if routed[0] >= 400:  # errors say the same; successes may hold the time they were made
                assert unrouted[2] == routed[2], (method, other)
            checked += 1
    assert checked == len(_paths(ids)) * len(METHODS) >= 90  # 21 paths today


@pytest.mark.django_db
def test_slashless_patch_of_a_tenant_is_served_not_a_500(admin: Any, acme: Any) -> None:
    client = Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=admin).key}")
    response = client.patch("/api/v1/tenants/acme", {"name": "Acme Inc"}, content_type="application/json")
    assert response.status_code == 200 and response.json()["name"] == "Acme Inc"
    assert client.get("/api/v1/tenants/acme").status_code == 200  # no redirect either


@pytest.mark.django_db
@pytest.mark.parametrize("debug", [False, True])
def test_unknown_api_paths_are_a_json_404(settings: Any, debug: bool) -> None:
    settings.DEBUG = debug
    client = Client(raise_request_exception=False)
    for method in METHODS:
        for path in ("/api/v1/nothing-here", "/api/v1/nothing-here/", "/api/v1/tenants/a/b/c"):
            response = getattr(client, method)(path)
            assert response.status_code == 404 and response.json() == {"detail": "Not found."}, (method, path)


@pytest.mark.django_db
def test_a_server_error_shows_no_settings(settings: Any, admin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings.DEBUG is False

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("forced for the test")

    monkeypatch.setattr(TenantViewSet, "list", fail)
    client = Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=admin).key}")
    response = client.get("/api/v1/tenants/")
    assert response.status_code == 500 and response.json() == {"detail": "Server error."}
    monkeypatch.setattr(LoginView, "get", fail)
    page = client.get("/accounts/login/")
    assert page.status_code == 500
    for body in (response.content, page.content):
        assert not any(secret in body for secret in SECRETS)


@pytest.mark.django_db
def test_a_body_nested_past_the_limit_is_a_400_on_any_endpoint(admin: Any) -> None:
    client = Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=admin).key}")
    for depth in (MAX_BODY_DEPTH + 1, 100_000):
        body = '{"name": ' + "[" * depth + "]" * depth + "}"
        response = client.post("/api/v1/tenants/", body, content_type="application/json")
        assert response.status_code == 400 and "nested deeper than" in response.json()["detail"], depth
