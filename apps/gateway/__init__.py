"""The `/v1/*` gateway: an OpenAI-compatible proxy that admits every request through the pool's admission
state machine (apps.policy) before it reaches a backend.

The request path, one module per step (`app.Gateway._completion` reads top to bottom and calls into
nothing but these before the backend):
    auth.py         authenticate: the bearer key to its entitlement (`snapshot.Snapshot`, no database), and
                    the model to the key's pool
    parse.py        parse: read and validate the body and the llm-d headers
    tokens.py       count tokens: the backend's `/tokenize` (cached), else an estimate
    admission.py    admit or wait: the request sized (limits, context window, SLO hints), the pool's state
                    machine, then a slot of the dispatch budget
    upstream.py     route: a healthy replica, fewest outstanding first (`routing.ReplicaSet`), and send
    relay.py        relay: the answer to the client, chunk by chunk, learning usage and TTFT
    account.py      account: the hold given back (unused tokens refunded), usage and metrics recorded
with context.py (one request's state and how it answers) and errors.py (OpenAI-style errors).

The state behind admission, one interface (state.py) and two implementations:
    memory_state.py one `apps.policy.AdmissionLedger` per pool: the simulator's state machine itself
    redis_state.py  the same transitions as Lua scripts (lua/), for several gateway processes; proven equal to
                    the ledger by `make conformance` (tests/conformance). Beside it: redis_calls.py (the
                    function library, the connections, failures), redis_args.py (the scripts' arguments and
                    replies), redis_quota.py (tenant quotas), redis_snapshot.py (the snapshots an offer decides
                    on), resp.py (the one connection the calls share), redis_cluster.py (a Redis Cluster)

Around the requests: background.py (the background loops of a running gateway, its gauges, its clean stop;
store_view.py, what the store holds every process together, for /metrics),
budget.py (each pool's AIMD controller of its dispatch budget, seed 002; the budget is a check of the
state machine), ticks.py (the EWMA and AIMD tick services the
tick runners call, and the process's control state) and control.py (that state, and the shared AIMD tick), snapshot.py (keys, entitlements and pools
loaded from the database when they change), metrics.py (Prometheus text), usage.py / services.py /
models.py / api.py (usage records), asgi.py (`gateway_application()` and the path dispatcher the site uses).

Settings: `GatewayConfig.from_settings()` (config.py) reads the `GATEWAY_*` Django settings, which
tokenpools_site/settings.py reads from the environment; the README's Configuration section lists them.
"""
