"""The live websockets, through Channels' WebsocketCommunicator: refusal of anonymous sockets and of objects
outside the user's tenants, the history on connect and every later sample, cut to what each persona may
see (owner/member of acme, outsider of globex, operator)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.test import Client

from apps.dashboard import history as dashboard_history
from apps.dashboard.consumers import CLOSE_FORBIDDEN, CLOSE_NOT_FOUND, CLOSE_UNAUTHENTICATED
from apps.dashboard.history import MemoryHistory
from apps.dashboard.routing import websocket_urlpatterns
from apps.dashboard.samples import EntitlementPoint, PoolSample
from apps.dashboard.telemetry import pool_group
from apps.tenancy.models import Membership

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]

T0 = 1_800_000_000.0


def sample(i: int) -> PoolSample:
    return PoolSample(
        time=T0 + i, pool="qwen-pool", slots=16, budget=16, running=7, queued=1, kv_usage={"http://r1": 0.3},
        kv_admitted=0.1,
        entitlements=(
            EntitlementPoint("acme-chat", "acme", "guaranteed", in_flight=3, slo_ms=200.0, admitted=2),
            EntitlementPoint("globex-batch", "globex", "spot", in_flight=4, slo_ms=200.0,
                             denied={"pool_contended": 5}),
        ),
    )


@pytest.fixture(autouse=True)
def history(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryHistory]:
    settings.DASHBOARD_LOCAL_SAMPLER = False  # no background sampling reading the gateway in these tests
    store = MemoryHistory()
    dashboard_history.reset_history_store(store)
    monkeypatch.setattr(dashboard_history.time, "time", lambda: T0 + 10)  # "now" for the 15-minute cut
    yield store
    dashboard_history.reset_history_store()


@pytest.fixture
def objects(acme_entitlement: Any, globex_entitlement: Any) -> None:
    """qwen-pool with acme-chat (acme) and globex-batch (globex)."""


def communicator(user: Any, path: str) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), path)
    comm.scope["user"] = user
    return comm


async def open_socket(user: Any, path: str, history: MemoryHistory) -> tuple[WebsocketCommunicator, dict]:
    for i in range(3):
        await history.append(sample(i))
    comm = communicator(user, path)
    connected, _ = await comm.connect()
    assert connected
    first = await comm.receive_json_from(timeout=5)
    assert first["type"] == "history"
    return comm, first


def uids(payload: dict, fid: str) -> set[str]:
    return {t["meta"] for t in payload["figures"][fid]["data"]}


async def test_anonymous_socket_is_refused() -> None:
    comm = communicator(AnonymousUser(), "/ws/pools/qwen-pool/")
    connected, code = await comm.connect()
    assert (connected, code) == (False, CLOSE_UNAUTHENTICATED)


async def test_unknown_pool_and_foreign_entitlement_close_as_not_found(objects: None, outsider: Any) -> None:
    for path in ("/ws/pools/nope/", "/ws/entitlements/acme-chat/", "/ws/entitlements/nope/"):
        connected, code = await communicator(outsider, path).connect()
        assert (connected, code) == (False, CLOSE_NOT_FOUND), path


async def test_operator_gets_whole_pool_history_then_each_sample(objects: None, superuser: Any,
                                                                 history: MemoryHistory) -> None:
    comm, first = await open_socket(superuser, "/ws/pools/qwen-pool/", history)
    assert {"inflight:acme-chat", "inflight:globex-batch"} <= uids(first, "inflight")
    inflight = {t["meta"]: t for t in first["figures"]["inflight"]["data"]}
    assert inflight["inflight:globex-batch"]["y"] == [4, 4, 4]
    assert "kv" in first["figures"]

    await get_channel_layer().group_send(pool_group("qwen-pool"), {"type": "pool.sample", "sample": sample(3).to_dict()})
    update = await comm.receive_json_from(timeout=5)
    assert update["type"] == "update" and update["time"] == (T0 + 3) * 1000
    points = {t["meta"]: t["y"] for t in update["traces"]["queue"]}
    assert points["queue:running"] == [7]
    await comm.disconnect()


@pytest.fixture(params=["owner", "member"])
def tenant_user(request: Any, owner: Any, member: Any) -> Any:
    return owner if request.param == "owner" else member


async def test_tenant_user_sees_only_own_entitlements_on_the_pool(objects: None, tenant_user: Any,
                                                                  history: MemoryHistory) -> None:
    comm, first = await open_socket(tenant_user, "/ws/pools/qwen-pool/", history)
    assert "globex" not in json.dumps(first)
    assert "inflight:acme-chat" in uids(first, "inflight")
    assert "kv" not in first["figures"]  # pool-wide KV usage mixes every tenant's load
    queue = {t["meta"]: t for t in first["figures"]["queue"]["data"]}
    assert queue["queue:running"]["y"] == []

    await get_channel_layer().group_send(pool_group("qwen-pool"), {"type": "pool.sample", "sample": sample(3).to_dict()})
    update = await comm.receive_json_from(timeout=5)
    assert "globex" not in json.dumps(update)
    assert any(t["meta"] == "inflight:acme-chat" for t in update["traces"]["inflight"])
    await comm.disconnect()


async def test_outsider_sees_the_pool_but_not_acme(objects: None, outsider: Any, history: MemoryHistory) -> None:
    comm, first = await open_socket(outsider, "/ws/pools/qwen-pool/", history)
    text = json.dumps(first)
    assert "acme" not in text and "inflight:globex-batch" in uids(first, "inflight")
    await comm.disconnect()


async def test_entitlement_socket_streams_that_entitlement_only(objects: None, superuser: Any,
                                                                history: MemoryHistory) -> None:
    comm, first = await open_socket(superuser, "/ws/entitlements/acme-chat/", history)
    assert "globex" not in json.dumps(first)
    assert "kv" not in first["figures"]
    await comm.disconnect()


async def test_history_older_than_fifteen_minutes_is_not_sent(objects: None, superuser: Any,
                                                              history: MemoryHistory) -> None:
    await history.append(PoolSample(time=T0 + 10 - dashboard_history.HISTORY_SECONDS - 5, pool="qwen-pool", budget=99))
    comm, first = await open_socket(superuser, "/ws/pools/qwen-pool/", history)
    budget = {t["meta"]: t for t in first["figures"]["aimd"]["data"]}["aimd:budget"]
    assert budget["y"] == [16, 16, 16]
    await comm.disconnect()


async def _signed_in(user: Any) -> tuple[Client, list[tuple[bytes, bytes]]]:
    """A browser signed in as `user`: its test client and the headers its websocket sends (origin, cookie)."""
    from asgiref.sync import sync_to_async

    client = Client()
    await sync_to_async(client.force_login)(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    return client, [(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1"), (b"cookie", cookie)]


async def test_the_site_application_authenticates_by_session_cookie(objects: None, member: Any,
                                                                    history: MemoryHistory) -> None:
    """The real ASGI stack (origin check, session auth, routing) of tokenpools_site.asgi."""
    from tokenpools_site.asgi import application

    _client, headers = await _signed_in(member)
    comm = WebsocketCommunicator(application, "/ws/pools/qwen-pool/", headers=headers)
    connected, _ = await comm.connect()
    assert connected
    first = await comm.receive_json_from(timeout=5)
    assert first["type"] == "history"
    await comm.disconnect()

    anonymous = WebsocketCommunicator(application, "/ws/pools/qwen-pool/", headers=headers[:2])
    connected, code = await anonymous.connect()
    assert (connected, code) == (False, CLOSE_UNAUTHENTICATED)


# --- losing access closes the socket (issue 22: tenants see only themselves) ----------------------------------

RECHECK_S = 0.2


async def _closed_within(comm: WebsocketCommunicator, seconds: float) -> tuple[int, float]:
    """The close code the server sent, and after how long; samples keep flowing meanwhile (none may pass)."""
    started = time.monotonic()
    while True:
        await get_channel_layer().group_send(pool_group("qwen-pool"),
                                             {"type": "pool.sample", "sample": sample(9).to_dict()})
        message = await comm.receive_output(timeout=seconds)
        if message["type"] == "websocket.close":
            return message["code"], time.monotonic() - started
        assert time.monotonic() - started < seconds, "still streaming"


@pytest.mark.parametrize("path", ["/ws/pools/qwen-pool/", "/ws/entitlements/acme-chat/"])
@pytest.mark.parametrize("loss", ["membership removed", "user deactivated"])
async def test_a_socket_is_closed_soon_after_its_user_loses_access(
        objects: None, tenant_user: Any, history: MemoryHistory, settings: Any, path: str, loss: str) -> None:
    settings.DASHBOARD_ACCESS_RECHECK_S = RECHECK_S
    comm, _first = await open_socket(tenant_user, path, history)
    if loss == "membership removed":
        await database_sync_to_async(Membership.objects.filter(user=tenant_user).delete)()
    else:
        tenant_user.is_active = False
        await database_sync_to_async(tenant_user.save)()
    code, after_s = await _closed_within(comm, 5.0)
    print(f"{loss}, {path}: closed {code} after {after_s:.2f} s (re-check every {RECHECK_S} s)")
    assert code == CLOSE_FORBIDDEN
    await comm.disconnect()


async def test_signing_out_closes_the_sockets_of_that_session(objects: None, member: Any, history: MemoryHistory,
                                                              settings: Any) -> None:
    """Through the real ASGI stack with the browser's session cookie: the session ends (sign-out), the socket
    is closed, though the user and the membership are unchanged."""
    from asgiref.sync import sync_to_async

    from tokenpools_site.asgi import application

    settings.DASHBOARD_ACCESS_RECHECK_S = RECHECK_S
    client, headers = await _signed_in(member)
    comm = WebsocketCommunicator(application, "/ws/pools/qwen-pool/", headers=headers)
    connected, _ = await comm.connect()
    assert connected
    assert (await comm.receive_json_from(timeout=5))["type"] == "history"
    assert await comm.receive_nothing(timeout=3 * RECHECK_S)  # still signed in: three re-checks, no close
    await sync_to_async(client.logout)()
    code, after_s = await _closed_within(comm, 5.0)
    print(f"signed out: closed {code} after {after_s:.2f} s")
    assert code == CLOSE_FORBIDDEN
    await comm.disconnect()


async def test_a_socket_whose_user_keeps_access_stays_open(objects: None, owner: Any, history: MemoryHistory,
                                                           settings: Any) -> None:
    settings.DASHBOARD_ACCESS_RECHECK_S = RECHECK_S
    comm, _first = await open_socket(owner, "/ws/entitlements/acme-chat/", history)
    assert await comm.receive_nothing(timeout=5 * RECHECK_S)  # five re-checks, no close
    await get_channel_layer().group_send(pool_group("qwen-pool"), {"type": "pool.sample", "sample": sample(3).to_dict()})
    assert (await comm.receive_json_from(timeout=5))["type"] == "update"
    await comm.disconnect()
