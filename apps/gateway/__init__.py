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

Settings (Django settings or environment; defaults in brackets)
---------------------------------------------------------------
REDIS_URL, GATEWAY_STATE_BACKEND [redis if REDIS_URL else memory], GATEWAY_FAIL_OPEN [0],
GATEWAY_MAX_BODY_BYTES [1048576], GATEWAY_MAX_TOKENS_LIMIT [1000000], GATEWAY_DEFAULT_MAX_TOKENS [256],
GATEWAY_CONTEXT_WINDOW [4096; the backend's max_model_len from /tokenize wins], GATEWAY_TOKENIZE [1],
GATEWAY_SNAPSHOT_POLL_S [0.5], GATEWAY_AIMD_TICK_S [5], GATEWAY_AIMD_WINDOW_S [30],
GATEWAY_TTFT_TARGET_S [2], GATEWAY_ACQUIRE_TIMEOUT_S [1], GATEWAY_QUEUE_MAX [8],
GATEWAY_HEALTH_INTERVAL_S [2], GATEWAY_USAGE_FLUSH_S [2], GATEWAY_SATURATION_ADMISSION [1],
GATEWAY_BUDGET_MIN_FRACTION [0.25].
"""
