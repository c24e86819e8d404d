"""What if (issue 26): the gateway's request log turned back into a workload and replayed in virtual time.

Pure: no ORM here (`apps.simulator.replay_site` reads the records and the pools; `manage.py replay` prints).
Each recorded request arrives at its recorded instant (seconds from the window's start) with its recorded
prompt tokens and `max_tokens` (what admission sizes it by), and is served as long as it really was: its
recorded completion tokens (a request nothing served gets its entitlement's median served completion, capped
at its max_tokens). The pool is the gateway's own picture of it (`apps.gateway.snapshot.PoolInfo`: slots,
KV bytes, the entitlements' limits), driven by the one admission state machine (`TokenPoolsAdmission`).

Service times: a latency model fitted to the pool's recorded requests, not each record's own times. A record's
TTFT and duration are what that request took *under the load it met* (its wait in a queue included); a
replay under another manifest changes that load, and a request refused when recorded has no time at all. So
the replay fits the simulator's fixed per-token model to the pool's served records (decode: median of
(duration - TTFT) / (completion tokens - 1); prefill: a low percentile of (TTFT - wait - one decode step) /
prompt tokens; `fit_latency` says why) and lets the simulated replicas (the pool's enabled replicas x slots,
continuous batching) produce every request's times.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from apps.policy.admission import AdmissionConfig, AdmissionRequest, EntitlementLimits
from apps.policy.priority import DynamicsConfig
from apps.simulator.admission import TokenPoolsAdmission
from apps.simulator.cluster import Cluster
from apps.simulator.simulation import SimConfig, Simulation, percentile
from apps.simulator.workload import TenantSpec
from backends.virtual_vllm.instance import SimRequest

# Fallback per-token times when a pool has no served record to fit them to (the simulator's defaults).
DEFAULT_PREFILL_MS = SimConfig.prefill_ms_per_token
DEFAULT_DECODE_MS = SimConfig.decode_ms_per_token
# Which of the served records' first tokens (beyond one decode step) the prefill is fitted to (fit_latency).
PREFILL_PERCENTILE = 10
# The simulator's names of a wait that ran out, as the gateway records them (`Admitter._turned_away`).
LOST_AS_REJECTED = {"queue_timeout": "queue_timeout", "expired": "pool_contended"}
RECORDED_ADMITTED = frozenset({"served", "cancelled", "preempted", "timeout"})


class Recorded(NamedTuple):
    """One request log record, as the replay reads it (`apps.gateway.models.RequestLogRecord`)."""

    arrived: float  # epoch seconds
    tenant_id: int
    pool: str
    entitlement: str
    prompt_tokens: int
    max_tokens: int | None
    completion_tokens: int
    outcome: str
    reason: str
    queue_ms: float
    ttft_ms: float | None
    duration_ms: float


@dataclass(frozen=True)
class PoolPicture:
    """What the replay needs of a pool (read from the gateway's snapshot of the database)."""

    name: str
    replicas: int
    slots_per_replica: int
    kv_capacity: float
    mean_slo_ms: float
    entitlements: dict[str, EntitlementLimits]
    owners: dict[str, str] = field(default_factory=dict)  # entitlement -> tenant slug
    has_quotas: bool = False
    # Entitlement -> its lifetime over the window (`apps.simulator.lifetimes`); one missing holds its
    # `entitlements` limits throughout. `entitlements` names every entitlement that exists at some moment.
    timelines: dict[str, Timeline] = field(default_factory=dict)


class Timeline(NamedTuple):
    """An entitlement's limits at the window's start (None: it did not exist yet) and each later change
    (epoch seconds, the limits from then on or None: deleted), oldest first."""

    initial: EntitlementLimits | None
    changes: tuple[tuple[float, EntitlementLimits | None], ...] = ()


@dataclass(frozen=True)
class Latency:
    prefill_ms_per_token: float
    decode_ms_per_token: float
    fitted_from: int  # served records the fit used (0: the defaults)

    def as_dict(self) -> dict[str, Any]:
        return {"model": "fitted", "prefill_ms_per_token": round(self.prefill_ms_per_token, 6),
                "decode_ms_per_token": round(self.decode_ms_per_token, 6), "fitted_from": self.fitted_from}


def fit_latency(records: Iterable[Recorded]) -> Latency:
    """The fixed per-token model that the pool's served records imply.

    Decode: the median of (duration - TTFT) / (completion tokens - 1). Prefill: a low percentile
    (`PREFILL_PERCENTILE`) of what a step's first tokens took beyond one decode step, per prompt token it
    prefilled. Not the median of TTFT / prompt tokens: a first token also waits for the step in progress (up to
    a whole step) and comes out of a step that decodes the others too, and in the model a prefill stalls every
    running sequence for its length; a TTFT charged whole to the prefill (0.45 s of 64 prompt tokens on a
    133 ms-step backend whose prefill is 0.5 ms a token) made each arrival stall the replayed batch by 0.44 s,
    and the replayed pool served half what the live one did. The fastest first tokens are the requests that
    arrived as a step began: the prefill plus that one step (or, sooner than a step, the prefill alone:
    `_prefill_ms`). Requests whose first tokens came out together (closed-loop clients sending at once) were
    prefilled in one step: their prompts are that step's tokens (`_prefill_steps`). Last, the decode time
    measured live already includes the stalls of the others' prefills (the served rate times their prefill),
    which the replay adds again: taken out of it."""
    served = [r for r in records if r.outcome == "served" and r.ttft_ms is not None]
    decode = [max(0.0, r.duration_ms - r.ttft_ms) / (r.completion_tokens - 1)  # type: ignore[operator]
              for r in served if r.completion_tokens > 1]
    decode_ms = statistics.median(decode) if decode else DEFAULT_DECODE_MS
    prefill = _prefill_steps(served, decode_ms if decode else 0.0)
    prefill_ms = percentile(prefill, PREFILL_PERCENTILE) if prefill else DEFAULT_PREFILL_MS
    assert prefill_ms is not None
    if decode and len(served) > 1:
        span_s = max(r.arrived for r in served) - min(r.arrived for r in served)
        if span_s > 0:
            prefill_share = len(served) / span_s * statistics.fmean(r.prompt_tokens for r in served) * prefill_ms / 1000
            decode_ms *= max(0.5, 1.0 - prefill_share)
    return Latency(prefill_ms, decode_ms, max(len(prefill), len(decode)))


def _prefill_steps(served: Sequence[Recorded], step_ms: float) -> list[float]:
    """Per prefill step, its prefill time per prompt token: the served records grouped by when their first
    token came (within a quarter of a decode step: one step's first tokens come out together, two steps' at
    least a step apart), each group's fastest first token (its last arrival) over the group's prompt tokens."""
    firsts = sorted(((r.arrived * 1000 + r.ttft_ms, r) for r in served if r.prompt_tokens > 0),  # type: ignore[operator]
                    key=lambda pair: pair[0])
    together_ms = step_ms / 4
    out: list[float] = []
    group: list[Recorded] = []
    last = -math.inf
    for at, record in [*firsts, (math.inf, None)]:
        if group and (record is None or at - last > together_ms):
            fastest = min(r.ttft_ms - r.queue_ms for r in group)  # type: ignore[operator]
            out.append(_prefill_ms(fastest, step_ms) / sum(r.prompt_tokens for r in group))
            group = []
        if record is not None:
            group.append(record)
            last = at
    return out


def _prefill_ms(first_token_ms: float, step_ms: float) -> float:
    """A first token's prefill: beyond the decode step its prefill step also ran; a first token sooner than a
    decode step came out of a step that decoded nothing else (an idle replica): all of it was prefill."""
    first_token_ms = max(0.0, first_token_ms)
    return first_token_ms - step_ms if first_token_ms >= step_ms else first_token_ms


class _Replayed(SimRequest):
    """A recorded request in the simulator: its output is what it was served, its offer what it asked."""

    __slots__ = ("max_tokens",)

    def __init__(self, rid: int, tenant: str, prompt: int, output: int, arrival: float, max_tokens: int | None):
        super().__init__(rid, tenant, prompt, output, arrival)
        self.max_tokens = max_tokens


class ReplayAdmission(TokenPoolsAdmission):
    """Token-pools admission with the pool's real limits (the snapshot's, not a scenario's) and KV bytes.

    Entitlements follow their lifetimes (`PoolPicture.timelines`) through the seed scenarios' own timed
    join and leave: one that exists at the window's start joins at 0; a creation or a change later is a join
    with its new limits then (`upsert_entitlement`, as the gateway's snapshot reload), a deletion a leave."""

    def __init__(self, pool: PoolPicture, *, seed: int = 0, tick_s: float = 1.0, config: AdmissionConfig | None = None,
                 dynamics: DynamicsConfig | None = None, start: float = 0.0) -> None:
        timelines = pool.timelines
        present = [name for name in pool.entitlements if name not in timelines or timelines[name].initial is not None]
        # Named, not **kwargs: mypyc's compiled build (apps.compiled) mis-forwards **kwargs to a compiled __init__.
        super().__init__([TenantSpec(name) for name in present], mean_slo_ms=pool.mean_slo_ms, seed=seed,
                         tick_s=tick_s, config=config, dynamics=dynamics)
        self.limits = dict(pool.entitlements)
        for name, timeline in timelines.items():
            if timeline.initial is not None:
                self.limits[name] = timeline.initial
        self.changes = sorted(((max(0.0, at - start), name, limits) for name, timeline in timelines.items()
                               for at, limits in timeline.changes), key=lambda change: change[0])
        self.pool = pool

    def bind(self, cluster: Cluster) -> None:
        super().bind(cluster)
        self.ledger.set_capacity(self.pool.replicas * self.pool.slots_per_replica, 0.0, self.pool.kv_capacity)
        for at, name, limits in self.changes:
            # Daemon: a change after the last request keeps nothing running.
            cluster.loop.at(at, self._change, name, limits, daemon=True)

    def _change(self, name: str, limits: EntitlementLimits | None) -> None:
        if limits is None:
            if self.ledger.limits(name) is not None:
                self._leave(name)
            return
        self.limits[name] = limits
        self._join(name)

    def on_capacity_change(self) -> None:
        return None  # the pool's capacity is the snapshot's; a replay has no capacity events

    def offer_of(self, request: SimRequest) -> AdmissionRequest:
        max_tokens = request.max_tokens if isinstance(request, _Replayed) else request.output_tokens
        return AdmissionRequest(str(request.rid), request.prompt_tokens, max_tokens=max_tokens)


def _output_lengths(records: Sequence[Recorded]) -> dict[str, int]:
    """Each entitlement's median served completion: the length of a request nothing served."""
    served: dict[str, list[int]] = {}
    for r in records:
        if r.outcome == "served" and r.completion_tokens > 0:
            served.setdefault(r.entitlement, []).append(r.completion_tokens)
    return {name: round(statistics.median(values)) for name, values in served.items()}


@dataclass
class PoolRun:
    figures: dict[str, dict[str, Any]]
    ttft: dict[str, list[float]]
    wall_seconds: float
    requests: int
    guessed_lengths: int


def replay_pool(records: Sequence[Recorded], pool: PoolPicture, latency: Latency, *, start: float,
                tick_s: float = 1.0, config: AdmissionConfig | None = None, dynamics: DynamicsConfig | None = None,
                seed: int = 0, progress: Callable[[int], None] | None = None) -> PoolRun:
    """Replay one pool's records (oldest first) from `start` (epoch seconds) under `pool`'s limits."""
    sim_config = SimConfig(latency_model="fixed", prefill_ms_per_token=latency.prefill_ms_per_token,
                           decode_ms_per_token=latency.decode_ms_per_token, num_instances=max(1, pool.replicas),
                           max_num_seqs=max(1, pool.slots_per_replica), max_batched_tokens=None, tenants=[],
                           seed=seed, routing="least-loaded")
    admission = ReplayAdmission(pool, seed=seed, tick_s=tick_s, config=config, dynamics=dynamics, start=start)
    simulation = Simulation(sim_config, admission, progress=progress)
    if pool.replicas <= 0:  # no replica enabled: nothing may run (the instance is only there to exist)
        simulation.cluster.instances[0].go_offline()
    lengths = _output_lengths(records)
    replayed = sorted((r for r in records if r.entitlement in pool.entitlements), key=lambda r: r.arrived)
    guessed = 0
    requests: list[_Replayed] = []
    for index, r in enumerate(replayed):
        output = r.completion_tokens
        if output <= 0 or r.outcome not in RECORDED_ADMITTED:
            default = pool.entitlements[r.entitlement].default_max_tokens
            output = min(r.max_tokens or default, lengths.get(r.entitlement, r.max_tokens or default))
            guessed += 1
        requests.append(_Replayed(index + 1, r.entitlement, r.prompt_tokens, output, max(0.0, r.arrived - start),
                                  r.max_tokens))
    loop = simulation.loop

    def feed(position: int) -> None:
        # One arrival on the heap at a time: a day of records is not a day of events up front.
        simulation.cluster.submit(requests[position])
        if position + 1 < len(requests):
            loop.at(requests[position + 1].arrival, feed, position + 1)

    if requests:
        loop.at(requests[0].arrival, feed, 0)
    started = time.perf_counter()
    simulation.run()
    wall = time.perf_counter() - started
    figures, ttft = _simulated_figures(simulation, admission, pool)
    return PoolRun(figures, ttft, wall, len(requests), guessed)


def _simulated_figures(simulation: Simulation, admission: ReplayAdmission,
                       pool: PoolPicture) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]]]:
    peak_debt: dict[str, float] = {}
    for sample in admission.debt_samples:
        for name, debt in sample.debt.items():
            peak_debt[name] = max(peak_debt.get(name, debt), debt)
    out: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    for name in pool.entitlements:
        tenant = simulation.cluster.stats.tenants.get(name)
        if tenant is None:
            out[name] = figures_of(offered=0, rejected_by_reason={}, waited=0, ttft_s=[], peak_debt=peak_debt.get(name))
            ttfts[name] = []
            continue
        refused: Counter[str] = Counter(tenant.denials)
        for lost, reason in LOST_AS_REJECTED.items():
            refused[reason] += tenant.lost_by_reason.get(lost, 0)
        timed_out = sum(tenant.lost_by_reason.get(lost, 0) for lost in LOST_AS_REJECTED)
        waited = sum(1 for wait in tenant.queue_wait if wait > 1e-6) + timed_out
        out[name] = figures_of(offered=tenant.submitted, rejected_by_reason=dict(refused), waited=waited,
                               ttft_s=tenant.ttft, peak_debt=peak_debt.get(name))
        ttfts[name] = list(tenant.ttft)
    return out, ttfts


def figures_of(*, offered: int, rejected_by_reason: dict[str, int], waited: int, ttft_s: Sequence[float],
               peak_debt: float | None, errors: int = 0) -> dict[str, Any]:
    """One column of the report (recorded, current or proposed) for one entitlement or a pool's total."""
    by_reason = {k: v for k, v in sorted(rejected_by_reason.items()) if v}
    rejected = sum(by_reason.values())
    return {
        "offered": offered, "admitted": offered - rejected - errors, "rejected": rejected,
        "rejected_by_reason": by_reason, "errors": errors, "waited": waited,
        "p50_ttft_s": _round(percentile(list(ttft_s), 50)), "p99_ttft_s": _round(percentile(list(ttft_s), 99)),
        "throttle": round(rejected / offered, 4) if offered else None,
        "peak_debt": _round(peak_debt),
    }


def recorded_figures(records: Iterable[Recorded]) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]]]:
    """What happened, per entitlement, in the same shape (debt is not recorded: `peak_debt` is None)."""
    groups: dict[str, list[Recorded]] = {}
    for r in records:
        groups.setdefault(r.entitlement, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    for name, mine in groups.items():
        refused = Counter(r.reason or "rejected" for r in mine if r.outcome == "rejected")
        ttft = [r.ttft_ms / 1000 for r in mine if r.outcome == "served" and r.ttft_ms is not None]
        out[name] = figures_of(offered=len(mine), rejected_by_reason=dict(refused),
                               waited=sum(1 for r in mine if r.queue_ms > 0), ttft_s=ttft, peak_debt=None,
                               errors=sum(1 for r in mine if r.outcome == "error"))
        ttfts[name] = ttft
    return out, ttfts


def totals(columns: Sequence[dict[str, Any]], ttfts: Sequence[Sequence[float]]) -> dict[str, Any]:
    """A pool's total of some entitlements' columns (its TTFT percentiles from all their requests)."""
    by_reason: Counter[str] = Counter()
    for column in columns:
        by_reason.update(column["rejected_by_reason"])
    debts = [c["peak_debt"] for c in columns if c["peak_debt"] is not None]
    return figures_of(offered=sum(c["offered"] for c in columns), rejected_by_reason=dict(by_reason),
                      waited=sum(c["waited"] for c in columns), ttft_s=[v for t in ttfts for v in t],
                      peak_debt=max(debts) if debts else None, errors=sum(c["errors"] for c in columns))


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
