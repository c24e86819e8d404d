"""The overview on the home page and over /ws/overview/ (issue 28), from real rows (request log, usage
records, quotas) and live samples: what each persona sees (an operator everything, acme's owner acme's
rows only, never globex's), and that a later message carries what changed."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from apps.dashboard import consumers, overview_selectors
from apps.dashboard import history as dashboard_history
from apps.dashboard.consumers import CLOSE_FORBIDDEN, CLOSE_UNAUTHENTICATED
from apps.dashboard.history import MemoryHistory
from apps.dashboard.routing import websocket_urlpatterns
from apps.dashboard.samples import EntitlementPoint, PoolSample
from apps.gateway.models import RequestLogRecord, RequestOutcome, UsageRecord
from apps.tenancy.models import Tenant
from tests.dashboard.conftest import client_for

NOW = dt.datetime.now(dt.UTC)


@pytest.fixture(autouse=True)
def history(settings: Any) -> Iterator[MemoryHistory]:
    settings.DASHBOARD_LOCAL_SAMPLER = False  # no background sampling reading the gateway in these tests
    store = MemoryHistory()
    dashboard_history.reset_history_store(store)
    yield store
    dashboard_history.reset_history_store()


def log(tenant: Tenant, entitlement: str, outcome: str, *, reason: str = "", ttft_ms: float | None = None,
        ago_s: float = 5.0) -> None:
    RequestLogRecord.objects.create(
        request_id=uuid.uuid4().hex, arrived_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=ago_s),
        tenant=tenant, pool="qwen-pool", entitlement=entitlement, service_class="guaranteed", outcome=outcome,
        reason=reason, ttft_ms=ttft_ms)


@pytest.fixture
def traffic(acme: Tenant, globex: Tenant, acme_entitlement: Any, globex_entitlement: Any) -> None:
    """acme-chat: 99 served at 100 ms and one at 900 ms, 3 refused; globex-batch: 2 served, 5 refused."""
    for i in range(100):
        log(acme, "acme-chat", RequestOutcome.SERVED, ttft_ms=900.0 if i == 0 else 100.0)
    for _ in range(3):
        log(acme, "acme-chat", RequestOutcome.REJECTED, reason="concurrency_limit_exceeded")
    for _ in range(2):
        log(globex, "globex-batch", RequestOutcome.SERVED, ttft_ms=50.0)
    for _ in range(5):
        log(globex, "globex-batch", RequestOutcome.REJECTED, reason="pool_contended")
    log(globex, "globex-batch", RequestOutcome.REJECTED, reason="pool_contended", ago_s=20 * 60)  # too old


def live_sample(t: float) -> PoolSample:
    return PoolSample(time=t, pool="qwen-pool", slots=16, running=7, entitlements=(
        EntitlementPoint("acme-chat", "acme", in_flight=3, admitted=2, tokens_per_s=50.0, baseline_tokens_per_s=100.0),
        EntitlementPoint("globex-batch", "globex", in_flight=4, admitted=1, tokens_per_s=100.0,
                         baseline_tokens_per_s=100.0),
    ))


def samples() -> dict[str, list[PoolSample]]:
    return {"qwen-pool": [live_sample(time.time())]}


@pytest.mark.django_db
def test_operator_sees_every_tenant(superuser: Any, traffic: None) -> None:
    data = overview_selectors.overview_get(user=superuser, samples=samples(), now=dt.datetime.now(dt.UTC))
    assert {t.tenant: t.total for t in data.refusals.tenants} == {"acme": 3, "globex": 5}
    slo = {row.entitlement: row for row in data.slo}
    # acme-chat: nearest-rank p99 of 100 TTFTs is the 99th (100 ms); the 900 ms one is the 100th.
    assert (slo["acme-chat"].p99_ms, slo["acme-chat"].within_percent) == (100.0, 99.0)
    assert slo["globex-batch"].requests == 2
    (load,) = data.pools
    assert (load.in_flight, load.tokens_per_s) == (7, 150.0)
    # x = 0.5 and 1.0: (1.5)^2 / (2 * 1.25) = 0.9
    assert (load.fairness, load.fairness_entitlements) == (0.9, 2)


@pytest.mark.django_db
def test_tenant_owner_sees_own_tenant_only(owner: Any, traffic: None) -> None:
    data = overview_selectors.overview_get(user=owner, samples=samples(), now=dt.datetime.now(dt.UTC))
    assert [t.tenant for t in data.refusals.tenants] == ["acme"]
    assert [row.entitlement for row in data.slo] == ["acme-chat"]
    (load,) = data.pools
    # Only acme-chat's 3 in flight (globex's 4 are not theirs to see) against the whole pool's 16 slots.
    assert (load.in_flight, load.slots, load.tokens_per_s) == (3, 16, 50.0)
    assert load.fairness is None  # one entitlement of theirs: nothing to compare


@pytest.mark.django_db
def test_quota_burn_from_the_usage_records(superuser: Any, acme: Tenant, pool: Any) -> None:
    from tests.dashboard.conftest import create_entitlement

    create_entitlement(superuser, acme, pool, "acme-quota", quota_tokens=1_000_000, quota_window="month")
    minute = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    # 90,000 tokens in the last 15 minutes: 100 tokens/s; 10,000 more earlier in the month (not the rate).
    UsageRecord.objects.create(tenant=acme, entitlement="acme-quota", minute=minute - dt.timedelta(minutes=5),
                               requests=10, prompt_tokens=60_000, completion_tokens=30_000)
    earlier = minute - dt.timedelta(minutes=20)
    UsageRecord.objects.create(tenant=acme, entitlement="acme-quota", minute=earlier, requests=1,
                               prompt_tokens=10_000)
    # In this month's window unless the month began under 20 minutes ago.
    used = 100_000 if earlier.month == minute.month else 90_000
    data = overview_selectors.overview_get(user=superuser, samples={}, now=dt.datetime.now(dt.UTC))
    (burn,) = data.quotas
    assert (burn.name, burn.used, burn.rate_per_s) == ("acme-quota", used, 100.0)
    assert burn.exhausted_in_s == pytest.approx((1_000_000 - used) / 100.0)


@pytest.mark.django_db
def test_home_page_renders_the_overview_for_its_viewer(superuser: Any, owner: Any, traffic: None) -> None:
    html = client_for(owner).get("/").content.decode()
    assert 'data-ws="/ws/overview/"' in html and 'id="ov-fig-refusals"' in html
    assert 'data-tenant="acme"' in html and 'data-entitlement="acme-chat"' in html
    assert "globex" not in html
    operator = client_for(superuser).get("/").content.decode()
    assert 'data-tenant="globex"' in operator and 'data-entitlement="globex-batch"' in operator


def communicator(user: Any) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/overview/")
    comm.scope["user"] = user
    return comm


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_overview_socket_is_scoped_and_sends_what_changed(owner: Any, traffic: None, acme: Tenant,
                                                                history: MemoryHistory,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(consumers, "OVERVIEW_PUSH_S", 0.05)
    await history.append(live_sample(time.time()))
    comm = communicator(owner)
    connected, _ = await comm.connect()
    assert connected
    first = await comm.receive_json_from(timeout=5)
    assert first["type"] == "overview" and "globex" not in json.dumps(first)
    assert 'data-tenant="acme"' in first["tables"]
    assert first["figures"]["slo"]["data"][0]["x"] == ["acme-chat"]
    refused = {t["name"]: sum(t["y"]) for t in first["figures"]["refusals"]["data"]}
    assert refused == {"concurrency_limit_exceeded": 3}

    await database_sync_to_async(log)(acme, "acme-chat", RequestOutcome.REJECTED, reason="quota_exceeded")
    for _ in range(50):
        message = await comm.receive_json_from(timeout=5)
        refused = {t["name"]: sum(t["y"]) for t in message["figures"]["refusals"]["data"]}
        if "quota_exceeded" in refused:
            break
    assert refused == {"concurrency_limit_exceeded": 3, "quota_exceeded": 1}
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_overview_socket_refuses_anonymous_and_closes_for_a_deactivated_user(
        owner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    connected, code = await communicator(AnonymousUser()).connect()
    assert (connected, code) == (False, CLOSE_UNAUTHENTICATED)
    monkeypatch.setattr(consumers, "OVERVIEW_PUSH_S", 0.05)
    comm = communicator(owner)
    assert (await comm.connect())[0]
    await comm.receive_json_from(timeout=5)
    owner.is_active = False
    await database_sync_to_async(owner.save)()
    for _ in range(50):
        output = await comm.receive_output(timeout=5)
        if output["type"] == "websocket.close":
            break
    assert output == {"type": "websocket.close", "code": CLOSE_FORBIDDEN}
