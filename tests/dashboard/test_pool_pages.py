"""Pool pages: readable by every signed-in user, managed by superusers; bars of reserved vs capacity."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from apps.pools.models import EntitlementState, TokenPool
from tests.dashboard.conftest import client_for, create_entitlement

pytestmark = pytest.mark.django_db


def pool_form(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "llama-pool",
        "model_name": "meta-llama/Llama-3.1-8B",
        "backend_kind": "vllm",
        "min_replicas": "1",
        "max_replicas": "3",
        "slots_per_replica": "8",
        "tokens_per_second_per_replica": "500",
        "kv_cache_gib_per_replica": "4",
        "kv_layers": "32",
        "kv_heads": "8",
        "head_dim": "128",
        "bytes_per_element": "2",
        "replicas": "http://10.0.0.5:8000\nhttp://10.0.0.6:8000 disabled\n",
    }
    data.update(overrides)
    return data


def _bar(page: str, dimension: str) -> str:
    """The HTML of one bar row, up to the next row or the end of the bars."""
    start = page.index(f'data-dimension="{dimension}"')
    end = min(i for i in (page.find('class="bar-row"', start), page.find("</section>", start)) if i != -1)
    return page[start:end]


def test_tenant_users_read_pools(member: Any, pool: Any) -> None:
    client = client_for(member)
    listing = client.get(reverse("ui:pool-list")).content.decode()
    assert "qwen-pool" in listing
    assert reverse("ui:pool-create") not in listing
    detail = client.get(reverse("ui:pool-detail", kwargs={"name": "qwen-pool"})).content.decode()
    assert reverse("ui:pool-edit", kwargs={"name": "qwen-pool"}) not in detail
    assert reverse("ui:pool-delete", kwargs={"name": "qwen-pool"}) not in detail
    assert client.get(reverse("ui:pool-detail", kwargs={"name": "missing"})).status_code == 404


def test_pool_page_shows_reserved_against_capacity_per_dimension(
    owner: Any, superuser: Any, acme: Any, pool: Any
) -> None:
    # Two bound reservations: 4+4 slots of 16, 100+300 tokens/s of 1000, 2+2 GiB of 8; spot reserves nothing.
    create_entitlement(superuser, acme, pool, "a-one")
    create_entitlement(superuser, acme, pool, "a-two", tokens_per_second=300)
    create_entitlement(superuser, acme, pool, "a-spot", service_class="spot", concurrency=16)
    page = client_for(owner).get(reverse("ui:pool-detail", kwargs={"name": "qwen-pool"})).content.decode()

    slots = _bar(page, "slots")
    assert "8 slots of 16 slots" in slots and "width: 50.00%" in slots
    tokens = _bar(page, "tokens_per_second")
    assert "400 tok/s of 1,000 tok/s" in tokens and "width: 40.00%" in tokens
    kv = _bar(page, "kv_bytes")
    assert "4.00 GiB of 8.00 GiB" in kv and "width: 50.00%" in kv
    # 2 * 36 layers * 8 KV heads * 128 dims * 2 bytes
    assert "147,456 B" in page
    for name in ("a-one", "a-two", "a-spot"):
        assert name in page
    assert page.count('data-state="Bound"') >= 3


def test_a_full_dimension_turns_the_bar_red(owner: Any, superuser: Any, acme: Any, pool: Any) -> None:
    create_entitlement(superuser, acme, pool, "all-slots", concurrency=16)
    page = client_for(owner).get(reverse("ui:pool-detail", kwargs={"name": "qwen-pool"})).content.decode()
    assert 'class="bar-fill full"' in _bar(page, "slots")
    assert 'class="bar-fill ok"' in _bar(page, "tokens_per_second")


def test_pool_page_hides_other_tenants_entitlements_but_counts_their_reservations(
    outsider: Any, acme_entitlement: Any, globex_entitlement: Any
) -> None:
    page = client_for(outsider).get(reverse("ui:pool-detail", kwargs={"name": "qwen-pool"})).content.decode()
    assert "globex-batch" in page
    assert "acme-chat" not in page
    assert "1 entitlement of other tenants not shown" in page
    assert "4 slots of 16 slots" in _bar(page, "slots")


def test_superuser_creates_a_pool_with_replicas(superuser: Any) -> None:
    response = client_for(superuser).post(reverse("ui:pool-create"), pool_form(), follow=True)
    assert response.redirect_chain[-1][0] == reverse("ui:pool-detail", kwargs={"name": "llama-pool"})
    created = TokenPool.objects.get(name="llama-pool")
    assert [(r.url, r.enabled) for r in created.replicas.all()] == [
        ("http://10.0.0.5:8000", True),
        ("http://10.0.0.6:8000", False),
    ]
    # Only the enabled replica counts: 8 slots of capacity.
    assert "0 slots of 8 slots" in response.content.decode()


def test_pool_form_errors_are_shown(superuser: Any) -> None:
    client = client_for(superuser)
    unreadable = client.post(reverse("ui:pool-create"), pool_form(replicas="http://a:1 maybe"))
    assert unreadable.status_code == 200
    assert b"optionally followed by" in unreadable.content
    too_many = client.post(reverse("ui:pool-create"), pool_form(max_replicas="1", min_replicas="1"))
    assert too_many.status_code == 200
    assert b"max_replicas is 1" in too_many.content
    assert not TokenPool.objects.filter(name="llama-pool").exists()


def test_tenant_users_cannot_create_change_or_delete_pools(owner: Any, pool: Any) -> None:
    client = client_for(owner)
    assert client.post(reverse("ui:pool-create"), pool_form()).status_code == 403
    assert not TokenPool.objects.filter(name="llama-pool").exists()
    edit = pool_form(slots_per_replica="1")
    del edit["name"]
    assert client.post(reverse("ui:pool-edit", kwargs={"name": "qwen-pool"}), edit).status_code == 403
    assert client.post(reverse("ui:pool-delete", kwargs={"name": "qwen-pool"})).status_code == 403
    pool.refresh_from_db()
    assert pool.slots_per_replica == 16


def test_shrinking_a_pool_degrades_the_entitlement_that_no_longer_fits(superuser: Any, acme_entitlement: Any) -> None:
    client = client_for(superuser)
    url = reverse("ui:pool-edit", kwargs={"name": "qwen-pool"})
    form_page = client.get(url).content.decode()
    assert "http://127.0.0.1:9100" in form_page  # replicas pre-filled as text
    data = pool_form(
        model_name="Qwen/Qwen3-8B", slots_per_replica="2", tokens_per_second_per_replica="1000",
        kv_cache_gib_per_replica="8", kv_layers="36", max_replicas="4", replicas="http://127.0.0.1:9100",
    )
    del data["name"]
    response = client.post(url, data, follow=True)
    assert response.redirect_chain[-1][0] == reverse("ui:pool-detail", kwargs={"name": "qwen-pool"})
    acme_entitlement.refresh_from_db()
    assert acme_entitlement.state == EntitlementState.DEGRADED
    page = response.content.decode()
    assert 'data-state="Degraded"' in page
    assert "concurrency 4 &gt; 2 free slots" in page


def test_a_pool_with_entitlements_cannot_be_deleted(superuser: Any, acme_entitlement: Any) -> None:
    response = client_for(superuser).post(reverse("ui:pool-delete", kwargs={"name": "qwen-pool"}), follow=True)
    assert response.redirect_chain[-1][0] == reverse("ui:pool-detail", kwargs={"name": "qwen-pool"})
    assert b"still has 1 entitlement" in response.content
    assert TokenPool.objects.filter(name="qwen-pool").exists()


def test_an_empty_pool_is_deleted_by_post_only(superuser: Any, pool: Any) -> None:
    client = client_for(superuser)
    url = reverse("ui:pool-delete", kwargs={"name": "qwen-pool"})
    assert client.get(url).status_code == 405
    response = client.post(url, follow=True)
    assert response.redirect_chain[-1][0] == reverse("ui:pool-list")
    assert not TokenPool.objects.filter(name="qwen-pool").exists()


def test_disabling_the_only_replica_degrades_reservations_and_enabling_binds_them_back(
    superuser: Any, owner: Any, acme_entitlement: Any
) -> None:
    replica = acme_entitlement.pool.replicas.get()
    url = reverse("ui:replica-toggle", kwargs={"name": "qwen-pool", "replica_id": replica.pk})
    client = client_for(superuser)
    assert client.get(url).status_code == 405
    assert client_for(owner).post(url).status_code == 403

    response = client.post(url, follow=True)
    assert "Replica http://127.0.0.1:9100 disabled" in response.content.decode()
    acme_entitlement.refresh_from_db()
    assert acme_entitlement.state == EntitlementState.DEGRADED
    client.post(url)
    acme_entitlement.refresh_from_db()
    assert acme_entitlement.state == EntitlementState.BOUND
    other = reverse("ui:replica-toggle", kwargs={"name": "qwen-pool", "replica_id": replica.pk + 999})
    assert client.post(other).status_code == 404
