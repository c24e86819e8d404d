"""The gateway's raw ASGI application for `/v1/*` and `/metrics`.

Per request: one SHA-256 and dict lookup for the key, JSON parse and validation, the token count,
admission (policy decides, state store commits), the pool's DRR budget, least-outstanding routing
with a retry on connect failure, then the response passed through chunk by chunk. No Django request
objects, middleware or ORM on this path: Django only loads snapshots and flushes usage, in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from apps.gateway.config import GatewayConfig
from apps.gateway.errors import (
    GatewayError,
    body_too_large,
    error_body,
    invalid_api_key,
    invalid_request,
    model_not_found,
    rejected,
    unavailable,
)
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.requests import CHAT, COMPLETION, ParsedRequest, parse_json, parse_request, upstream_body
from apps.gateway.routing import ReplicaSet, probe_replicas
from apps.gateway.scheduler import PoolScheduler, aimd_tick_all
from apps.gateway.snapshot import KeyEntry, PoolInfo, Snapshot, SnapshotCache
from apps.gateway.state import (
    AdmitResult,
    GatewayStateStore,
    MemoryStateStore,
    RateView,
    Reservation,
    StateStoreUnavailable,
    rate_view,
)
from apps.gateway.tokens import TokenCounter
from apps.gateway.usage import UsageAccumulator
from apps.policy import (
    AdmissionDecision,
    AdmissionRequest,
    EntitlementLimits,
    PolicyConfigError,
    Reason,
    effective_slo_tier,
)
from apps.policy.admission import CAPACITY_REASONS, DEFAULT_ADMISSION_CONFIG

logger = logging.getLogger(__name__)

PATHS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}
# Reasons the policy returns for requests that are malformed rather than over a limit: a 400, as
# OpenAI answers a context overflow, not a 429.
BAD_REQUEST_REASONS = frozenset(
    {Reason.INVALID_REQUEST.value, Reason.MAX_TOKENS_INVALID.value, Reason.CONTEXT_LENGTH_EXCEEDED.value}
)
PREEMPTED = "preempted"
LEASE_RENEW_S = 10.0
# With a shared store, how often this process's TTFT counts go to the pool's shared window.
TTFT_FLUSH_S = 1.0
# An idle upstream connection is dropped before the backend drops it: vLLM's server closes idle keep-alive
# connections after 5 s, and a request sent on one it is closing fails with a ReadError (a 502 here).
UPSTREAM_KEEPALIVE_S = 4.0
UPSTREAM_HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
JSON_TYPE = (b"content-type", b"application/json")


# httpcore's connection pool, on every request and every response close, walks all its connections
# (polling each idle one's socket for has_expired) and, for each pending request, all of them again:
# with hundreds of requests in flight that walk was the largest cost per request and halved the
# throughput. Spread over this many independent pools (round robin), each walk stays short. The
# price: up to this many idle keep-alive connections per backend, and at a low request rate more
# requests open a new connection (each pool keeps its own).
TRANSPORT_SHARDS = 64


class ShardedTransport(httpx.AsyncBaseTransport):
    """Round-robin over `shards` independent keep-alive pools (no limit on connections)."""

    def __init__(self, shards: int, *, keepalive_connections: int, keepalive_expiry: float) -> None:
        shards = max(1, shards)
        per_shard = max(1, -(-keepalive_connections // shards))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=per_shard,
                              keepalive_expiry=keepalive_expiry)
        ssl_context = httpx.create_ssl_context()  # one for all: loading the CA bundle takes ~20 ms
        self.shards = [httpx.AsyncHTTPTransport(verify=ssl_context, limits=limits) for _ in range(shards)]
        self._next = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        shard = self.shards[self._next]
        self._next = (self._next + 1) % len(self.shards)
        return await shard.handle_async_request(request)

    async def aclose(self) -> None:
        for shard in self.shards:
            await shard.aclose()


class _ClientGone(Exception):
    """The client disconnected; nothing more can be sent."""


@dataclass(slots=True)
class _Context:
    started: float
    request_id: str
    entry: KeyEntry | None = None
    view: RateView | None = None
    upstream_started: float | None = None
    upstream_answered: float | None = None
    preempted: bool = False
    disconnected: bool = False
    task: asyncio.Task | None = None
    priority: float = 0.0
    evictable: bool = False
    finished: bool = False
    finish: Any = None
    # A backend answered: the request counts in the usage records (queue timeouts and 503s do not).
    proxied: bool = False

    def overhead_ms(self) -> float:
        """Time the gateway itself added: entry to the upstream call, plus answer to our response."""
        now = time.perf_counter()
        if self.upstream_started is None:
            return (now - self.started) * 1000.0
        after = now - self.upstream_answered if self.upstream_answered is not None else 0.0
        return (self.upstream_started - self.started + after) * 1000.0


@dataclass(slots=True)
class _Served:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    first_chunk_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _ratelimit_headers(view: RateView | None) -> list[tuple[bytes, bytes]]:
    if view is None:
        return []
    headers: list[tuple[bytes, bytes]] = []
    if view.limit_requests is not None:
        remaining = view.remaining_requests or 0
        headers += [
            (b"x-ratelimit-limit-requests", str(view.limit_requests).encode()),
            (b"x-ratelimit-remaining-requests", str(remaining).encode()),
            (b"x-ratelimit-reset-requests", b"0s" if remaining > 0 else b"1s"),
        ]
    if view.limit_tokens is not None and view.remaining_tokens is not None:
        headers += [
            (b"x-ratelimit-limit-tokens", str(int(view.limit_tokens)).encode()),
            (b"x-ratelimit-remaining-tokens", str(int(view.remaining_tokens)).encode()),
            (b"x-ratelimit-reset-tokens", f"{view.reset_tokens_s:.3f}s".encode()),
        ]
    return headers


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class Gateway:
    def __init__(
        self,
        *,
        config: GatewayConfig | None = None,
        snapshots: SnapshotCache | None = None,
        store: GatewayStateStore | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        control: Any = None,
    ) -> None:
        self.config = config or GatewayConfig.from_settings()
        self.snapshots = snapshots or SnapshotCache(config=self.config)
        self.store = store
        # The control loops' state (`workers.dynamics.ControlState`; default `workers.services.control_state()`):
        # with a shared store, this process's TTFT counts go to its window and the shared AIMD tick reads it.
        self.control = control
        self.metrics = GatewayMetrics()
        self.schedulers: dict[str, PoolScheduler] = {}
        self.replicas: dict[str, ReplicaSet] = {}
        self.tokens = TokenCounter(enabled=self.config.tokenize)
        self.usage = UsageAccumulator()
        self.client: httpx.AsyncClient | None = None
        self._transport = transport
        self._timeout_extension: dict[str, float | None] = {}
        # request id -> context of requests holding a reservation, by pool (preemption, in-flight gauges)
        self.running: dict[str, dict[str, _Context]] = {}
        self._released: dict[str, asyncio.Event] = {}
        self._limits_cache: dict[tuple[EntitlementLimits, int], EntitlementLimits] = {}
        self._tasks: list[asyncio.Task] = []
        self._start_lock: asyncio.Lock | None = None
        self._started = False
        self._register_gauges()

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
            if self._transport is None:
                self._transport = ShardedTransport(TRANSPORT_SHARDS, keepalive_connections=1000,
                                                   keepalive_expiry=UPSTREAM_KEEPALIVE_S)
            timeout = httpx.Timeout(self.config.read_timeout_s, connect=self.config.connect_timeout_s)
            self._timeout_extension = timeout.as_dict()
            if self.client is None:  # a start that failed before (no database yet) already made one
                # One pool of keep-alive connections: the client (tokenize, health) and the proxy share it.
                self.client = httpx.AsyncClient(transport=self._transport, timeout=timeout)
            if self.store is None:
                self.store = self._make_store()
            if self.snapshots.current is None:
                await self.snapshots.refresh(force=True)
            _bind_worker_ticks()
            # Evictions published by other processes (the Redis store; a no-op in memory).
            self._tasks.append(asyncio.get_running_loop().create_task(
                self.store.evictions_listen(self._evict_local), name="gw-evictions"))
            if self.config.background:
                loop = asyncio.get_running_loop()
                self._tasks += [
                    loop.create_task(self.snapshots.run(), name="gateway-snapshot"),
                    loop.create_task(self._every(self.config.aimd_tick_s, self.aimd_tick), name="gateway-aimd"),
                    loop.create_task(self._every(self.config.health_interval_s, self.health_check), name="gw-health"),
                    loop.create_task(self._every(self.config.usage_flush_s, self.usage.flush), name="gw-usage"),
                    loop.create_task(self._every(LEASE_RENEW_S, self.leases_tick), name="gw-leases"),
                ]
                if self.store.shares_budget:
                    self._tasks.append(loop.create_task(self._every(TTFT_FLUSH_S, self.ttft_flush), name="gw-ttft"))
            self._started = True

    def _make_store(self) -> GatewayStateStore:
        if self.config.state_backend == "redis":
            from apps.gateway.redis_state import RedisStateStore

            if not self.config.redis_url:
                raise RuntimeError("GATEWAY_STATE_BACKEND=redis needs REDIS_URL")
            return RedisStateStore(url=self.config.redis_url)
        return MemoryStateStore()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks = []
        with contextlib.suppress(Exception):
            await self.usage.flush()
        if self.client is not None:
            await self.client.aclose()
        if self.store is not None:
            await self.store.close()
        self.snapshots.close()
        self._started = False

    @staticmethod
    async def _every(interval_s: float, action: Any) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                result = action()
                if asyncio.iscoroutine(result):
                    await result
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("gateway background task %s failed", getattr(action, "__name__", action))

    async def leases_tick(self) -> int:
        """Renew the leases of this process's reservations, then release those of dead processes."""
        assert self.store is not None
        ids = [rid for contexts in self.running.values() for rid in contexts]
        try:
            await self.store.leases_renew(request_ids=ids)
            for scheduler in list(self.schedulers.values()):
                await scheduler.renew_slots()
            return await self.store.leases_reap()
        except StateStoreUnavailable:
            return 0

    def _control_state(self) -> Any:
        if self.control is None:
            from workers.services import control_state

            self.control = control_state()
        return self.control

    async def aimd_tick(self) -> dict[str, int]:
        """Every `aimd_tick_s`. One process: its own controller per pool. A shared store: the pool's one
        controller, run here by one gateway process per period (a short lock in the control state) when
        no Celery broker runs the ticks; every process then reads the budget it published."""
        budgets = aimd_tick_all(list(self.schedulers.values()))  # shared: only the local windows move on
        if self.store is None or not self.store.shares_budget:
            return budgets
        from workers.ticks import ticks_mode

        control = self._control_state()
        if ticks_mode() == "in-process" and await asyncio.to_thread(
                control.claim, "tick:aimd", 0.9 * self.config.aimd_tick_s):
            return await self.shared_aimd_tick()
        for scheduler in list(self.schedulers.values()):
            budgets[scheduler.name] = await scheduler.refresh_budget()
        return budgets

    async def shared_aimd_tick(self) -> dict[str, int]:
        """One step of every pool's shared AIMD controller (`workers.dynamics.aimd_tick_shared`), the
        pools' capacities from the snapshot (no ORM on the server's loop)."""
        from workers.dynamics import aimd_tick_shared
        from workers.services import aimd_params

        assert self.store is not None
        snapshot = self.snapshots.current or await self.snapshots.get()
        pools = {pool.name: max(1, pool.concurrency_capacity) for pool in snapshot.pools.values()}
        records = await aimd_tick_shared(store=self.store, state=self._control_state(), pools=pools,
                                         params=aimd_params(self.config, self.config.aimd_tick_s))
        for scheduler in list(self.schedulers.values()):
            await scheduler.refresh_budget()
        return {pool: record.cap for pool, record in records.items()}

    async def ttft_flush(self) -> int:
        """Every second with a shared store: add this process's TTFT counts to each pool's shared window
        (one write per pool, not one per request) and read the published budgets; returns the count."""
        control = self._control_state()
        flushed = 0
        for scheduler in list(self.schedulers.values()):
            counts = scheduler.take_ttft()
            if counts is not None:
                await asyncio.to_thread(control.ttft_add, scheduler.name, counts, scheduler.histogram.bounds)
                flushed += sum(counts)
            with contextlib.suppress(StateStoreUnavailable):
                await scheduler.refresh_budget()
        return flushed

    async def health_check(self) -> None:
        await self.start()
        assert self.client is not None
        self._sync_pools(self.snapshots.current)
        await probe_replicas(self.client, list(self.replicas.values()))

    def _sync_pools(self, snapshot: Snapshot | None) -> None:
        if snapshot is None:
            return
        for pool in snapshot.pools.values():
            self._replica_set(pool)
            self._scheduler(pool)

    def _scheduler(self, pool: PoolInfo) -> PoolScheduler:
        scheduler = self.schedulers.get(pool.name)
        if scheduler is None:
            window = max(1, round(self.config.aimd_window_s / self.config.aimd_tick_s))
            scheduler = self.schedulers[pool.name] = PoolScheduler(
                pool.name, pool.concurrency_capacity, acquire_timeout_s=self.config.acquire_timeout_s,
                ttft_target_s=self.config.ttft_target_s, min_budget=self.config.budget_min,
                min_budget_fraction=self.config.budget_min_fraction, window_ticks=window,
                store=self.store, fail_open=self.config.fail_open,
            )
        elif scheduler.capacity != max(1, pool.concurrency_capacity):
            scheduler.resize(pool.concurrency_capacity)
        return scheduler

    def _replica_set(self, pool: PoolInfo) -> ReplicaSet:
        replicas = self.replicas.get(pool.name)
        if replicas is None:
            replicas = self.replicas[pool.name] = ReplicaSet(pool.replica_urls)
        elif replicas.urls != pool.replica_urls:
            replicas.update(pool.replica_urls)
        return replicas

    def _saturation(self, pool: str) -> float:
        if not self.config.saturation_admission:
            return 0.0
        replicas = self.replicas.get(pool)
        value = None if replicas is None else replicas.saturation()
        return 0.0 if value is None else value

    def _register_gauges(self) -> None:
        self.metrics.add_gauge(
            "flow_control_queue_size", "Requests waiting for a slot of the pool budget.", ("pool",),
            lambda: {(name, ): float(s.queued) for name, s in self.schedulers.items()},
        )
        self.metrics.add_gauge(
            "flow_control_pool_budget", "The pool budget (AIMD cap): this process's, or the pool's with Redis.",
            ("pool",),
            lambda: {(name, ): float(s.budget) for name, s in self.schedulers.items()},
        )
        self.metrics.add_gauge(
            "flow_control_budget_utilization", "Dispatched requests over the pool budget (this process).",
            ("pool",), lambda: {(name, ): s.in_flight / max(1, s.budget) for name, s in self.schedulers.items()},
        )

        def saturations() -> dict[tuple[str, ...], float]:
            values = {(name, ): r.saturation() for name, r in self.replicas.items()}
            return {key: value for key, value in values.items() if value is not None}

        self.metrics.add_gauge(
            "flow_control_pool_saturation", "GAIE saturation of the pool from its replicas' vLLM metrics.",
            ("pool",), saturations,
        )
        self.metrics.add_gauge(
            "gateway_requests_in_flight", "Admitted requests not yet finished (this process).", ("pool",),
            lambda: {(name, ): float(len(r)) for name, r in self.running.items()},
        )

        def by_entitlement() -> dict[tuple[str, ...], float]:
            counts: dict[tuple[str, ...], float] = {}
            for contexts in self.running.values():
                for ctx in contexts.values():
                    if ctx.entry is not None:
                        key = (ctx.entry.entitlement,)
                        counts[key] = counts.get(key, 0.0) + 1
            return counts

        from workers.services import desired_replicas_gauge

        self.metrics.add_gauge(
            "tokenpools_pool_desired_replicas", "Replicas the pool should run (autoscaling signal).", ("pool",),
            desired_replicas_gauge,
        )
        self.metrics.add_gauge(
            "gateway_entitlement_in_flight", "Admitted requests not yet finished, by entitlement (this process).",
            ("entitlement",), by_entitlement,
        )

    # --- ASGI ----------------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        ctx = _Context(time.perf_counter(), "req_" + uuid.uuid4().hex)
        try:
            if not self._started:
                try:
                    await self.start()
                except Exception as exc:  # the database (snapshot) or the store is not there yet
                    logger.exception("gateway could not start")
                    raise unavailable("gateway_unavailable", f"The gateway is starting: {type(exc).__name__}.") from None
            await self._route(scope, receive, send, ctx)
        except GatewayError as error:
            await self._send_error(send, ctx, error)
        except _ClientGone:
            pass
        except Exception:
            logger.exception("gateway error on %s", scope.get("path"))
            with contextlib.suppress(Exception):
                await self._send_error(send, ctx, GatewayError(500, "internal_error", "Internal gateway error.",
                                                               error_type="server_error"))

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, scope: dict[str, Any], receive: Any, send: Any, ctx: _Context) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/metrics":
            if method != "GET":
                raise GatewayError(405, "method_not_allowed", "Use GET.")
            await self._send(send, ctx, 200, self.metrics.render(),
                             [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
            return
        kind = PATHS.get(path.rstrip("/"))
        if kind is not None:
            if method != "POST":
                raise GatewayError(405, "method_not_allowed", f"Use POST on {path}.")
            await self._completion(scope, receive, send, ctx, kind)
            return
        if path.rstrip("/") == "/v1/models":
            if method != "GET":
                raise GatewayError(405, "method_not_allowed", "Use GET.")
            await self._models(scope, send, ctx)
            return
        raise GatewayError(404, "not_found", f"No route {method} {path}.")

    # --- responses -----------------------------------------------------------------------------------

    def _headers(self, ctx: _Context, extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [
            *extra,
            (b"x-request-id", ctx.request_id.encode()),
            (b"x-tokenpools-overhead-ms", f"{ctx.overhead_ms():.3f}".encode()),
            *_ratelimit_headers(ctx.view),
        ]

    async def _send(self, send: Any, ctx: _Context, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": self._headers(ctx, extra)})
        await send({"type": "http.response.body", "body": body})

    async def _send_error(self, send: Any, ctx: _Context, error: GatewayError) -> None:
        if ctx.view is None and ctx.entry is not None and self.store is not None:
            # Rejected before admission (bad input): still report where the key stands.
            limits = ctx.entry.limits
            with contextlib.suppress(StateStoreUnavailable):
                usage = await self.store.entitlement_usage(limits=limits)
                ctx.view = rate_view(limits, usage.in_flight, usage.tokens_available)
        await self._send(send, ctx, error.status, error.body(), [JSON_TYPE, *error.headers()])

    # --- auth and input -----------------------------------------------------------------------------

    def _authenticate(self, scope: dict[str, Any], snapshot: Snapshot) -> KeyEntry:
        header = _header(scope, b"authorization")
        if not header or not header[:7].lower() == "bearer ":
            raise invalid_api_key("You did not provide an API key (Authorization: Bearer <key>).")
        entry = snapshot.key_for(header[7:].strip(), time.time())
        if entry is None:
            raise invalid_api_key()
        return entry

    async def _read_body(self, scope: dict[str, Any], receive: Any) -> bytes:
        limit = self.config.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                if int(declared) > limit:
                    raise body_too_large(limit)
            except ValueError:
                raise invalid_request("Invalid Content-Length header.") from None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _snapshot(self) -> Snapshot:
        return self.snapshots.current or await self.snapshots.get()

    async def _models(self, scope: dict[str, Any], send: Any, ctx: _Context) -> None:
        snapshot = await self._snapshot()
        entry = self._authenticate(scope, snapshot)
        ctx.entry = entry
        pool = snapshot.pools.get(entry.pool_name)
        data = []
        if pool is not None:
            for name in dict.fromkeys((pool.name, pool.model_name)):
                data.append({"id": name, "object": "model", "created": 0, "owned_by": entry.tenant_slug,
                             "root": pool.model_name})
        await self._send(send, ctx, 200, json.dumps({"object": "list", "data": data}).encode(), [JSON_TYPE])

    # --- completions ---------------------------------------------------------------------------------

    async def _completion(self, scope: dict[str, Any], receive: Any, send: Any, ctx: _Context, kind: str) -> None:
        snapshot = await self._snapshot()
        entry = self._authenticate(scope, snapshot)
        ctx.entry = entry
        parsed = parse_request(kind, parse_json(await self._read_body(scope, receive)),
                               max_tokens_limit=self.config.max_tokens_limit)
        pool = snapshot.pool_for_model(parsed.model)
        if pool is None or pool.name != entry.pool_name:
            raise model_not_found(parsed.model)
        # From here on the client may go away (while waiting for admission, in the queue, or
        # mid-stream): the watcher cancels this task so the slot is released at once.
        ctx.task = asyncio.current_task()
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, ctx))
        try:
            await self._admit_and_proxy(scope, receive, send, ctx, kind, entry, parsed, pool)
        except asyncio.CancelledError:
            if ctx.task is None or not (ctx.disconnected or ctx.preempted):
                raise
            ctx.task.uncancel()
            if ctx.preempted and not ctx.disconnected:  # preempted before any byte went out
                await self._send_preempted(send, ctx, parsed, _Served())
        finally:
            watcher.cancel()

    async def _admit_and_proxy(self, scope: dict[str, Any], receive: Any, send: Any, ctx: _Context, kind: str,
                               entry: KeyEntry, parsed: ParsedRequest, pool: PoolInfo) -> None:
        limits = entry.limits_at(time.time())
        input_tokens = await self.tokens.count(
            client=self.client, pool=pool.name, model=pool.model_name,
            urls=tuple(self._replica_set(pool).candidates()) or pool.replica_urls, kind=kind, payload=parsed.payload,
        )
        limits = self._with_context_window(limits, pool.name)
        request = AdmissionRequest(ctx.request_id, input_tokens, parsed.max_tokens, _slo_ms(scope),
                                   _slo_tier(scope, limits))
        scheduler = self._scheduler(pool)
        result = await self._admit(limits, pool, request, ctx, scheduler)
        reservation = result.reservation
        assert reservation is not None
        service_class = str(limits.service_class)
        self.metrics.admitted.inc((limits.entitlement_id, service_class))
        ctx.priority, ctx.evictable = reservation.priority, reservation.evictable
        contexts = self.running.setdefault(pool.name, {})
        contexts[ctx.request_id] = ctx
        served = _Served()
        acquired = False

        async def finish() -> None:
            # Runs once: just before the last byte goes to the client (so accounting is visible when
            # the client sees the end), or on the way out after an error, a disconnect or a preemption.
            nonlocal acquired
            if ctx.finished:
                return
            ctx.finished = True
            contexts.pop(ctx.request_id, None)
            if acquired:
                acquired = False
                # A reservation in a shared store gives its slot of the pool budget back in its own release.
                await scheduler.release_request(ctx.request_id, store_releases_slot=reservation.accounted)
            await self._account(entry, pool, reservation, served, ctx)
            scheduler.slot_freed()

        ctx.finish = finish
        try:
            try:
                await scheduler.acquire(flow=limits.entitlement_id, service_class=service_class,
                                        queue_max=entry.queue_max, request_id=ctx.request_id,
                                        slot_taken=result.slot_taken)
            except GatewayError as error:
                self._count_rejection(entry, limits, error.code)
                raise
            acquired = True
            await self._proxy(scope, receive, send, ctx, parsed, pool, scheduler, served, result.decision)
        finally:
            await finish()

    def _with_context_window(self, limits: EntitlementLimits, pool: str) -> EntitlementLimits:
        """The backend's own max_model_len (learnt from /tokenize) beats the configured default."""
        max_len = self.tokens.max_model_len.get(pool)
        if max_len is None or max_len == limits.context_window or max_len < 1:
            return limits
        key = (limits, max_len)
        adjusted = self._limits_cache.get(key)
        if adjusted is None:
            if len(self._limits_cache) > 10_000:
                self._limits_cache.clear()
            adjusted = self._limits_cache[key] = dataclasses.replace(limits, context_window=max_len)
        return adjusted

    async def _admit(
        self, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest, ctx: _Context,
        scheduler: PoolScheduler,
    ) -> AdmitResult:
        assert self.store is not None
        deadline: float | None = None
        while True:
            try:
                result = await self.store.admit(limits=limits, pool=pool, request=request,
                                                saturation=self._saturation(pool.name), slot=scheduler.slot_request())
            except StateStoreUnavailable as exc:
                if self.config.fail_open:
                    return self._admit_unaccounted(limits, pool, request)
                raise unavailable("state_store_unavailable", f"The gateway state store is unreachable: {exc}") from None
            ctx.view = result.view
            decision = result.decision
            if decision.admitted:
                return result
            if decision.queued:
                # Priority above the threshold of a full pool: wait for the next free slot, evicting
                # lower-priority preemptible work of this process when the policy allows it.
                now = time.monotonic()
                if deadline is None:
                    deadline = now + DEFAULT_ADMISSION_CONFIG.wait_timeout_s
                    if decision.evict:
                        await self._preempt(pool.name, decision.priority)
                if now < deadline:
                    await self._wait_for_release(pool.name, min(deadline - now, 0.05))
                    continue
                decision = decision._replace(reason=Reason.POOL_CONTENDED.value, retry_after_s=1.0)
            raise await self._reject(limits, decision)

    def _admit_unaccounted(self, limits: EntitlementLimits, pool: PoolInfo, request: AdmissionRequest) -> AdmitResult:
        max_tokens = request.max_tokens or limits.default_max_tokens
        decision = AdmissionDecision(True, Reason.ADMITTED.value, max_tokens=max_tokens,
                                     token_cost=request.input_tokens + max_tokens)
        reservation = Reservation(request.request_id, limits.entitlement_id, pool.name, decision.token_cost, 0.0,
                                  0.0, max_tokens, request.input_tokens, False, accounted=False)
        return AdmitResult(decision, reservation, RateView())

    async def _reject(self, limits: EntitlementLimits, decision: AdmissionDecision) -> GatewayError:
        reason = decision.reason
        self.metrics.rejected.inc((limits.entitlement_id, str(limits.service_class), reason))
        if reason in BAD_REQUEST_REASONS:
            param = "max_tokens" if reason == Reason.MAX_TOKENS_INVALID.value else "messages"
            return GatewayError(400, reason, _REASON_TEXT.get(reason, reason), param=param)
        if reason in CAPACITY_REASONS:
            with contextlib.suppress(StateStoreUnavailable):
                assert self.store is not None
                await self.store.record_rejection(entitlement=limits.entitlement_id, token_cost=decision.token_cost)
        self.usage.reject(tenant_id=int(limits.tenant_id or 0), entitlement=limits.entitlement_id)
        retryable = decision.retryable and reason != Reason.ENTITLEMENT_NOT_BOUND.value
        return rejected(reason, _REASON_TEXT.get(reason, reason), retry_after_s=decision.retry_after_s,
                        retryable=retryable)

    def _count_rejection(self, entry: KeyEntry, limits: EntitlementLimits, reason: str) -> None:
        self.metrics.rejected.inc((limits.entitlement_id, str(limits.service_class), reason))
        self.usage.reject(tenant_id=entry.tenant_id, entitlement=entry.entitlement)

    async def _wait_for_release(self, pool: str, timeout_s: float) -> None:
        event = self._released.get(pool)
        if event is None:
            event = self._released[pool] = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    def _notify_release(self, pool: str) -> None:
        event = self._released.pop(pool, None)
        if event is not None:
            event.set()

    async def _preempt(self, pool: str, priority: float) -> int:
        """Cancel the lowest-priority preemptible requests below `priority`: this process's at once,
        other processes' through the store (Redis pub/sub); returns how many were asked to stop."""
        limit = DEFAULT_ADMISSION_CONFIG.max_evictions_per_request
        victims = sorted(
            (c for c in self.running.get(pool, {}).values() if c.evictable and not c.preempted and c.priority < priority),
            key=lambda c: c.priority,
        )[:limit]
        for victim in victims:
            self._cancel_preempted(victim)
        if len(victims) < limit:
            assert self.store is not None
            with contextlib.suppress(StateStoreUnavailable):
                local = self.running.get(pool, {})
                remote = [rid for rid in await self.store.evict_candidates(pool=pool, below_priority=priority,
                                                                         limit=limit) if rid not in local]
                if remote:
                    await self.store.evictions_publish(request_ids=remote[: limit - len(victims)])
                    return len(victims) + len(remote[: limit - len(victims)])
        return len(victims)

    @staticmethod
    def _cancel_preempted(victim: _Context) -> None:
        victim.preempted = True
        if victim.task is not None and not victim.task.done():
            victim.task.cancel(PREEMPTED)

    def _evict_local(self, request_id: str) -> None:
        for contexts in self.running.values():
            victim = contexts.get(request_id)
            if victim is not None and victim.evictable and not victim.preempted:
                self._cancel_preempted(victim)
                return

    async def _account(self, entry: KeyEntry, pool: PoolInfo, reservation: Reservation, served: _Served,
                       ctx: _Context) -> None:
        prompt = served.prompt_tokens if served.prompt_tokens is not None else (
            reservation.input_tokens if served.chunks or served.completion_tokens else 0)
        completion = served.completion_tokens if served.completion_tokens is not None else served.chunks
        if reservation.accounted:
            try:
                assert self.store is not None
                await asyncio.shield(self.store.release(reservation=reservation, prompt_tokens=prompt,
                                                        completion_tokens=completion))
            except StateStoreUnavailable:
                logger.warning("could not release %s: state store unreachable", reservation.request_id)
        self._notify_release(pool.name)
        self.metrics.tokens.inc((entry.entitlement, "prompt"), prompt)
        self.metrics.tokens.inc((entry.entitlement, "completion"), completion)
        self.metrics.duration.observe((pool.name,), time.perf_counter() - ctx.started)
        if ctx.proxied:
            self.usage.add(tenant_id=entry.tenant_id, entitlement=entry.entitlement, prompt_tokens=prompt,
                           completion_tokens=completion)

    # --- upstream ------------------------------------------------------------------------------------

    async def _proxy(
        self, scope: dict[str, Any], receive: Any, send: Any, ctx: _Context, parsed: ParsedRequest, pool: PoolInfo,
        scheduler: PoolScheduler, served: _Served, decision: AdmissionDecision,
    ) -> None:
        assert self._transport is not None
        body = upstream_body(parsed, model=pool.model_name, max_tokens=decision.max_tokens)
        path = "/v1/chat/completions" if parsed.kind == CHAT else "/v1/completions"
        replicas = self._replica_set(pool)
        tried: set[str] = set()
        resent = False
        try:
            while True:
                candidates = replicas.candidates(tried)
                if not candidates:
                    raise unavailable("no_healthy_replica", f"No healthy replica of pool {pool.name!r} can serve.")
                url = candidates[0]
                tried.add(url)
                replicas.acquire(url)
                ctx.upstream_started = time.perf_counter()
                try:
                    # Straight to the shared transport: the client's cookie, redirect, auth and hook
                    # handling cost ~0.3 ms a request and none of it applies to a backend call.
                    request = httpx.Request("POST", url + path, content=body, headers=UPSTREAM_HEADERS,
                                            extensions={"timeout": self._timeout_extension})
                    response = await self._transport.handle_async_request(request)
                    response.request = request
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    # Nothing reached the replica: safe to try another one. Refused: it is down; a timeout
                    # only counts (see apps.gateway.routing).
                    replicas.release(url)
                    if isinstance(exc, httpx.ConnectTimeout):
                        replicas.timed_out(url)
                    else:
                        replicas.mark(url, False)
                    continue
                except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
                    replicas.release(url)
                    if resent:
                        raise GatewayError(502, "upstream_error", "The backend closed the connection twice.",
                                           error_type="server_error") from None
                    # The connection broke before any byte of an answer: most often a pooled keep-alive
                    # connection the backend was closing as we sent. Sent once more on a fresh one; had the
                    # backend started on it, it saw its client go and aborted it.
                    resent = True
                    tried.discard(url)
                    continue
                except httpx.HTTPError as exc:
                    replicas.release(url)
                    raise GatewayError(502, "upstream_error", f"The backend failed: {type(exc).__name__}.",
                                       error_type="server_error") from None
                break
            ctx.proxied = True
            try:
                if parsed.stream and response.status_code < 400:
                    await self._relay_stream(send, ctx, response, parsed, pool, scheduler, served)
                else:
                    await self._relay_whole(send, ctx, response, pool, scheduler, served)
            finally:
                await response.aclose()
                replicas.release(url)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if ctx.preempted and task is not None:
                task.uncancel()
                await self._send_preempted(send, ctx, parsed, served)
                return
            raise

    async def _watch_disconnect(self, receive: Any, ctx: _Context) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if ctx.finished:  # the response is complete: servers report that as a disconnect too
                    return
                ctx.disconnected = True
                if ctx.task is not None and not ctx.task.done():
                    ctx.task.cancel("client disconnected")
                return

    def _observe_ttft(self, ctx: _Context, pool: PoolInfo, scheduler: PoolScheduler, seconds: float) -> None:
        # Labelled by entitlement too: the dashboard draws each entitlement's p99 against its own SLO.
        entitlement = ctx.entry.entitlement if ctx.entry is not None else ""
        self.metrics.ttft.observe((pool.name, entitlement), seconds)
        scheduler.observe_ttft(seconds)

    async def _relay_whole(self, send: Any, ctx: _Context, response: httpx.Response, pool: PoolInfo,
                           scheduler: PoolScheduler, served: _Served) -> None:
        try:
            data = await response.aread()
        except httpx.HTTPError as exc:
            raise GatewayError(502, "upstream_error", f"The backend failed: {type(exc).__name__}.",
                               error_type="server_error") from None
        ctx.upstream_answered = time.perf_counter()
        if response.status_code < 400:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                usage = json.loads(data).get("usage") or {}
                served.prompt_tokens = int(usage["prompt_tokens"]) if "prompt_tokens" in usage else None
                served.completion_tokens = int(usage["completion_tokens"]) if "completion_tokens" in usage else None
        served.first_chunk_at = time.perf_counter()
        self._observe_ttft(ctx, pool, scheduler, served.first_chunk_at - ctx.started)
        content_type = response.headers.get("content-type", "application/json").encode("latin-1")
        await ctx.finish()
        await self._send(send, ctx, response.status_code, data, [(b"content-type", content_type)])

    async def _relay_stream(self, send: Any, ctx: _Context, response: httpx.Response, parsed: ParsedRequest,
                            pool: PoolInfo, scheduler: PoolScheduler, served: _Served) -> None:
        ctx.upstream_answered = time.perf_counter()
        await send({"type": "http.response.start", "status": 200, "headers": self._headers(
            ctx, [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")])})
        served.extra["started"] = True
        pending = b""
        chunks = response.aiter_raw()
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except httpx.HTTPError as exc:
                # The backend broke off mid-stream: end the client's stream with an error event.
                logger.warning("backend stream of %s failed: %s", ctx.request_id, type(exc).__name__)
                await ctx.finish()
                body = b"data: " + error_body("The backend stream failed.", "server_error", "upstream_error")
                await send({"type": "http.response.body", "body": body + b"\n\ndata: [DONE]\n\n",
                            "more_body": False})
                return
            pending += chunk
            out: list[bytes] = []
            while True:
                end = pending.find(b"\n\n")
                if end < 0:
                    break
                event, pending = pending[: end + 2], pending[end + 2:]
                if _inspect_event(event, served, parsed.client_wants_usage):
                    out.append(event)
            if out:
                if served.first_chunk_at is None:
                    served.first_chunk_at = time.perf_counter()
                    self._observe_ttft(ctx, pool, scheduler, served.first_chunk_at - ctx.started)
                if out[-1].startswith(b"data: [DONE]"):
                    # Clients stop at [DONE] and may send their next request at once: the slot and the
                    # accounting must be released before they can see the end, not after.
                    await ctx.finish()
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        await ctx.finish()
        await send({"type": "http.response.body", "body": pending, "more_body": False})

    async def _send_preempted(self, send: Any, ctx: _Context, parsed: ParsedRequest, served: _Served) -> None:
        """End a preempted request cleanly: an error event then [DONE] once streaming, else a 429."""
        message = "This preemptible request was cancelled to make room for higher-priority work."
        with contextlib.suppress(Exception):
            if served.extra.get("started"):
                body = b"data: " + error_body(message, "rate_limit_error", PREEMPTED) + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                await self._send_error(send, ctx, rejected(PREEMPTED, message, retry_after_s=1.0, retryable=True))


def _inspect_event(event: bytes, served: _Served, client_wants_usage: bool) -> bool:
    """Learn usage from an SSE event; False for the usage-only chunk the client did not ask for."""
    if b'"usage"' not in event or b'"usage":null' in event or b'"usage": null' in event:
        if b'"choices"' in event:
            served.chunks += 1
        return True
    start = event.find(b"{")
    try:
        data = json.loads(event[start:]) if start >= 0 else None
    except ValueError:
        return True
    if not isinstance(data, dict):
        return True
    usage = data.get("usage")
    if isinstance(usage, dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            served.prompt_tokens = int(usage["prompt_tokens"])
            served.completion_tokens = int(usage["completion_tokens"])
    if data.get("choices") == []:
        return client_wants_usage
    served.chunks += 1
    return True


def _bind_worker_ticks() -> None:
    """Let the embedded ticker (workers.services) reach this loop's in-process state store."""
    try:
        from workers.services import bind_gateway_loop
    except ImportError:  # the workers package is optional for the gateway
        return
    bind_gateway_loop()


def _slo_ms(scope: dict[str, Any]) -> float | None:
    raw = _header(scope, b"x-llm-d-slo-ttft-ms")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 0 < value < 1e9 else None


def _slo_tier(scope: dict[str, Any], limits: EntitlementLimits) -> str | None:
    raw = _header(scope, b"x-llm-d-inference-objective")
    if raw is None or not raw.strip():
        return None
    try:
        effective_slo_tier(limits.service_class, limits.slo_tier, raw.strip())
    except (PolicyConfigError, ValueError):
        raise invalid_request(f"Unknown x-llm-d-inference-objective {raw!r}.") from None
    return raw.strip()


_REASON_TEXT = {
    "entitlement_not_bound": "The entitlement of this key is not bound to pool capacity.",
    "max_tokens_invalid": "'max_tokens' must be a positive integer.",
    "context_length_exceeded": "The prompt plus max_tokens exceeds the model's context window.",
    "invalid_request": "The request could not be sized.",
    "concurrency_limit_exceeded": "Too many requests in flight for this entitlement.",
    "rate_limit_exceeded": "The entitlement's token budget is exhausted.",
    "kv_cache_limit_exceeded": "The entitlement's KV cache allowance is exhausted.",
    "pool_contended": "The pool is contended and this request's priority is below the admission threshold.",
}
