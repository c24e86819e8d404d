"""The admin UI in a real browser: log in, create an entitlement through the form, see it bound."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from apps.pools.models import EntitlementState, TokenEntitlement
from apps.pools.services import pool_create
from apps.tenancy.models import Membership, Role, Tenant
from tests.e2e.conftest import screenshot_path

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "browser-pass-4821"


@pytest.fixture
def acme_owner_with_pool(fast_password_hashing: None) -> Any:
    """An owner of tenant acme and a one-replica pool with 16 slots, 1000 tokens/s and 8 GiB of KV."""
    User = get_user_model()
    operator = User.objects.create_superuser("root", "root@example.com", PASSWORD)
    acme = Tenant.objects.create(name="Acme Corp", slug="acme")
    owner = User.objects.create_user("olivia", password=PASSWORD)
    Membership.objects.create(tenant=acme, user=owner, role=Role.OWNER)
    pool_create(
        actor=operator,
        name="qwen-pool",
        model_name="Qwen/Qwen3-8B",
        slots_per_replica=16,
        tokens_per_second_per_replica=1000,
        kv_cache_gib_per_replica=8,
        kv_layers=36,
        kv_heads=8,
        head_dim=128,
        max_replicas=2,
        replicas=[{"url": "http://127.0.0.1:9100"}],
    )
    return owner


def test_owner_logs_in_creates_an_entitlement_and_sees_it_bound(
    live_server: Any, browser_page: Any, acme_owner_with_pool: Any, request: pytest.FixtureRequest
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    page.goto(f"{live_server.url}/entitlements/")
    # Anonymous: sent to the login page, which returns to the entitlements page afterwards.
    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/entitlements/$"))
    page.get_by_label("Username", exact=True).fill("olivia")
    page.get_by_label("Password", exact=True).fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Entitlements")).to_be_visible()

    page.get_by_role("link", name="New entitlement").click()
    expect(page.get_by_role("heading", name="New entitlement")).to_be_visible()
    page.get_by_label("Name", exact=True).fill("acme-chat")
    page.get_by_label("Pool", exact=True).select_option("qwen-pool")
    page.get_by_label("Service class", exact=True).select_option("guaranteed")
    page.get_by_label("SLO target (ms)", exact=True).fill("250")
    page.get_by_label("Tokens/s", exact=True).fill("300")
    page.get_by_label("KV cache (GiB)", exact=True).fill("2")
    page.get_by_label("Concurrency", exact=True).fill("4")
    page.screenshot(path=str(screenshot_path(request, "-form")), full_page=True)
    page.get_by_role("button", name="Create entitlement").click()

    expect(page).to_have_url(re.compile(r"/entitlements/acme-chat/$"))
    expect(page.locator("#entitlement-state .state")).to_have_text("Bound")
    expect(page.locator("#entitlement-reason")).to_contain_text("fits pool qwen-pool")
    expect(page.get_by_role("status")).to_contain_text("Entitlement acme-chat created: Bound")

    # The pool page now shows the reservation against capacity: 4 of 16 slots is a quarter bar.
    page.get_by_role("link", name="qwen-pool").first.click()
    slots_bar = page.locator('[data-dimension="slots"]')
    expect(slots_bar).to_contain_text("4 slots of 16 slots")
    expect(slots_bar.locator(".bar-fill")).to_have_attribute("style", re.compile(r"width: 25(\.0+)?%"))
    expect(page.get_by_role("row", name=re.compile("acme-chat"))).to_contain_text("Bound")

    saved = TokenEntitlement.objects.get(name="acme-chat")
    assert saved.tenant.slug == "acme"
    assert saved.state == EntitlementState.BOUND
    assert (saved.concurrency, saved.tokens_per_second, saved.slo_target_ms) == (4, 300, 250)
