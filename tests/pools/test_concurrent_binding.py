"""On PostgreSQL, concurrent binders serialize on the pool row: the pool is never oversubscribed."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, connections

from apps.pools.models import TokenEntitlement
from apps.tenancy.models import Tenant
from tests.pools.factories import make_entitlement, make_pool

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_parallel_creates_bind_at_most_what_fits() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("row locks are only meaningful on PostgreSQL (the Makefile runs this there)")
    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw-123456789")
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    pool = make_pool(admin)  # 16 slots
    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def create(i: int) -> None:
        try:
            barrier.wait()
            make_entitlement(admin, tenant, pool, f"e{i}", "guaranteed", concurrency=5, tokens_per_second=10)
        except BaseException as exc:  # reported below, a thread must not swallow it
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    states = list(TokenEntitlement.objects.values_list("state", flat=True))
    assert sorted(states) == ["Bound"] * 3 + ["Degraded"] * 3  # 3 x 5 slots fit in 16, a 4th would not
