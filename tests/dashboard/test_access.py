"""Who may open which page: login required everywhere, superuser-only pages, the shared layout."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from tests.dashboard.conftest import client_for

pytestmark = pytest.mark.django_db

EVERY_GET_PAGE = [
    ("ui:home", {}),
    ("ui:entitlement-list", {}),
    ("ui:entitlement-create", {}),
    ("ui:entitlement-detail", {"name": "acme-chat"}),
    ("ui:entitlement-edit", {"name": "acme-chat"}),
    ("ui:key-list", {}),
    ("ui:key-create", {}),
    ("ui:pool-list", {}),
    ("ui:pool-create", {}),
    ("ui:pool-detail", {"name": "qwen-pool"}),
    ("ui:pool-edit", {"name": "qwen-pool"}),
    ("ui:tenant-list", {}),
    ("ui:tenant-create", {}),
    ("ui:tenant-detail", {"slug": "acme"}),
    ("ui:tenant-edit", {"slug": "acme"}),
]
EVERY_POST_ACTION = [
    ("ui:entitlement-delete", {"name": "acme-chat"}),
    ("ui:key-revoke", {"key_id": 1}),
    ("ui:pool-delete", {"name": "qwen-pool"}),
    ("ui:tenant-delete", {"slug": "acme"}),
    ("ui:membership-add", {"slug": "acme"}),
    ("ui:membership-remove", {"slug": "acme", "membership_id": 1}),
]
SUPERUSER_ONLY_PAGES = [
    ("ui:pool-create", {}),
    ("ui:pool-edit", {"name": "qwen-pool"}),
    ("ui:tenant-list", {}),
    ("ui:tenant-create", {}),
    ("ui:tenant-detail", {"slug": "acme"}),
    ("ui:tenant-edit", {"slug": "acme"}),
]


@pytest.mark.parametrize(("name", "kwargs"), EVERY_GET_PAGE)
def test_anonymous_visitors_are_sent_to_the_login_page(name: str, kwargs: dict[str, Any], acme_entitlement: Any) -> None:
    url = reverse(name, kwargs=kwargs)
    response = Client().get(url)
    assert response.status_code == 302
    assert response["Location"] == f"{reverse('login')}?next={url}"


@pytest.mark.parametrize(("name", "kwargs"), EVERY_POST_ACTION)
def test_anonymous_posts_change_nothing(name: str, kwargs: dict[str, Any], acme_entitlement: Any, member_key: Any) -> None:
    from apps.pools.models import TokenEntitlement, TokenPool
    from apps.tenancy.models import ApiKey, Membership, Tenant

    before = (Tenant.objects.count(), TokenPool.objects.count(), TokenEntitlement.objects.count(),
              Membership.objects.count(), ApiKey.objects.filter(revoked_at__isnull=True).count())
    response = Client().post(reverse(name, kwargs=kwargs), {"username": "mark", "role": "owner"})
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))
    after = (Tenant.objects.count(), TokenPool.objects.count(), TokenEntitlement.objects.count(),
             Membership.objects.count(), ApiKey.objects.filter(revoked_at__isnull=True).count())
    assert after == before


@pytest.mark.parametrize(("name", "kwargs"), SUPERUSER_ONLY_PAGES)
def test_superuser_only_pages_are_forbidden_to_tenant_users(
    name: str, kwargs: dict[str, Any], owner: Any, member: Any, superuser: Any, pool: Any
) -> None:
    url = reverse(name, kwargs=kwargs)
    assert client_for(owner).get(url).status_code == 403
    assert client_for(member).get(url).status_code == 403
    assert client_for(superuser).get(url).status_code == 200


def test_login_page_logs_in_and_lands_on_home(owner: Any) -> None:
    client = Client()
    page = client.get(reverse("login"))
    assert page.status_code == 200
    assert b"csrfmiddlewaretoken" in page.content
    response = client.post(reverse("login"), {"username": "olivia", "password": "correct-horse-battery-9"})
    assert response.status_code == 302
    assert response["Location"] == reverse("ui:home")
    home = client.get(reverse("ui:home"))
    assert home.status_code == 200
    assert b"Overview" in home.content


def test_wrong_password_shows_an_error_and_no_session(owner: Any) -> None:
    client = Client()
    response = client.post(reverse("login"), {"username": "olivia", "password": "nope"})
    assert response.status_code == 200
    assert b"did not match" in response.content
    assert client.get(reverse("ui:home")).status_code == 302


def test_navigation_shows_tenants_and_django_admin_only_to_superusers(owner: Any, superuser: Any) -> None:
    owner_page = client_for(owner).get(reverse("ui:home")).content.decode()
    admin_page = client_for(superuser).get(reverse("ui:home")).content.decode()
    for page in (owner_page, admin_page):
        assert f'href="{reverse("ui:entitlement-list")}"' in page
        assert f'href="{reverse("ui:key-list")}"' in page
        assert f'href="{reverse("ui:pool-list")}"' in page
    assert f'href="{reverse("ui:tenant-list")}"' not in owner_page
    assert f'href="{reverse("admin:index")}"' not in owner_page
    assert f'href="{reverse("ui:tenant-list")}"' in admin_page
    assert f'href="{reverse("admin:index")}"' in admin_page


def test_django_admin_stays_available_to_superusers_only(owner: Any, superuser: Any) -> None:
    assert client_for(superuser).get(reverse("admin:index")).status_code == 200
    response = client_for(owner).get(reverse("admin:index"))
    assert response.status_code == 302
    assert reverse("admin:login") in response["Location"]


def test_logout_is_a_post_form_with_csrf(owner: Any) -> None:
    client = client_for(owner)
    page = client.get(reverse("ui:home")).content.decode()
    assert f'<form method="post" action="{reverse("logout")}"' in page
    form = page.split(f'action="{reverse("logout")}"', 1)[1].split("</form>", 1)[0]
    assert "csrfmiddlewaretoken" in form
    assert client.get(reverse("logout")).status_code == 405
    assert client.post(reverse("logout")).status_code == 302
    assert client.get(reverse("ui:home")).status_code == 302


def test_home_lists_only_the_users_tenants_with_their_role(owner: Any, outsider: Any, acme_entitlement: Any) -> None:
    page = client_for(owner).get(reverse("ui:home")).content.decode()
    assert "acme" in page and "Acme Corp" in page
    assert "owner" in page
    assert "globex" not in page.lower()


def test_the_stylesheet_is_served_without_login_and_nothing_outside_static() -> None:
    response = Client().get("/static/css/tokenpools.css")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/css")
    assert b".bar-fill" in response.content
    escape = Client().get("/static/../tokenpools_site/settings.py")
    assert escape.status_code in (400, 404)  # Django calls the traversal a SuspiciousFileOperation: 400
    assert b"SECRET_KEY" not in escape.content
    assert Client().get("/static/css/missing.css").status_code == 404


def test_forbidden_and_missing_pages_use_the_site_layout(owner: Any) -> None:
    client = client_for(owner)
    forbidden = client.get(reverse("ui:tenant-list"))
    assert forbidden.status_code == 403
    assert b"Not allowed" in forbidden.content and b"only platform operators" in forbidden.content
    missing = client.get(reverse("ui:entitlement-detail", kwargs={"name": "ghost"}))
    assert missing.status_code == 404
    assert b"Not found" in missing.content
    assert b"ghost" not in missing.content  # nothing echoes what was asked for
    assert Client().get("/static/nothing.css").status_code == 404
