"""The gateway's immutable picture of keys, entitlements and pools, and the task that keeps it fresh.

Per request the gateway does one SHA-256 and one dict lookup (`Snapshot.key_for`); the ORM is read
only by `snapshot_load`, in a worker thread, when `gateway_change_marker` moves (polled every
`snapshot_poll_s`, 0.5 s by default) or when a model signal in this process bumps the local version,
so a revoked key or a changed entitlement is refused within a second on every process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from apps.gateway.config import GatewayConfig
from apps.policy import EntitlementLimits, EntitlementState, ServiceClass
from apps.policy.quota import QuotaRule

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolInfo:
    name: str
    model_name: str
    replica_urls: tuple[str, ...]
    concurrency_capacity: int
    kv_capacity: float
    kv_bytes_per_token: int
    context_window: int
    mean_slo_ms: float = 1000.0
    # (entitlement id, concurrency, kv bytes) of Bound dedicated/guaranteed entitlements: their idle
    # reservations are withheld from other classes by the policy.
    reserved: tuple[tuple[str, int, float], ...] = ()
    # Every entitlement of the pool, whatever its state: the admission state machine's view of the pool.
    entitlements: tuple[EntitlementLimits, ...] = ()
    # What the pool's replica URLs are (issue 24): "vllm" servers, or an "llm-d" inference gateway, which is
    # handed the tenant and the served class's InferenceObjective (`objective_for`) on every request.
    backend_kind: str = "vllm"
    objectives: tuple[tuple[str, str], ...] = ()

    def objective_for(self, service_class: str) -> str:
        """The InferenceObjective name of a served class: the pool's map, else `tokenpools-<class>`."""
        for name, objective in self.objectives:
            if name == service_class:
                return objective
        return f"tokenpools-{service_class}"


class EntitlementIndex:
    """Each pool's entitlements by id, built again only when the pool's sequence of them is a new one (a new
    snapshot): the store's tick and the store view look entitlements up by id every second."""

    __slots__ = ("_built",)

    def __init__(self) -> None:
        self._built: dict[str, tuple[Sequence[EntitlementLimits], dict[str, EntitlementLimits]]] = {}

    def of(self, pool: str, entitlements: Sequence[EntitlementLimits]) -> dict[str, EntitlementLimits]:
        built = self._built.get(pool)
        if built is None or built[0] is not entitlements:
            built = self._built[pool] = (entitlements, {limits.entitlement_id: limits for limits in entitlements})
        return built[1]


@dataclass(frozen=True, slots=True)
class KeyEntry:
    key_id: int
    tenant_id: int
    tenant_slug: str
    limits: EntitlementLimits
    pool_name: str
    key_expires_at: float | None = None
    entitlement_expires_at: float | None = None
    expired_limits: EntitlementLimits | None = None
    # The entitlement's quota and its tenant's, with what their windows had used at load time.
    quotas: tuple[QuotaRule, ...] = ()

    @property
    def entitlement(self) -> str:
        return self.limits.entitlement_id

    def limits_at(self, now_epoch: float) -> EntitlementLimits:
        """The limits, with the state Expired once the entitlement's expiry passed (before any tick)."""
        if self.entitlement_expires_at is not None and now_epoch >= self.entitlement_expires_at:
            return self.expired_limits or self.limits
        return self.limits


@dataclass(frozen=True)
class Snapshot:
    keys: Mapping[str, KeyEntry] = field(default_factory=dict)
    pools: Mapping[str, PoolInfo] = field(default_factory=dict)
    version: int = 0
    # Backend model name -> pool (the first pool by name serving it).
    models: Mapping[str, PoolInfo] = field(default_factory=dict)
    # Entitlement name -> (tenant slug, pool name): the `tenant` and `pool` labels of its metrics.
    owners: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def key_for(self, secret: str, now_epoch: float) -> KeyEntry | None:
        entry = self.keys.get(hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest())
        if entry is None or (entry.key_expires_at is not None and now_epoch >= entry.key_expires_at):
            return None
        return entry

    def pool_for_model(self, model: str) -> PoolInfo | None:
        """The model name selects the pool: the pool's own name or the model it serves."""
        pool = self.pools.get(model)
        return pool if pool is not None else self.models.get(model)


def _epoch(value: Any) -> float | None:
    return None if value is None else value.timestamp()


def entitlement_limits(
    ent: Any, *, kv_bytes_per_token: float, tenant_id: str = "", default_max_tokens: int = 256,
    context_window: int = 4096,
) -> EntitlementLimits:
    """The policy engine's view of a `TokenEntitlement` row (the one translation from the ORM)."""
    return EntitlementLimits(
        entitlement_id=ent.name,
        service_class=ent.service_class,
        tokens_per_second=float(ent.tokens_per_second),
        kv_bytes=float(ent.kv_cache_bytes),
        concurrency=ent.concurrency,
        slo_target_ms=float(ent.slo_target_ms),
        default_max_tokens=ent.default_max_tokens or default_max_tokens,
        context_window=context_window,
        kv_bytes_per_token=kv_bytes_per_token,
        state=ent.effective_state().lower(),
        tenant_id=tenant_id,
        # The entitlement's own queue; None (blank) takes the service class's default in the policy.
        queue_max=ent.queue_max,
        queue_max_wait_ms=None if ent.queue_max_wait_ms is None else float(ent.queue_max_wait_ms),
        spillover_class=ent.spillover_class or None,
    )


def snapshot_load(*, config: GatewayConfig, version: int = 0) -> Snapshot:
    """Build a snapshot from the ORM (blocking; call it from a thread in async code)."""
    from apps.gateway.quotas import QuotaRules
    from apps.gateway.selectors import gateway_active_keys, gateway_pools

    pools: dict[str, PoolInfo] = {}
    owners: dict[str, tuple[str, str]] = {}
    limits_by_name: dict[str, dict[str, EntitlementLimits]] = {}
    for pool in gateway_pools():
        urls = tuple(r.url.rstrip("/") for r in sorted(pool.replicas.all(), key=lambda r: (r.position, r.id))
                     if r.enabled)
        per = pool.per_replica_capacity
        # What one replica's KV cache really holds, once the workers' scrape measured it.
        kv_per_replica = getattr(pool, "measured_kv_cache_bytes_per_replica", None) or per.kv_bytes
        every = list(pool.entitlements.all())
        bound = [e for e in every if e.effective_state() == "Bound"]
        slos = [e.slo_target_ms for e in bound]
        limits_by_name[pool.name] = {
            e.name: entitlement_limits(
                e, kv_bytes_per_token=float(pool.bytes_per_token), tenant_id=str(e.tenant_id),
                default_max_tokens=config.default_max_tokens, context_window=config.context_window,
            )
            for e in every
        }
        owners.update((e.name, (e.tenant.slug, pool.name)) for e in every)
        pools[pool.name] = PoolInfo(
            name=pool.name,
            model_name=pool.model_name,
            replica_urls=urls,
            concurrency_capacity=len(urls) * per.slots,
            kv_capacity=float(len(urls) * kv_per_replica),
            kv_bytes_per_token=pool.bytes_per_token,
            context_window=config.context_window,
            mean_slo_ms=(sum(slos) / len(slos)) if slos else 1000.0,
            reserved=tuple(
                (e.name, e.concurrency, float(e.kv_cache_bytes)) for e in bound
                if ServiceClass.parse(e.service_class).traits.reserved
            ),
            entitlements=tuple(limits_by_name[pool.name].values()),
            backend_kind=pool.backend_kind,
            objectives=tuple(sorted((str(k), str(v)) for k, v in (pool.inference_objectives or {}).items())),
        )
    keys: dict[str, KeyEntry] = {}
    quota_rules = QuotaRules(dt.datetime.now(dt.UTC))
    rules_by_entitlement: dict[int, tuple[QuotaRule, ...]] = {}
    for key in gateway_active_keys():
        ent = key.entitlement
        pool_info = pools.get(ent.pool.name)
        if pool_info is None:
            continue
        # The same object as the pool's view of the entitlement: the state machine sees one set of limits.
        limits = limits_by_name[pool_info.name].get(ent.name) or entitlement_limits(
            ent, kv_bytes_per_token=float(pool_info.kv_bytes_per_token), tenant_id=str(key.tenant_id),
            default_max_tokens=config.default_max_tokens, context_window=pool_info.context_window,
        )
        keys[key.secret_hash] = KeyEntry(
            key_id=key.pk,
            tenant_id=key.tenant_id,
            tenant_slug=key.tenant.slug,
            limits=limits,
            pool_name=pool_info.name,
            # The DRR stage's queue needs room for one (0, the state machine's "refused at once", is not its).
            key_expires_at=_epoch(key.expires_at),
            entitlement_expires_at=_epoch(ent.expires_at),
            expired_limits=replace(limits, state=EntitlementState.EXPIRED) if ent.expires_at else None,
            quotas=_rules_of(ent, quota_rules, rules_by_entitlement),
        )
    models: dict[str, PoolInfo] = {}
    for pool_info in pools.values():
        models.setdefault(pool_info.model_name, pool_info)
    return Snapshot(keys=MappingProxyType(keys), pools=MappingProxyType(pools), version=version,
                    models=MappingProxyType(models), owners=MappingProxyType(owners))


def _rules_of(ent: Any, rules: Any, by_entitlement: dict[int, tuple[QuotaRule, ...]]) -> tuple[QuotaRule, ...]:
    if ent.pk not in by_entitlement:
        by_entitlement[ent.pk] = rules.for_entitlement(ent)
    return by_entitlement[ent.pk]


# Bumped by the model signal receivers (apps.gateway.signals) so this process reloads at once.
_local_version = 0


def bump_local_version() -> None:
    global _local_version
    _local_version += 1


def local_version() -> int:
    return _local_version


class SnapshotCache:
    """Holds the current snapshot; `run()` refreshes it whenever the change marker moves."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        loader: Callable[[], Snapshot] | None = None,
        marker: Callable[[], Any] | None = None,
        initial: Snapshot | None = None,
    ) -> None:
        self.config = config
        self._loader = loader or (lambda: snapshot_load(config=config))
        self._marker = marker or _default_marker
        self.current: Snapshot | None = initial
        self._last_marker: Any = None
        # One thread keeps one database connection for all the loads of this process.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gw-snapshot")

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, _with_db_cleanup, fn)

    async def refresh(self, *, force: bool = False) -> bool:
        """Reload when the marker moved (or `force`); returns whether a new snapshot was installed."""
        marker = (await self._in_thread(self._marker), local_version())
        if not force and self.current is not None and marker == self._last_marker:
            return False
        snapshot = await self._in_thread(self._loader)
        self.current = snapshot
        self._last_marker = marker
        return True

    async def get(self) -> Snapshot:
        if self.current is None:
            await self.refresh(force=True)
        assert self.current is not None
        return self.current

    def close(self) -> None:
        self._executor.shutdown(wait=False)


def _default_marker() -> Any:
    from apps.gateway.selectors import gateway_change_marker

    return gateway_change_marker()


def _with_db_cleanup(fn: Callable[[], Any]) -> Any:
    from django.db import close_old_connections

    close_old_connections()
    return fn()
