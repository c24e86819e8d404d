"""The admin UI forms: replica text parsing and service errors folded back onto the form."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError

from apps.dashboard.forms import PoolForm, TenantForm, add_service_errors
from tests.dashboard.conftest import create_pool

BASE_POOL = {
    "name": "p",
    "model_name": "m",
    "backend_kind": "vllm",
    "min_replicas": 1,
    "max_replicas": 2,
    "slots_per_replica": 4,
    "tokens_per_second_per_replica": 10,
    "kv_cache_gib_per_replica": "1",
    "kv_layers": 2,
    "kv_heads": 2,
    "head_dim": 64,
    "bytes_per_element": 2,
}


def test_replica_lines_become_url_and_enabled_pairs() -> None:
    form = PoolForm({**BASE_POOL, "replicas": "  http://a:1  \n\nhttp://b:2 DISABLED\n"})
    assert form.is_valid(), form.errors
    assert form.cleaned_data["replicas"] == [
        {"url": "http://a:1", "enabled": True},
        {"url": "http://b:2", "enabled": False},
    ]


@pytest.mark.parametrize("text", ["http://a:1 off", "http://a:1 disabled extra"])
def test_unreadable_replica_lines_are_rejected(text: str) -> None:
    form = PoolForm({**BASE_POOL, "replicas": text})
    assert not form.is_valid()
    assert "replicas" in form.errors


def test_the_edit_form_has_no_name_field() -> None:
    assert "name" not in PoolForm(editing=True).fields
    assert "name" in PoolForm().fields


@pytest.mark.django_db
def test_edit_form_is_prefilled_from_the_pool(superuser: Any) -> None:
    pool = create_pool(superuser, replicas=2)
    pool.replicas.filter(position=1).update(enabled=False)
    initial = PoolForm.initial_for(pool)
    assert initial["slots_per_replica"] == 16
    assert initial["replicas"] == "http://127.0.0.1:9100\nhttp://127.0.0.1:9101 disabled"


def test_service_errors_land_on_their_field_or_the_form() -> None:
    form = TenantForm({"name": "A", "slug": "a"})
    assert form.is_valid()
    add_service_errors(form, ValidationError({"slug": ["taken"], "created_at": ["odd"], "__all__": ["whole"]}))
    assert form.errors["slug"] == ["taken"]
    assert form.non_field_errors() == ["created_at: odd", "whole"]

    plain = TenantForm({"name": "A", "slug": "a"})
    plain.is_valid()
    add_service_errors(plain, ValidationError("no room"))
    assert plain.non_field_errors() == ["no room"]
