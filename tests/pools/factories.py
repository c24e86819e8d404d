"""Builders and fixtures shared by the tenancy and pools tests (imported by both conftest files)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model

from apps.pools.models import TokenEntitlement, TokenPool
from apps.pools.services import entitlement_create, pool_create
from apps.tenancy.models import Membership, Role, Tenant

User = get_user_model()


def make_pool(admin: Any, name: str = "qwen3-8b", replicas: int | list = 1, **overrides: Any) -> TokenPool:
    """A pool with ``replicas`` enabled replicas (or the given replica list) of 16 slots, 240 tokens/s and 20 GiB each."""
    fields: dict[str, Any] = {
        "model_name": "Qwen/Qwen3-8B",
        "backend_kind": "vllm",
        "min_replicas": 1,
        "max_replicas": 10,
        "slots_per_replica": 16,
        "tokens_per_second_per_replica": 240,
        "kv_cache_gib_per_replica": 20,
        "kv_layers": 36,
        "kv_heads": 8,
        "head_dim": 128,
        "bytes_per_element": 2,
        "replicas": replicas if isinstance(replicas, list)
        else [{"url": f"http://127.0.0.1:{8001 + i}"} for i in range(replicas)],
    }
    fields.update(overrides)
    return pool_create(actor=admin, name=name, **fields)


def make_entitlement(
    admin: Any, tenant: Tenant, pool: TokenPool, name: str, service_class: str = "guaranteed", **overrides: Any
) -> TokenEntitlement:
    fields: dict[str, Any] = {
        "slo_target_ms": 200,
        "tokens_per_second": 100,
        "kv_cache_gib": 2,
        "concurrency": 4,
    }
    fields.update(overrides)
    return entitlement_create(
        actor=admin, name=name, tenant=tenant, pool=pool, service_class=service_class, **fields
    )


@pytest.fixture
def admin(db: Any) -> Any:
    return User.objects.create_superuser("root", "root@example.com", "root-pass-123")


@pytest.fixture
def acme(db: Any) -> Tenant:
    return Tenant.objects.create(name="Acme", slug="acme")


@pytest.fixture
def globex(db: Any) -> Tenant:
    return Tenant.objects.create(name="Globex", slug="globex")


@pytest.fixture
def owner(acme: Tenant) -> Any:
    user = User.objects.create_user("olivia", password="olivia-pass-123")
    Membership.objects.create(tenant=acme, user=user, role=Role.OWNER)
    return user


@pytest.fixture
def member(acme: Tenant) -> Any:
    user = User.objects.create_user("mark", password="mark-pass-123")
    Membership.objects.create(tenant=acme, user=user, role=Role.MEMBER)
    return user


@pytest.fixture
def outsider(globex: Tenant) -> Any:
    """Owner of another tenant: must not see anything of acme."""
    user = User.objects.create_user("oscar", password="oscar-pass-123")
    Membership.objects.create(tenant=globex, user=user, role=Role.OWNER)
    return user


@pytest.fixture
def pool(admin: Any) -> TokenPool:
    return make_pool(admin)
