"""The gateway's state on a real Redis Cluster (GATEWAY_REDIS_CLUSTER): every transition runs on the one
shard that owns its pool's slot (no CROSSSLOT), as the ledger says (the conformance scenarios); gateway
processes on it never admit past an entitlement's concurrency; a primary SIGKILLed under load costs its
pools a few seconds of 503 state_store_unavailable and nothing else (tests/gateway/cluster_load.py)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from apps.gateway.redis_state import RedisStateStore
from apps.policy import ManualClock
from tests.conformance.drivers import CONFIG, LedgerDriver, StoreDriver
from tests.conformance.scenarios import SCENARIOS, Scenario
from tests.conformance.test_conformance import _same, _trace
from tests.conformance.transitions import TRANSITION_SCENARIOS
from tests.support.cluster_load import CONCURRENCY, cluster_site, load
from tests.support.redis_cluster import slot_of

pytestmark = pytest.mark.redis


class ClusterDriver(StoreDriver):
    """The Redis store on the cluster, each scenario under a prefix of its own (a second gateway process for a
    `Race` step on the cluster too)."""

    def _redis_store(self, clock: ManualClock, kind: type[RedisStateStore] = RedisStateStore) -> RedisStateStore:
        assert self.redis_url is not None
        return kind(url=self.redis_url, clock=clock, config=CONFIG, cluster=True, prefix=self.prefix,
                    lease_s=self.scenario.lease_s)


ALL_SCENARIOS = (*SCENARIOS, *TRANSITION_SCENARIOS)


@pytest.mark.parametrize("scenario", ALL_SCENARIOS, ids=[s.name for s in ALL_SCENARIOS])
def test_cluster_store_behaves_as_the_ledger(scenario: Scenario, redis_cluster: Any) -> None:
    reference = asyncio.run(_trace(LedgerDriver(), scenario))
    observed = asyncio.run(_trace(ClusterDriver("redis-cluster", redis_cluster.url), scenario))
    for expected, got in zip(reference, observed, strict=True):
        assert _same(expected, got), f"the cluster store differs from the ledger:\n  ledger: {expected}\n  store:  {got}"


def _pools_idle(cluster_url: str, pools: list[str]) -> dict[str, list[int]]:
    """Each pool's running, waiting and queued requests as the cluster holds them."""

    async def read() -> dict[str, list[int]]:
        store = RedisStateStore(url=cluster_url, cluster=True)
        try:
            held: dict[str, list[int]] = {}
            for pool in pools:
                held[pool] = [int(float((await store.record_fields(pool=pool, field=name, records=["pool"]))[0] or 0))
                              for name in ("running", "waiting", "queued")]
            return held
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.mark.slow
def test_four_gateway_processes_on_the_cluster_never_admit_past_concurrency(
        tmp_path: Path, redis_cluster: Any, redis_url: str) -> None:
    """4 processes, 3 pools on 3 primaries, 5,000 requests from 36 closed-loop clients (12 per pool against an
    entitlement of 4): no backend ever serves more than its entitlement's concurrency at once."""
    requests = 5000
    with cluster_site(tmp_path, redis_cluster, redis_url, workers=4) as target:
        primaries = {redis_cluster.owner(slot_of(f"tp:gw:{{{pool}}}:pool")) for pool in target.pools}
        assert len(primaries) == 3
        started = time.monotonic()
        asyncio.run(load(target, requests=requests, clients_per_pool=12))
        elapsed = time.monotonic() - started
        held = _pools_idle(redis_cluster.url, target.pools)
    statuses = Counter(answer.status for answer in target.answers)
    peaks = {pool: backend.peak for pool, backend in target.backends.items()}
    print(f"\ncluster over-admission: {len(target.answers)} requests in {elapsed:.1f} s "
          f"({len(target.answers) / elapsed:.0f}/s) over 4 processes, statuses {dict(statuses)}, "
          f"backend peaks {peaks} (entitlement concurrency {CONCURRENCY})")
    assert len(target.answers) == requests
    # 429: a queue wait past the acquire timeout; 503 (the store slower than its socket timeout on a loaded
    # machine) may happen, rarely; a 500 never.
    assert set(statuses) <= {200, 429, 503}, (statuses, Counter(a.code for a in target.answers if a.status != 200))
    assert statuses[503] <= requests // 100, statuses
    for pool in target.pools:
        assert peaks[pool] <= CONCURRENCY, f"{pool}: {peaks[pool]} at once against a concurrency of {CONCURRENCY}"
        assert peaks[pool] == CONCURRENCY  # the limit was reached: the clients did contend
        assert any(a.status == 200 for a in target.answers if a.pool == pool)
    assert all(counts == [0, 0, 0] for counts in held.values()), held


@pytest.mark.slow
def test_a_primary_killed_under_load_costs_its_pools_a_failover_and_nothing_else(
        tmp_path: Path, redis_cluster: Any, redis_url: str) -> None:
    """SIGKILL the primary of one pool's slot under load: that pool answers 503 state_store_unavailable until
    its replica is promoted, then 200 again with nobody's help; the pools on the other primaries never answer
    503; once the leases have run out nothing is held. Prints the failover gap."""
    lease_s = 2.0
    env = {"GATEWAY_LEASE_S": str(lease_s), "GATEWAY_LEASE_RENEW_S": "0.5"}
    with cluster_site(tmp_path, redis_cluster, redis_url, workers=4, env=env) as target:
        pool = target.pools[0]
        victim = redis_cluster.owner(slot_of(f"tp:gw:{{{pool}}}:pool"))

        async def run() -> float:
            stop = asyncio.Event()
            task = asyncio.create_task(load(target, requests=10**9, clients_per_pool=6, stop=stop))
            await asyncio.sleep(3.0)
            killed_at = time.monotonic()
            redis_cluster.kill(victim)
            deadline = killed_at + 60
            while time.monotonic() < deadline and not any(
                    a.pool == pool and a.status == 200 and a.sent > killed_at for a in target.answers):
                await asyncio.sleep(0.05)
            await asyncio.sleep(3.0)  # served by the promoted replica for a while
            stop.set()
            await task
            return killed_at

        try:
            killed_at = asyncio.run(run())
            time.sleep(lease_s + 2.0)  # every lease a lost write or a failed release left has run out, and was reaped
            held = _pools_idle(redis_cluster.url, target.pools)
        finally:
            redis_cluster.restart(victim)  # back as a replica of the promoted one, for the tests after this one
    after = [a for a in target.answers if a.at > killed_at]
    victims = [a for a in after if a.pool == pool]
    # Admitted after the kill: by the promoted replica (a 200 answered after the kill to a request admitted
    # before it is not a recovery).
    recovered = [a.at for a in victims if a.status == 200 and a.sent > killed_at]
    assert recovered, "the pool never answered 200 again after its primary was killed"
    gap = min(recovered) - killed_at
    refused = Counter((a.status, a.code) for a in victims if a.status != 200)
    others = Counter((a.pool, a.status) for a in after if a.pool != pool)
    slowest = max(a.at - a.sent for a in after if a.pool != pool)
    slowest_before = max(a.at - a.sent for a in target.answers if a.pool != pool and a.at <= killed_at)
    print(f"\ncluster failover: primary :{victim} of pool {pool} SIGKILLed; first 200 on it again after {gap:.2f} s; "
          f"its refusals {dict(refused)}; the other pools after the kill {dict(others)}, slowest answer "
          f"{slowest:.2f} s (before the kill {slowest_before:.2f} s); "
          f"peaks {({p: b.peak for p, b in target.backends.items()})}")
    assert refused[(503, "state_store_unavailable")] > 0
    assert {code for code in refused} <= {(503, "state_store_unavailable"), (429, "")} | {
        (429, code) for _, code in refused}
    assert not any(a.status >= 500 for a in after if a.pool != pool), others
    for other in target.pools[1:]:  # they kept serving through the gap
        assert any(a.pool == other and a.status == 200 and killed_at < a.sent and a.at < killed_at + gap
                   for a in after), other
    assert all(counts == [0, 0, 0] for counts in held.values()), held


def test_a_node_without_the_library_gets_it_again(redis_cluster: Any) -> None:
    """FUNCTION FLUSH on every primary (a node that joined empty): the next call answers "Function not found",
    the store loads the library on every primary and the call goes through; every primary has it after."""

    async def libraries(store: RedisStateStore) -> list[int]:
        return [len(await store.redis.execute_command("FUNCTION LIST", target_nodes=node))
                for node in store.redis.get_primaries()]

    async def run() -> tuple[list[int], int, list[int]]:
        store = RedisStateStore(url=redis_cluster.url, cluster=True, prefix="tp:reload:")
        try:
            await store.pool_running(pool="reload")
            await store.redis.function_flush()  # routed to every primary
            flushed = await libraries(store)
            running = await store.pool_running(pool="reload")
            return flushed, running, await libraries(store)
        finally:
            await store.close()

    flushed, running, loaded = asyncio.run(run())
    assert flushed == [0, 0, 0]
    assert running == 0
    assert loaded == [1, 1, 1]


def test_the_state_store_has_a_redis_of_its_own_when_named(settings: Any) -> None:
    """GATEWAY_REDIS_URL names the store's Redis (REDIS_URL stays Celery's and the channel layer's); without it
    the store shares REDIS_URL."""
    from apps.gateway.config import GatewayConfig

    settings.REDIS_URL = "redis://127.0.0.1:6999/0"
    settings.GATEWAY_REDIS_URL = ""
    settings.GATEWAY_REDIS_CLUSTER = False
    assert (GatewayConfig.from_settings().redis_url, GatewayConfig.from_settings().redis_cluster) == (
        "redis://127.0.0.1:6999/0", False)
    settings.GATEWAY_REDIS_URL = "redis://127.0.0.1:7000"
    settings.GATEWAY_REDIS_CLUSTER = True
    config = GatewayConfig.from_settings()
    assert (config.redis_url, config.redis_cluster) == ("redis://127.0.0.1:7000", True)
