"""The `/v1/*` gateway: key -> entitlement snapshot, admission through apps.policy, state store
(memory or Redis), per-pool DRR queue with AIMD, routing, streaming proxy, accounting, metrics.

Module map
----------
asgi.py        `gateway_application()` (process-wide `Gateway`), `dispatch(site_app)` used by
               tokenpools_site/asgi.py to send `/v1/*` and `/metrics` here.
app.py         `Gateway`: the raw ASGI app (request path, background tasks, preemption).
snapshot.py    `Snapshot`, `SnapshotCache`, `snapshot_load` (ORM -> immutable dicts, in a thread).
state.py       `GatewayStateStore` interface, `MemoryStateStore`, `StateStoreUnavailable`.
redis_state.py `RedisStateStore`: Lua read + compare-and-set commit, idempotent release, leases,
               eviction pub/sub.
scheduler.py   `PoolScheduler` (BudgetScheduler + AimdController per pool), `aimd_tick_all`.
routing.py     `ReplicaSet` (least outstanding, health), `probe_replicas`, `parse_vllm_metrics`.
requests.py    body validation; tokens.py input token counts; errors.py OpenAI-style errors;
metrics.py     Prometheus text; usage.py / services.py / models.py / api.py usage records.

Settings
--------
`GatewayConfig.from_settings()` (config.py) reads the `GATEWAY_*` Django settings, which
tokenpools_site/settings.py reads from the environment; the README's Configuration section lists them.
"""
