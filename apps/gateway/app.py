"""The gateway's ASGI application for `/v1/*` and `/metrics`: the request path as a pipeline.

A `/v1/chat/completions` (or `/v1/completions`) request, top to bottom in `Gateway._completion` and
`Gateway._serve`; each step is one call from here into its own module: these six files are all one reads to
follow a request to the backend, nine to the end of its answer and its record in the request log
(tests/gateway/test_request_path.py traces it):

    authenticate   auth.py        the bearer key to its entitlement (cached snapshot, no database), and the
                                  model asked for to the key's pool
    parse          parse.py       read and validate the body and the llm-d headers
    count tokens   tokens.py      the prompt's tokens (the backend's /tokenize, cached; else an estimate)
    admit or wait  admission.py   the request sized (limits now, the backend's context window, SLO hints) and
                                  offered to the pool's admission state machine (state.py: memory_state.py, or
                                  redis_state.py with lua/), its quotas reserved first (quotas.py); it waits
                                  there when its entitlement's queue or the pool's waiting room holds it
    route          upstream.py    a healthy replica, fewest outstanding requests first (routing.py)
    relay          relay.py       the answer to the client, chunk by chunk, learning usage and TTFT; its end
                                  held back until the account step has run, then delivered
    account        account.py     the hold given back (unused tokens and quota refunded), usage and metrics
                                  recorded: once per admitted request, from the `finally` in `_decide`
    record         request_log.py every request decided (admitted or not) as one record of the request log,
                                  written to the database in the background

No Django request objects, middleware or ORM on this path: Django only loads snapshots and flushes usage,
in threads. What the process runs besides requests (snapshot refresh, health probes, lease renewal, the
AIMD tick, usage flushes, deferred releases, gauges) is in background.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import time
import uuid
from typing import Any

import httpx

from apps.gateway.account import Accountant
from apps.gateway.admission import Admitter, InFlight
from apps.gateway.auth import authenticate, authorize_model
from apps.gateway.background import BackgroundLoops
from apps.gateway.budget import PoolBudget
from apps.gateway.config import GatewayConfig
from apps.gateway.context import JSON_TYPE, ClientGone, RequestContext
from apps.gateway.errors import UPSTREAM_SHED, GatewayError, unavailable
from apps.gateway.health import HEALTH_PATHS, Health
from apps.gateway.memory_state import MemoryStateStore
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.metrics_access import metrics_hidden_labels
from apps.gateway.metrics_info import register_info_gauges
from apps.gateway.parse import (
    CHAT,
    COMPLETION,
    ParsedRequest,
    parse_json,
    parse_request,
    read_body,
)
from apps.gateway.peers import Peers, peers_for
from apps.gateway.relay import deliver, relay, send_preempted
from apps.gateway.request_log import RequestLog, entry_of
from apps.gateway.routing import ReplicaSet, admission_saturation
from apps.gateway.snapshot import KeyEntry, PoolInfo, Snapshot, SnapshotCache
from apps.gateway.state import GatewayStateStore, StateStoreUnavailable, rate_view
from apps.gateway.tokens import TokenCounter
from apps.gateway.tracing import tracer_from_env
from apps.gateway.upstream import (
    close_upstream,
    default_transport,
    send_upstream,
    upstream_headers,
    upstream_path,
)
from apps.gateway.upstream_http import UpstreamTransport
from apps.gateway.usage import UsageAccumulator

logger = logging.getLogger(__name__)

PATHS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


class Gateway:
    def __init__(
        self,
        *,
        config: GatewayConfig | None = None,
        snapshots: SnapshotCache | None = None,
        store: GatewayStateStore | None = None,
        transport: UpstreamTransport | None = None,
        control: Any = None,
    ) -> None:
        self.config = config or GatewayConfig.from_settings()
        self.snapshots = snapshots or SnapshotCache(config=self.config)
        self.store = store
        # What this process shares with the others on the store (none with the in-process store), chosen with it.
        self.peers: Peers | None = None if store is None else peers_for(store)
        self.metrics = GatewayMetrics()
        self.tokens = TokenCounter(enabled=self.config.tokenize)
        self.usage = UsageAccumulator()
        # Every request decided, written off the path (GATEWAY_REQUEST_LOG_DAYS=0: none, and no cost).
        self.request_log = RequestLog() if self.config.request_log_days > 0 else None
        self.in_flight = InFlight()
        # Request ids: this gateway's random 64-bit prefix and a counter. Unique across processes and restarts
        # as uuid4s are (a shared store keys reservations by them), at a tenth of the cost of one per request.
        self._request_ids = map(f"req_{uuid.uuid4().hex[:16]}{{:012x}}".format, itertools.count())
        # Each pool's dispatch budget controller (AIMD); the budget itself is a check of the state machine.
        self.budgets: dict[str, PoolBudget] = {}
        self.replicas: dict[str, ReplicaSet] = {}
        self.client: httpx.AsyncClient | None = None
        self.transport = transport
        self.loops = BackgroundLoops(self, control=control)
        self.health = Health(self)
        self._timeout: dict[str, float | None] = {}
        self._synced: dict[str, PoolInfo] = {}
        self._start_lock: asyncio.Lock | None = None
        self._started = False
        # OpenTelemetry spans of each request when OTEL_* asks for them; None (off) by default.
        self.tracer = tracer_from_env()
        self.loops.register_gauges()
        register_info_gauges(self)

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            httpx_logger = logging.getLogger("httpx")
            if httpx_logger.level == logging.NOTSET:
                # httpx logs every request at INFO: a formatted line per proxied call is real overhead
                # on the gateway's hot path (and noise); an explicit level in LOGGING still wins.
                httpx_logger.setLevel(logging.WARNING)
            if self.transport is None:
                self.transport = default_transport()
            timeout = httpx.Timeout(self.config.read_timeout_s, connect=self.config.connect_timeout_s)
            self._timeout = timeout.as_dict()
            if self.client is None:  # a start that failed before (no database yet) already made one
                # One pool of keep-alive connections: the client (tokenize, health) and the proxy share it.
                self.client = httpx.AsyncClient(transport=self.transport, timeout=timeout)
            if self.store is None:
                self.store = self._make_store()
            if self.peers is None:
                self.peers = peers_for(self.store)
            self.store.on_evict = self.in_flight.evict
            if self.request_log is not None:
                self.peers.request_log(self.request_log)
            if self.snapshots.current is None:
                await self.snapshots.refresh(force=True)
            self.accountant = Accountant(store=self.store, peers=self.peers, metrics=self.metrics, usage=self.usage,
                                         in_flight=self.in_flight, budgets=self.budgets)
            self.admitter = Admitter(store=self.store, config=self.config, metrics=self.metrics, usage=self.usage,
                                     in_flight=self.in_flight, forget=self.accountant.forget)
            self.loops.start()
            self._started = True
        # Every pool in the state machine now, not on its first request: a first request would otherwise pay the
        # store's connections and scripts and the pool's sync (0.3-0.5 s on Redis).
        await self.sync_pools()

    def _make_store(self) -> GatewayStateStore:
        if self.config.state_backend == "redis":
            from apps.gateway.redis_state import RedisStateStore

            if not self.config.redis_url:
                raise RuntimeError("GATEWAY_STATE_BACKEND=redis needs GATEWAY_REDIS_URL or REDIS_URL")
            return RedisStateStore(url=self.config.redis_url, config=self.config.admission_config(),
                                   dynamics_config=self.config.dynamics_config(), lease_s=self.config.lease_s,
                                   max_connections=self.config.redis_max_connections,
                                   pool_timeout_s=self.config.redis_pool_timeout_s, cluster=self.config.redis_cluster)
        return MemoryStateStore(config=self.config.admission_config(), dynamics_config=self.config.dynamics_config())

    async def stop(self, *, grace_s: float = 5.0) -> None:
        """Stop cleanly: requests still in flight get `grace_s` to finish (the server already drained them
        for its own timeout), then are cancelled; every reservation is released, usage flushed, the store
        closed. Nothing admitted is left held or unrecorded."""
        if self._started:
            await self.loops.finish_requests(grace_s)
        await self.loops.stop()  # the request log's last flush among them
        if self.request_log is not None:
            self.request_log.close()
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.store is not None:
            await self.store.close()
        self.snapshots.close()
        self.health.close()
        if self.tracer is not None:  # the spans still batched are exported (a blocking call)
            await asyncio.to_thread(self.tracer.shutdown)
        self._started = False

    # --- pools --------------------------------------------------------------------------------------

    def budget(self, pool: PoolInfo) -> PoolBudget:
        budget = self.budgets.get(pool.name)
        if budget is None:
            window = max(1, round(self.config.aimd_window_s / self.config.aimd_tick_s))
            budget = self.budgets[pool.name] = PoolBudget(
                pool.name, pool.concurrency_capacity, ttft_target_s=self.config.ttft_target_s,
                min_budget=self.config.budget_min, min_budget_fraction=self.config.budget_min_fraction,
                window_ticks=window, shared=self.peers is not None and self.peers.budgets_shared,
            )
        elif budget.capacity != max(1, pool.concurrency_capacity):
            budget.resize(pool.concurrency_capacity)
        return budget

    def replica_set(self, pool: PoolInfo) -> ReplicaSet:
        replicas = self.replicas.get(pool.name)
        if replicas is None:
            replicas = self.replicas[pool.name] = ReplicaSet(pool.replica_urls)
        elif replicas.urls != pool.replica_urls:
            replicas.update(pool.replica_urls)
        return replicas

    def saturation(self, pool: str) -> float:
        return admission_saturation(self.replicas.get(pool), self.config.saturation_admission)

    async def sync_pools(self) -> None:
        """Every pool of the current snapshot in the state machine (at start, and after each new snapshot)."""
        snapshot = self.snapshots.current
        for pool in snapshot.pools.values() if snapshot is not None else ():
            await self.sync_pool(pool)

    async def sync_pool(self, pool: PoolInfo) -> None:
        """The pool as this snapshot describes it, in the state machine (capacity, reservations)."""
        assert self.store is not None
        self.replica_set(pool)
        self.budget(pool)
        if self._synced.get(pool.name) is not pool:
            # A store that is away is tried again on the next request; the offer itself decides whether
            # that request fails closed (503) or open.
            with contextlib.suppress(StateStoreUnavailable):
                await self.store.sync_pool(pool=pool, saturation=self.saturation(pool.name))
                self._synced[pool.name] = pool

    # --- ASGI ----------------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # the site's lifespan (tokenpools_site.lifespan) starts and stops it
            return
        ctx = RequestContext(scope, receive, send, next(self._request_ids))
        try:
            if ctx.scope["path"] in HEALTH_PATHS:  # before the start: /healthz touches nothing, /readyz says it
                await self.health.serve(ctx)
                return
            if not self._started:
                try:
                    await self.start()
                except Exception as exc:  # the database (snapshot) or the store is not there yet
                    logger.exception("gateway could not start")
                    raise unavailable("gateway_unavailable", f"The gateway is starting: {type(exc).__name__}.") from None
            await self._route(ctx)
        except GatewayError as error:
            await self._send_error(ctx, error)
        except ClientGone:
            pass
        except Exception:
            logger.exception("gateway error on %s", scope.get("path"))
            with contextlib.suppress(Exception):
                await self._send_error(ctx, GatewayError(500, "internal_error", "Internal gateway error.",
                                                         error_type="server_error"))

    async def _route(self, ctx: RequestContext) -> None:
        path, method = ctx.scope["path"], ctx.scope["method"]
        if path == "/metrics":
            if method != "GET":
                raise GatewayError(405, "method_not_allowed", "Use GET.")
            hidden = metrics_hidden_labels(ctx.scope)  # 401 without the token where one is required
            await ctx.respond(200, self.metrics.render(hidden),
                              [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
            return
        kind = PATHS.get(path.rstrip("/"))
        if kind is not None:
            if method != "POST":
                raise GatewayError(405, "method_not_allowed", f"Use POST on {path}.")
            if self.tracer is None:
                await self._completion(ctx, kind)
            else:
                await self.tracer.serve(ctx, kind, self._completion)
            return
        if path.rstrip("/") == "/v1/models":
            if method != "GET":
                raise GatewayError(405, "method_not_allowed", "Use GET.")
            await self._models(ctx)
            return
        raise GatewayError(404, "not_found", f"No route {method} {path}.")

    async def _send_error(self, ctx: RequestContext, error: GatewayError) -> None:
        if ctx.response_started:
            return
        if ctx.view is None and ctx.entry is not None and self.store is not None:
            # Rejected before admission (bad input): still report where the key stands.
            limits = ctx.entry.limits
            with contextlib.suppress(StateStoreUnavailable):
                usage = await self.store.entitlement_usage(limits=limits, pool=ctx.entry.pool_name)
                ctx.view = rate_view(limits, usage.in_flight, usage.tokens_available)
        await ctx.respond_error(error)

    async def _snapshot(self) -> Snapshot:
        return self.snapshots.current or await self.snapshots.get()

    async def _models(self, ctx: RequestContext) -> None:
        snapshot = await self._snapshot()
        now = time.time()
        entry = authenticate(ctx, snapshot, now)
        self.usage.key_used(entry.key_id, now)
        pool = snapshot.pools.get(entry.pool_name)
        data = []
        if pool is not None:
            for name in dict.fromkeys((pool.name, pool.model_name)):
                data.append({"id": name, "object": "model", "created": 0, "owned_by": entry.tenant_slug,
                             "root": pool.model_name})
        await ctx.respond(200, json.dumps({"object": "list", "data": data}).encode(), [JSON_TYPE])

    # --- the completion pipeline ----------------------------------------------------------------------

    async def _completion(self, ctx: RequestContext, kind: str) -> None:
        snapshot = await self._snapshot()
        entry = authenticate(ctx, snapshot, time.time())
        trace = ctx.trace  # its spans, when tracing is on: each step begins where the last ends
        if trace is not None:
            trace.step("parse")
        body = await read_body(ctx, self.config.max_body_bytes)  # a client gone meanwhile: ClientGone
        # From here on the client may go away (while its tokens are counted, while it is offered or waits,
        # before the upstream answers, mid-stream): the watcher cancels this task at once, which releases
        # everything held and closes the upstream request (the backend sees its client go).
        ctx.task = asyncio.current_task()
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(ctx))
        try:
            parsed = parse_request(kind, parse_json(body, max_depth=self.config.max_json_depth),
                                   max_tokens_limit=self.config.max_tokens_limit)
            pool = authorize_model(snapshot, entry, parsed.model)
            if trace is not None:
                trace.parsed(parsed)  # and the count tokens step begins
            await self._serve(ctx, entry, parsed, pool)
        except asyncio.CancelledError:
            if ctx.task is None or not (ctx.disconnected or ctx.preempted):
                raise
            ctx.task.uncancel()
            if ctx.preempted and not ctx.disconnected:
                await send_preempted(ctx)
        finally:
            watcher.cancel()

    async def _serve(self, ctx: RequestContext, entry: KeyEntry, parsed: ParsedRequest, pool: PoolInfo) -> None:
        if self._synced.get(pool.name) is not pool:  # a new snapshot of the pool: once, not per request
            await self.sync_pool(pool)
        replicas = self.replica_set(pool)
        input_tokens = await self.tokens.count(client=self.client, pool=pool.name, model=pool.model_name,
                                               replicas=replicas, kind=parsed.kind, payload=parsed.payload)
        log = self.request_log
        if log is None:
            await self._decide(ctx, entry, parsed, pool, replicas, input_tokens)
            return
        # From here the gateway decides the request: however it ends, it leaves one record (request_log.py).
        try:
            await self._decide(ctx, entry, parsed, pool, replicas, input_tokens)
        except BaseException as exc:
            log.record(entry_of(ctx, entry, pool, parsed, input_tokens, exc))
            raise
        log.record(entry_of(ctx, entry, pool, parsed, input_tokens, None))

    async def _decide(self, ctx: RequestContext, entry: KeyEntry, parsed: ParsedRequest, pool: PoolInfo,
                      replicas: ReplicaSet, input_tokens: int) -> None:
        trace = ctx.trace
        if trace is not None:
            trace.step("admit or wait")
        admission = await self.admitter.admit(
            ctx, entry, pool, replicas, input_tokens=input_tokens,
            max_tokens=parsed.max_tokens, max_model_len=self.tokens.max_model_len.get(pool.name),
        )
        # Held from here: whatever happens next (a wait that runs out, a client gone, a preemption, a backend
        # failing, the end of the answer), the account step runs once, in the `finally` below, and before the
        # end of the answer goes out (a client that sees it may send its next request at once).
        response: httpx.Response | None = None
        url = ""
        try:
            try:
                await self.admitter.start(admission)
                assert self.transport is not None
                headers = upstream_headers(pool, tenant=entry.tenant_slug, service_tier=ctx.service_tier,
                                           slo_ttft_ms=admission.limits.slo_target_ms)
                if trace is not None:
                    headers = trace.upstream(admission, headers)  # its traceparent to the backend
                response, url = await send_upstream(ctx, self.transport, self._timeout, replicas, pool, parsed,
                                                    admission.decision.max_tokens, headers)
                if trace is not None:
                    trace.relaying(response, url + upstream_path(parsed))
                ending = await relay(ctx, response, parsed, functools.partial(self.accountant.first_token, admission))
            except GatewayError as error:
                if error.code == UPSTREAM_SHED:  # the inference gateway's refusal counts as a refusal too
                    self.admitter.count_rejection(entry, admission.limits, error.code)
                raise
            finally:
                ctx.finished = True  # a disconnect from here on is the normal end of the exchange
                if trace is not None:
                    trace.step("account")
                await self.accountant.finish(admission)
                if trace is not None:
                    trace.step(None)
            await deliver(ctx, ending)
        finally:
            if response is not None:
                await close_upstream(response, replicas, url)


async def _watch_disconnect(ctx: RequestContext) -> None:
    while True:
        message = await ctx.receive()
        if message["type"] == "http.disconnect":
            if ctx.finished:  # the response is complete: servers report that as a disconnect too
                return
            ctx.disconnected = True
            if ctx.task is not None and not ctx.task.done():
                ctx.task.cancel("client disconnected")
            return
