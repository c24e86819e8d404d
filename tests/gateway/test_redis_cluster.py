"""The gateway's state on a real Redis Cluster (GATEWAY_REDIS_CLUSTER): every transition runs on the one
shard that owns its pool's slot (no CROSSSLOT), as the ledger says (the conformance scenarios); gateway
processes on it never admit past an entitlement's concurrency; a primary SIGKILLed under load costs its
pools a few seconds of 503 state_store_unavailable and nothing else (tests/gateway/cluster_load.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from apps.gateway.redis_state import RedisStateStore
from apps.policy import ManualClock
from tests.conformance.drivers import CONFIG, LedgerDriver, StoreDriver
from tests.conformance.scenarios import SCENARIOS, Scenario
from tests.conformance.test_conformance import _same, _trace

pytestmark = pytest.mark.redis


class ClusterDriver(StoreDriver):
    """The Redis store on the cluster, each scenario under a prefix of its own."""

    def _store(self, clock: ManualClock) -> Any:
        import uuid

        assert self.redis_url is not None
        return RedisStateStore(url=self.redis_url, clock=clock, config=CONFIG, cluster=True,
                               prefix=f"tp:conf:{uuid.uuid4().hex}:")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_cluster_store_behaves_as_the_ledger(scenario: Scenario, redis_cluster: Any) -> None:
    reference = asyncio.run(_trace(LedgerDriver(), scenario))
    observed = asyncio.run(_trace(ClusterDriver("redis-cluster", redis_cluster.url), scenario))
    for expected, got in zip(reference, observed, strict=True):
        assert _same(expected, got), f"the cluster store differs from the ledger:\n  ledger: {expected}\n  store:  {got}"
