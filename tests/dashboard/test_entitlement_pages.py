"""Entitlement pages: tenant isolation, create/edit/revoke through the services, state and reason shown."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from apps.pools.models import EntitlementState, EntitlementStateChange, TokenEntitlement
from tests.dashboard.conftest import client_for, create_entitlement

pytestmark = pytest.mark.django_db


def entitlement_form(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "acme-new",
        "pool": "qwen-pool",
        "service_class": "guaranteed",
        "slo_target_ms": "250",
        "tokens_per_second": "300",
        "kv_cache_gib": "2",
        "concurrency": "4",
        "default_max_tokens": "",
        "queue_max": "",
        "queue_max_wait_ms": "",
        "expires_at": "",
    }
    data.update(overrides)
    return data


def test_list_shows_each_user_only_their_tenants_entitlements(
    owner: Any, member: Any, outsider: Any, superuser: Any, acme_entitlement: Any, globex_entitlement: Any
) -> None:
    url = reverse("ui:entitlement-list")
    for user in (owner, member):
        page = client_for(user).get(url).content.decode()
        assert "acme-chat" in page and "globex-batch" not in page
    outsider_page = client_for(outsider).get(url).content.decode()
    assert "globex-batch" in outsider_page and "acme-chat" not in outsider_page
    admin_page = client_for(superuser).get(url).content.decode()
    assert "acme-chat" in admin_page and "globex-batch" in admin_page


def test_list_shows_state_and_reason_and_filters_by_state(owner: Any, acme_entitlement: Any) -> None:
    page = client_for(owner).get(reverse("ui:entitlement-list")).content.decode()
    assert 'data-state="Bound"' in page
    assert acme_entitlement.state_reason in page
    degraded_only = client_for(owner).get(reverse("ui:entitlement-list") + "?state=Degraded").content.decode()
    assert "acme-chat" not in degraded_only


def test_detail_is_a_404_for_other_tenants(owner: Any, member: Any, outsider: Any, acme_entitlement: Any) -> None:
    url = reverse("ui:entitlement-detail", kwargs={"name": "acme-chat"})
    assert client_for(outsider).get(url).status_code == 404
    assert client_for(owner).get(url).status_code == 200
    assert client_for(member).get(url).status_code == 200
    assert client_for(owner).get(reverse("ui:entitlement-detail", kwargs={"name": "nope"})).status_code == 404


def test_detail_shows_state_reason_and_history_and_edit_only_to_owners(
    owner: Any, member: Any, acme_entitlement: Any
) -> None:
    url = reverse("ui:entitlement-detail", kwargs={"name": "acme-chat"})
    owner_page = client_for(owner).get(url).content.decode()
    assert 'data-state="Bound"' in owner_page
    assert "reserved baseline fits pool qwen-pool" in owner_page
    assert "created" in owner_page  # the Pending row of the history
    assert reverse("ui:entitlement-edit", kwargs={"name": "acme-chat"}) in owner_page
    assert reverse("ui:entitlement-delete", kwargs={"name": "acme-chat"}) in owner_page
    member_page = client_for(member).get(url).content.decode()
    assert reverse("ui:entitlement-edit", kwargs={"name": "acme-chat"}) not in member_page
    assert reverse("ui:entitlement-delete", kwargs={"name": "acme-chat"}) not in member_page


def test_owner_creates_an_entitlement_that_binds(owner: Any, acme: Any, pool: Any) -> None:
    client = client_for(owner)
    form_page = client.get(reverse("ui:entitlement-create"))
    assert form_page.status_code == 200
    assert f'<option value="{acme.pk}" selected>acme</option>' in form_page.content.decode()
    response = client.post(reverse("ui:entitlement-create"), entitlement_form(tenant=acme.pk), follow=True)
    assert response.redirect_chain[-1][0] == reverse("ui:entitlement-detail", kwargs={"name": "acme-new"})
    created = TokenEntitlement.objects.get(name="acme-new")
    assert created.tenant.slug == "acme"
    assert created.state == EntitlementState.BOUND
    page = response.content.decode()
    assert "Entitlement acme-new created: Bound" in page
    assert 'data-state="Bound"' in page
    transitions = list(EntitlementStateChange.objects.filter(entitlement=created).values_list("to_state", flat=True))
    assert transitions == ["Pending", "Bound"]


def test_an_entitlement_that_does_not_fit_is_degraded_with_the_reason_shown(owner: Any, acme: Any, pool: Any) -> None:
    response = client_for(owner).post(
        reverse("ui:entitlement-create"), entitlement_form(tenant=acme.pk, name="too-big", concurrency="40"), follow=True
    )
    page = response.content.decode()
    assert TokenEntitlement.objects.get(name="too-big").state == EntitlementState.DEGRADED
    assert 'data-state="Degraded"' in page
    assert "concurrency 40 &gt; 16 free slots" in page


def test_service_validation_errors_come_back_on_the_form(owner: Any, acme: Any, acme_entitlement: Any) -> None:
    response = client_for(owner).post(reverse("ui:entitlement-create"), entitlement_form(tenant=acme.pk, name="acme-chat"))
    assert response.status_code == 200
    assert b"this name is not available" in response.content
    assert TokenEntitlement.objects.filter(name="acme-chat").count() == 1
    bad_name = client_for(owner).post(
        reverse("ui:entitlement-create"), entitlement_form(tenant=acme.pk, name="Not A Name")
    )
    assert bad_name.status_code == 200
    assert not TokenEntitlement.objects.filter(name="Not A Name").exists()


def test_members_cannot_create_entitlements(member: Any, pool: Any) -> None:
    client = client_for(member)
    assert client.get(reverse("ui:entitlement-create")).status_code == 403
    assert client.post(reverse("ui:entitlement-create"), entitlement_form()).status_code == 403
    assert not TokenEntitlement.objects.filter(name="acme-new").exists()


def test_an_owner_cannot_create_for_a_tenant_they_do_not_own(outsider: Any, acme: Any, pool: Any) -> None:
    response = client_for(outsider).post(reverse("ui:entitlement-create"), entitlement_form(tenant=str(acme.pk)))
    assert response.status_code == 200
    assert b"Select a valid choice" in response.content
    assert not TokenEntitlement.objects.filter(name="acme-new").exists()


def test_owner_edits_an_entitlement_and_it_is_rebound(owner: Any, acme_entitlement: Any) -> None:
    url = reverse("ui:entitlement-edit", kwargs={"name": "acme-chat"})
    client = client_for(owner)
    form_page = client.get(url).content.decode()
    assert 'value="100"' in form_page  # current tokens/s pre-filled
    data = entitlement_form(concurrency="20")
    del data["name"]
    response = client.post(url, data)
    assert response.status_code == 302
    acme_entitlement.refresh_from_db()
    assert acme_entitlement.concurrency == 20
    assert acme_entitlement.state == EntitlementState.DEGRADED  # 20 slots do not fit 16


def test_members_cannot_edit_and_outsiders_do_not_see(member: Any, outsider: Any, acme_entitlement: Any) -> None:
    url = reverse("ui:entitlement-edit", kwargs={"name": "acme-chat"})
    data = entitlement_form(concurrency="2")
    assert client_for(member).get(url).status_code == 403
    assert client_for(member).post(url, data).status_code == 403
    assert client_for(outsider).post(url, data).status_code == 404
    acme_entitlement.refresh_from_db()
    assert acme_entitlement.concurrency == 4


def test_revoke_is_post_only_and_for_owners(owner: Any, member: Any, outsider: Any, acme_entitlement: Any) -> None:
    url = reverse("ui:entitlement-delete", kwargs={"name": "acme-chat"})
    assert client_for(owner).get(url).status_code == 405
    assert client_for(member).post(url).status_code == 403
    assert client_for(outsider).post(url).status_code == 404
    assert TokenEntitlement.objects.filter(name="acme-chat").exists()
    response = client_for(owner).post(url, follow=True)
    assert response.redirect_chain[-1][0] == reverse("ui:entitlement-list")
    assert b"Entitlement acme-chat revoked" in response.content
    assert not TokenEntitlement.objects.filter(name="acme-chat").exists()


def test_revoking_frees_room_so_a_degraded_entitlement_binds(
    owner: Any, superuser: Any, acme: Any, pool: Any
) -> None:
    create_entitlement(superuser, acme, pool, "first", concurrency=12)
    second = create_entitlement(superuser, acme, pool, "second", concurrency=8)
    assert second.state == EntitlementState.DEGRADED
    client_for(owner).post(reverse("ui:entitlement-delete", kwargs={"name": "first"}))
    second.refresh_from_db()
    assert second.state == EntitlementState.BOUND


def test_csrf_is_enforced_on_entitlement_forms(owner: Any, acme: Any, acme_entitlement: Any) -> None:
    client = client_for(owner, enforce_csrf_checks=True)
    created = client.post(reverse("ui:entitlement-create"), entitlement_form(tenant=acme.pk))
    assert created.status_code == 403
    assert not TokenEntitlement.objects.filter(name="acme-new").exists()
    revoked = client.post(reverse("ui:entitlement-delete", kwargs={"name": "acme-chat"}))
    assert revoked.status_code == 403
    assert TokenEntitlement.objects.filter(name="acme-chat").exists()


def test_expiry_from_the_browser_picker_is_read_as_utc(owner: Any, acme: Any, pool: Any) -> None:
    client = client_for(owner)
    past = client.post(
        reverse("ui:entitlement-create"),
        entitlement_form(tenant=acme.pk, name="old", expires_at="2020-01-02T03:04"),
        follow=True,
    )
    old = TokenEntitlement.objects.get(name="old")
    assert old.expires_at.isoformat() == "2020-01-02T03:04:00+00:00"
    assert old.state == EntitlementState.EXPIRED
    assert 'data-state="Expired"' in past.content.decode()
    assert "2020-01-02 03:04 UTC" in past.content.decode()

    edit_page = client.get(reverse("ui:entitlement-edit", kwargs={"name": "old"})).content.decode()
    assert 'value="2020-01-02T03:04"' in edit_page  # the picker shows what was saved


def test_the_queue_is_set_on_the_form_and_blank_is_the_class_default(owner: Any, acme: Any, pool: Any) -> None:
    client = client_for(owner)
    form_page = client.get(reverse("ui:entitlement-create")).content.decode()
    assert "Queue size" in form_page and "Queue wait (ms)" in form_page and "Blank: the class default" in form_page
    client.post(reverse("ui:entitlement-create"), entitlement_form(tenant=acme.pk))
    blank = TokenEntitlement.objects.get(name="acme-new")
    assert (blank.queue_max, blank.queue_max_wait_ms) == (None, None)
    detail = client.get(reverse("ui:entitlement-detail", kwargs={"name": "acme-new"})).content.decode()
    assert "up to 8 waiting (class default), 1000 ms each (class default)" in detail

    url = reverse("ui:entitlement-edit", kwargs={"name": "acme-new"})
    data = entitlement_form(queue_max="0", queue_max_wait_ms="600000")
    del data["name"]
    assert client.post(url, data).status_code == 302
    blank.refresh_from_db()
    assert (blank.queue_max, blank.queue_max_wait_ms) == (0, 600_000)
    detail = client.get(reverse("ui:entitlement-detail", kwargs={"name": "acme-new"})).content.decode()
    assert "none: refused at once" in detail
    assert 'name="queue_max" value="0"' in client.get(url).content.decode()  # 0 is shown, not blanked


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("queue_max", "-1", "must be 0 or more"),
        ("queue_max", "2.5", "Enter a whole number"),
        ("queue_max_wait_ms", "-1", "must be from 0 to 600000 ms"),
        ("queue_max_wait_ms", "600001", "must be from 0 to 600000 ms (10 minutes)"),
        ("queue_max_wait_ms", "soon", "Enter a whole number"),
    ],
)
def test_bad_queue_values_come_back_on_their_field(owner: Any, acme: Any, pool: Any, field: str, value: str,
                                                   words: str) -> None:
    response = client_for(owner).post(reverse("ui:entitlement-create"), entitlement_form(tenant=acme.pk,
                                                                                          **{field: value}))
    assert response.status_code == 200
    assert words in " ".join(response.context["form"].errors[field])
    assert not TokenEntitlement.objects.filter(name="acme-new").exists()


def test_the_list_shows_a_page_at_a_time_and_keeps_the_state_filter(owner: Any, acme_entitlement: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.dashboard import views

    monkeypatch.setattr(views, "ENTITLEMENTS_PER_PAGE", 2)
    for index in range(4):  # 5 in all, with acme-chat
        create_entitlement(owner, acme_entitlement.tenant, acme_entitlement.pool, f"acme-extra-{index}",
                           service_class="spot", tokens_per_second=1, concurrency=1, kv_cache_gib=1)
    url = reverse("ui:entitlement-list")
    pages = [client_for(owner).get(url, {"page": n}).content.decode() for n in (1, 2, 3)]
    shown = [sum(f"acme-extra-{i}<" in page for i in range(4)) + ("acme-chat<" in page) for page in pages]
    assert shown == [2, 2, 1], shown
    assert "Page 1 of 3 (5 entitlements)" in pages[0] and 'page=2">Next' in pages[0]
    # A page past the end is the last; the state filter stays in the links.
    assert "Page 3 of 3" in client_for(owner).get(url, {"page": 99}).content.decode()
    bound = client_for(owner).get(url, {"state": "Bound", "page": 1}).content.decode()
    assert "state=Bound&amp;page=2" in bound or "state=Bound&page=2" in bound
