"""Page-level reads: always scoped through the tenancy and pools selectors."""

from __future__ import annotations

from typing import Any

import pytest

from apps.dashboard.selectors import home_overview, key_rows, owned_tenants, pool_page
from apps.tenancy.services import apikey_create
from tests.dashboard.conftest import create_entitlement

pytestmark = pytest.mark.django_db


def test_home_overview_counts_only_the_users_tenants(
    owner: Any, outsider: Any, superuser: Any, acme: Any, pool: Any, globex_entitlement: Any
) -> None:
    create_entitlement(superuser, acme, pool, "fits")
    create_entitlement(superuser, acme, pool, "too-big", concurrency=15)
    overview = home_overview(user=owner)
    assert [(t.slug, role) for t, role in overview.tenant_rows] == [("acme", "owner")]
    assert overview.entitlements_by_state == {"Pending": 0, "Bound": 1, "Degraded": 1, "Expired": 0}
    assert [e.name for e in overview.needs_attention] == ["too-big"]
    assert overview.pool_count == 1
    assert [(t.slug, role) for t, role in home_overview(user=superuser).tenant_rows] == [
        ("acme", "operator"),
        ("globex", "operator"),
    ]


def test_owned_tenants_excludes_tenants_where_the_user_is_a_member(member: Any, owner: Any, superuser: Any, globex: Any) -> None:
    assert list(owned_tenants(user=member)) == []
    assert [t.slug for t in owned_tenants(user=owner)] == ["acme"]
    assert [t.slug for t in owned_tenants(user=superuser)] == ["acme", "globex"]


def test_key_rows_say_who_may_revoke(owner: Any, member: Any, member_key: Any, acme_entitlement: Any) -> None:
    owners_key, _ = apikey_create(actor=owner, entitlement=acme_entitlement, name="owner-ci")
    assert {k.name: can for k, can in key_rows(user=member)} == {"member-laptop": True, "owner-ci": False}
    assert {k.name: can for k, can in key_rows(user=owner)} == {"member-laptop": True, "owner-ci": True}


def test_pool_page_hides_other_tenants_entitlements_but_counts_them(
    outsider: Any, acme_entitlement: Any, globex_entitlement: Any
) -> None:
    page = pool_page(user=outsider, pool=acme_entitlement.pool)
    assert [e.name for e in page.visible_entitlements] == ["globex-batch"]
    assert page.hidden_count == 1
    slots = next(b for b in page.bars if b.key == "slots")
    assert (slots.reserved, slots.capacity) == (4, 16)  # acme's guaranteed reservation; spot reserves nothing
