"""The UI forms' fields of issue 24: an entitlement's spillover class, the quota's onExceeded (entitlement and
tenant), a pool's InferenceObjective names; the model's rules come back as field errors."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from apps.pools.models import TokenEntitlement, TokenPool
from apps.tenancy.models import Tenant
from tests.dashboard.conftest import client_for
from tests.dashboard.test_entitlement_pages import entitlement_form
from tests.dashboard.test_pool_pages import pool_form

pytestmark = pytest.mark.django_db


def test_entitlement_form_saves_spillover_and_on_exceeded(owner: Any, acme: Any, pool: Any) -> None:
    client = client_for(owner)
    form = entitlement_form(tenant=acme.pk, spillover_class="spot", quota_window="day", quota_tokens="1000",
                            quota_on_exceeded="spot")
    response = client.post(reverse("ui:entitlement-create"), form)
    assert response.status_code == 302, response.content.decode()[:2000]
    ent = TokenEntitlement.objects.get(name="acme-new")
    assert (ent.spillover_class, ent.quota_on_exceeded) == ("spot", "spot")
    edit = client.get(reverse("ui:entitlement-edit", kwargs={"name": "acme-new"})).content.decode()
    assert '<option value="spot" selected>spot</option>' in edit


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"spillover_class": "guaranteed"}, "is not lower than &#x27;guaranteed&#x27;"),
        ({"service_class": "spot", "spillover_class": "preemptible"}, "a spot entitlement cannot spill over"),
        ({"spillover_class": "cheap"}, "Select a valid choice"),
        ({"quota_on_exceeded": "throttle"}, "Select a valid choice"),
        ({"quota_on_exceeded": "spot"}, "applies to a quota"),
    ],
)
def test_bad_entitlement_tier_fields_come_back_on_the_form(owner: Any, acme: Any, pool: Any, fields: dict[str, Any],
                                                           words: str) -> None:
    response = client_for(owner).post(reverse("ui:entitlement-create"), entitlement_form(tenant=acme.pk, **fields))
    assert response.status_code == 200
    page = response.content.decode()
    assert words in page, page[:3000]
    assert not TokenEntitlement.objects.filter(name="acme-new").exists()


def test_tenant_form_on_exceeded(superuser: Any, acme: Any) -> None:
    client = client_for(superuser)
    edit = reverse("ui:tenant-edit", kwargs={"slug": "acme"})
    response = client.post(edit, {"name": "Acme", "slug": "acme", "quota_window": "month", "quota_tokens": "5000",
                                  "quota_on_exceeded": "spot"})
    assert response.status_code == 302
    assert Tenant.objects.get(slug="acme").quota_on_exceeded == "spot"
    assert '<option value="spot" selected>' in client.get(edit).content.decode()
    bad = client.post(edit, {"name": "Acme", "slug": "acme", "quota_on_exceeded": "spot", "quota_window": ""})
    assert bad.status_code == 200 and "applies to a quota" in bad.content.decode()


def test_pool_form_objectives(superuser: Any) -> None:
    client = client_for(superuser)
    response = client.post(reverse("ui:pool-create"), pool_form(
        backend_kind="llm-d", inference_objectives="guaranteed: premium\n\nspot: batch\n"))
    assert response.status_code == 302, response.content.decode()[:2000]
    pool = TokenPool.objects.get(name="llama-pool")
    assert (pool.backend_kind, pool.inference_objectives) == ("llm-d", {"guaranteed": "premium", "spot": "batch"})
    page = client.get(reverse("ui:pool-edit", kwargs={"name": "llama-pool"})).content.decode()
    assert "guaranteed: premium\nspot: batch" in page


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("gold: premium", "unknown service class &#x27;gold&#x27;"),
        ("spot: Batch_Jobs", "not a Kubernetes object name"),
        ("spot batch", "write &#x27;class: InferenceObjective name&#x27;"),
        ("spot: a\nspot: b", "listed twice"),
    ],
)
def test_bad_objectives_come_back_on_the_pool_form(superuser: Any, text: str, words: str) -> None:
    response = client_for(superuser).post(reverse("ui:pool-create"), pool_form(inference_objectives=text))
    assert response.status_code == 200
    assert words in response.content.decode(), response.content.decode()[:3000]
    assert not TokenPool.objects.filter(name="llama-pool").exists()
