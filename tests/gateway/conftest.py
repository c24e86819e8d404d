from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from apps.gateway.app import Gateway
from apps.gateway.config import GatewayConfig
from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.snapshot import SnapshotCache, snapshot_load
from apps.gateway.state import GatewayStateStore
from apps.tenancy.models import Tenant
from apps.tenancy.services import apikey_create
from tests.gateway.servers import ServerThread
from tests.gateway.upstream import Upstream
from tests.pools.factories import (  # noqa: F401
    acme,
    admin,
    globex,
    make_entitlement,
    make_pool,
    member,
    outsider,
    owner,
)


@dataclass
class Harness:
    gateway: Gateway
    server: ServerThread
    secret: str
    upstreams: list[Upstream]
    entitlement: Any
    pool: Any
    secrets: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    def auth(self, secret: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {secret or self.secret}"}

    def usage(self, name: str | None = None) -> Any:
        snapshot = self.gateway.snapshots.current
        assert snapshot is not None
        entry = next(e for e in snapshot.keys.values() if e.entitlement == (name or self.entitlement.name))
        assert self.gateway.store is not None
        return self.server.call(self.gateway.store.entitlement_usage(limits=entry.limits, pool=entry.pool_name))

    def running(self) -> int:
        return self.server.call(_running(self.gateway))


async def _running(gateway: Gateway) -> int:
    return sum(1 for _ in gateway.in_flight.contexts())


@pytest.fixture
def upstream_factory() -> Iterator[Callable[..., tuple[Upstream, ServerThread]]]:
    started: list[ServerThread] = []

    def start(**options: Any) -> tuple[Upstream, ServerThread]:
        upstream = Upstream(**options)
        server = ServerThread(upstream).start()
        upstream.url = server.url
        started.append(server)
        return upstream, server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def gateway_factory(
    admin: Any, acme: Tenant, upstream_factory: Callable[..., tuple[Upstream, ServerThread]]  # noqa: F811
) -> Iterator[Callable[..., Harness]]:
    servers: list[tuple[ServerThread, Gateway]] = []

    def build(
        *,
        upstreams: list[Upstream] | None = None,
        replica_urls: list[str] | None = None,
        store: GatewayStateStore | None = None,
        entitlement: dict[str, Any] | None = None,
        pool: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        extra_entitlements: dict[str, dict[str, Any]] | None = None,
        pool_model: dict[str, Any] | None = None,
    ) -> Harness:
        if upstreams is None:
            upstreams = [upstream_factory()[0]]
        if replica_urls is None:
            replica_urls = [u.url for u in upstreams]
        pool_obj = make_pool(admin, name="tiny", replicas=[{"url": url} for url in replica_urls],
                             **{"model_name": "tiny-model", "tokens_per_second_per_replica": 100_000, **(pool or {})})
        if pool_model:  # fields set on the model itself (the pool's backend kind and objectives: issue 24)
            for name, value in pool_model.items():
                setattr(pool_obj, name, value)
            pool_obj.save()
        ent_fields = {"tokens_per_second": 1000, "concurrency": 4, **(entitlement or {})}
        service_class = ent_fields.pop("service_class", "guaranteed")
        ent = make_entitlement(admin, acme, pool_obj, "acme-chat", service_class=service_class, **ent_fields)
        _, secret = apikey_create(actor=admin, entitlement=ent)
        secrets = {ent.name: secret}
        for name, fields in (extra_entitlements or {}).items():
            fields = dict(fields)
            cls = fields.pop("service_class", "elastic")
            other = make_entitlement(admin, acme, pool_obj, name, service_class=cls, **fields)
            secrets[name] = apikey_create(actor=admin, entitlement=other)[1]
        cfg = GatewayConfig(**{"background": False, "tokenize": True, **(config or {})})
        snapshots = SnapshotCache(config=cfg, initial=snapshot_load(config=cfg))
        gateway = Gateway(config=cfg, snapshots=snapshots, store=store or MemoryStateStore(config=cfg.admission_config()))
        server = ServerThread(gateway).start()
        servers.append((server, gateway))
        return Harness(gateway, server, secret, upstreams, ent, pool_obj, secrets)

    yield build
    for server, gateway in servers:
        try:
            server.call(gateway.stop())
        finally:
            server.stop()
