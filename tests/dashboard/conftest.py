"""Personas and objects for the admin UI tests: a superuser, acme's owner and member, and an outsider.

Built through the services (not factories writing rows directly) so binding has run and the pages show
real states.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from apps.pools.models import TokenEntitlement, TokenPool
from apps.pools.services import entitlement_create, pool_create
from apps.tenancy.models import Membership, Role, Tenant
from apps.tenancy.services import apikey_create

PASSWORD = "correct-horse-battery-9"


def create_pool(actor: Any, name: str = "qwen-pool", replicas: int = 1, **overrides: Any) -> TokenPool:
    """Per replica: 16 slots, 1000 tokens/s, 8 GiB of KV; a 36-layer, 8-KV-head, 128-dim model in bf16."""
    fields: dict[str, Any] = {
        "model_name": "Qwen/Qwen3-8B",
        "max_replicas": 4,
        "slots_per_replica": 16,
        "tokens_per_second_per_replica": 1000,
        "kv_cache_gib_per_replica": 8,
        "kv_layers": 36,
        "kv_heads": 8,
        "head_dim": 128,
        "replicas": [{"url": f"http://127.0.0.1:{9100 + i}"} for i in range(replicas)],
    }
    fields.update(overrides)
    return pool_create(actor=actor, name=name, **fields)


def create_entitlement(
    actor: Any, tenant: Tenant, pool: TokenPool, name: str, **overrides: Any
) -> TokenEntitlement:
    fields: dict[str, Any] = {
        "service_class": "guaranteed",
        "slo_target_ms": 200,
        "tokens_per_second": 100,
        "kv_cache_gib": 2,
        "concurrency": 4,
    }
    fields.update(overrides)
    return entitlement_create(actor=actor, name=name, tenant=tenant, pool=pool, **fields)


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """PBKDF2's many rounds cost about half a second per user on this machine; these tests are not about it."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _user(username: str, tenant: Tenant | None = None, role: str | None = None) -> Any:
    user = get_user_model().objects.create_user(username, password=PASSWORD)
    if tenant is not None and role is not None:
        Membership.objects.create(tenant=tenant, user=user, role=role)
    return user


@pytest.fixture
def superuser(db: Any) -> Any:
    return get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)


@pytest.fixture
def acme(db: Any) -> Tenant:
    return Tenant.objects.create(name="Acme Corp", slug="acme")


@pytest.fixture
def globex(db: Any) -> Tenant:
    return Tenant.objects.create(name="Globex", slug="globex")


@pytest.fixture
def owner(acme: Tenant) -> Any:
    return _user("olivia", acme, Role.OWNER)


@pytest.fixture
def member(acme: Tenant) -> Any:
    return _user("mark", acme, Role.MEMBER)


@pytest.fixture
def outsider(globex: Tenant) -> Any:
    """Owner of another tenant: acme's objects must not exist for them."""
    return _user("oscar", globex, Role.OWNER)


@pytest.fixture
def pool(superuser: Any) -> TokenPool:
    return create_pool(superuser)


@pytest.fixture
def acme_entitlement(superuser: Any, acme: Tenant, pool: TokenPool) -> TokenEntitlement:
    return create_entitlement(superuser, acme, pool, "acme-chat")


@pytest.fixture
def globex_entitlement(superuser: Any, globex: Tenant, pool: TokenPool) -> TokenEntitlement:
    return create_entitlement(superuser, globex, pool, "globex-batch", service_class="spot")


@pytest.fixture
def member_key(member: Any, acme_entitlement: TokenEntitlement) -> Any:
    key, _secret = apikey_create(actor=member, entitlement=acme_entitlement, name="member-laptop")
    return key


def client_for(user: Any, *, enforce_csrf_checks: bool = False) -> Client:
    client = Client(enforce_csrf_checks=enforce_csrf_checks)
    client.force_login(user)
    return client
