"""Workload specs and the arrival sources that drive them: open loop (Poisson or bursty gamma arrivals at a
rate, with rate phases) or closed loop (N clients, each sending its next request when the last one ends),
per tenant, between join and leave times. Every tenant draws from its own seeded `random.Random`, so adding
a tenant never changes the draws of another.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.virtual_vllm.instance import SimRequest


class WorkloadError(ValueError):
    """A workload or scenario value that cannot be simulated; the message names the field."""


@dataclass(frozen=True)
class LengthSpec:
    """Token-length distribution: fixed, lognormal (by arithmetic mean and log-space sigma) or uniform."""

    kind: str = "fixed"
    value: int = 128
    mean: float = 0.0
    sigma: float = 0.0
    low: int = 1
    high: int = 1_000_000

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        # lognormal with the given arithmetic mean: mu = ln(mean) - sigma^2 / 2
        mu = math.log(self.mean) - self.sigma * self.sigma / 2
        return min(self.high, max(self.low, round(rng.lognormvariate(mu, self.sigma))))

    @property
    def expected(self) -> float:
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        return self.mean

    @classmethod
    def parse(cls, raw: Any, where: str) -> LengthSpec:
        if isinstance(raw, bool):
            raise WorkloadError(f"{where}: expected a token count or a distribution, got {raw!r}")
        if isinstance(raw, int | float):
            if raw < 1 or int(raw) != raw:
                raise WorkloadError(f"{where}: a fixed length must be a positive integer, got {raw!r}")
            return cls("fixed", int(raw))
        if not isinstance(raw, dict):
            raise WorkloadError(f"{where}: expected a token count or a mapping with 'dist', got {raw!r}")
        kind = str(raw.get("dist", "fixed")).lower()
        try:
            low = int(raw.get("min", 1))
            high = int(raw.get("max", 1_000_000))
            if kind == "fixed":
                return cls.parse(raw.get("value"), f"{where}.value")
            if kind == "uniform":
                if not 1 <= low <= high:
                    raise WorkloadError(f"{where}: uniform needs 1 <= min <= max, got {low}..{high}")
                return cls("uniform", low=low, high=high)
            if kind == "lognormal":
                mean = float(raw["mean"])
                sigma = float(raw.get("sigma", 0.5))
                if mean <= 0 or sigma < 0 or not math.isfinite(mean + sigma):
                    raise WorkloadError(f"{where}: lognormal needs mean > 0 and sigma >= 0")
                if not 1 <= low <= high:
                    raise WorkloadError(f"{where}: needs 1 <= min <= max, got {low}..{high}")
                return cls("lognormal", mean=mean, sigma=sigma, low=low, high=high)
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, WorkloadError):
                raise
            raise WorkloadError(f"{where}: {error!r}") from error
        raise WorkloadError(f"{where}: unknown dist {kind!r} (fixed, uniform, lognormal)")


@dataclass(frozen=True)
class RatePhase:
    at: float
    rate: float


@dataclass(frozen=True)
class TenantSpec:
    """One tenant (entitlement) of the workload and the load it offers."""

    name: str
    slo_class: str = "standard"
    rate: float = 0.0  # open loop, requests/s
    concurrency: int = 0  # closed loop: clients, each with one request outstanding
    arrival: str = "poisson"  # or "gamma" (bursty, with coefficient of variation `cv`)
    cv: float = 1.0
    input: LengthSpec = field(default_factory=lambda: LengthSpec("fixed", 512))
    output: LengthSpec = field(default_factory=lambda: LengthSpec("fixed", 128))
    start: float = 0.0
    stop: float | None = None
    phases: tuple[RatePhase, ...] = ()
    think_time_s: float = 0.0
    retries: int = 0  # open loop: how many times a rejected request is sent again
    retry_backoff_s: float = 1.0  # used when the rejection carries no Retry-After
    slo_target_ms: float | None = None
    entitlement: dict[str, Any] = field(default_factory=dict)

    def rate_at(self, when: float) -> float:
        rate = self.rate
        for phase in self.phases:
            if when >= phase.at:
                rate = phase.rate
        return rate


class Gateway(Protocol):
    def submit(self, request: SimRequest) -> None: ...


class Workload:
    """Schedules arrivals on the loop and answers the gateway's completion, rejection and loss callbacks."""

    def __init__(
        self,
        loop: Any,
        gateway: Gateway,
        tenants: list[TenantSpec],
        seed: int,
        num_requests: int | None = None,
    ) -> None:
        self.loop = loop
        self.gateway = gateway
        self.tenants = tenants
        self.seed = seed
        self.limit = num_requests
        self.generated = 0
        self.retries = 0
        self._next_id = 0
        self._rngs = {t.name: random.Random(f"{seed}:{t.name}") for t in tenants}

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.generated >= self.limit

    def start(self) -> None:
        for tenant in self.tenants:
            if tenant.concurrency > 0:
                for _ in range(tenant.concurrency):
                    self.loop.at(tenant.start, self._closed_loop_send, tenant)
            if tenant.rate > 0 or tenant.phases:
                self.loop.at(tenant.start, self._open_loop_arrival, tenant, True)

    # ---- open loop -------------------------------------------------------------------------------
    def _gap(self, tenant: TenantSpec, rate: float) -> float:
        rng = self._rngs[tenant.name]
        if tenant.arrival == "gamma":
            shape = 1.0 / (tenant.cv * tenant.cv)
            return rng.gammavariate(shape, 1.0 / (rate * shape))
        # rng.expovariate(rate), its formula written out (random.py: interpreted, one call per arrival).
        return -math.log(1.0 - rng.random()) / rate

    def _open_loop_arrival(self, tenant: TenantSpec, first: bool) -> None:
        now = self.loop.time
        if tenant.stop is not None and now >= tenant.stop:
            return
        rate = tenant.rate_at(now) if tenant.phases else tenant.rate
        if rate <= 0:
            # Idle phase: wake at the next phase boundary.
            upcoming = [p.at for p in tenant.phases if p.at > now]
            if upcoming:
                self.loop.at(min(upcoming), self._open_loop_arrival, tenant, True)
            return
        if first:
            # The first arrival of a phase comes one gap after it starts, like every other one.
            self.loop.after(self._gap(tenant, rate), self._open_loop_arrival, tenant, False)
            return
        if self.exhausted:
            return
        self._send(tenant, attempt=0)
        next_time = now + self._gap(tenant, rate)
        boundary = [p.at for p in tenant.phases if now < p.at <= next_time] if tenant.phases else None
        if boundary:
            self.loop.at(min(boundary), self._open_loop_arrival, tenant, True)
        else:
            self.loop.at(next_time, self._open_loop_arrival, tenant, False)

    # ---- closed loop -----------------------------------------------------------------------------
    def _closed_loop_send(self, tenant: TenantSpec) -> None:
        now = self.loop.time
        if (tenant.stop is not None and now >= tenant.stop) or self.exhausted:
            return
        self._send(tenant, attempt=0)

    def _send(self, tenant: TenantSpec, attempt: int, prompt: int = 0, output: int = 0) -> None:
        rng = self._rngs[tenant.name]
        if attempt == 0:
            prompt = tenant.input.sample(rng)
            output = tenant.output.sample(rng)
        self._next_id += 1
        self.generated += 1
        # Positional, in SimRequest's order (rid, tenant, prompt, output, arrival, slo_class, attempt, origin, SLO).
        request = SimRequest(self._next_id, tenant.name, prompt, output, self.loop.time, tenant.slo_class, attempt,
                             tenant, None if tenant.slo_target_ms is None else tenant.slo_target_ms / 1000)
        self.gateway.submit(request)

    # ---- callbacks from the gateway --------------------------------------------------------------
    def request_done(self, request: SimRequest) -> None:
        """A request ended (completed or lost): a closed-loop client sends its next one."""
        tenant: TenantSpec | None = request.origin  # None: a replayed or live request (no spec)
        if tenant is not None and tenant.concurrency > 0:
            # A failed request (instance lost, timed out in a queue) costs the client its backoff, so a cluster
            # with no instance online cannot spin a closed loop in zero virtual time.
            failed = request.finished_at is None
            self.loop.after(
                tenant.retry_backoff_s if failed else tenant.think_time_s, self._closed_loop_send, tenant
            )

    def request_rejected(self, request: SimRequest, retry_after_s: float | None) -> None:
        tenant: TenantSpec | None = request.origin  # None: a replayed or live request (no spec)
        if tenant is None:
            return
        wait = retry_after_s if retry_after_s is not None and retry_after_s > 0 else tenant.retry_backoff_s
        if tenant.concurrency > 0:
            # A closed-loop client backs off as told, then sends again (a new attempt of the same work).
            self.loop.after(wait, self._retry, tenant, request)
        elif request.attempt < tenant.retries:
            self.loop.after(wait, self._retry, tenant, request)

    def _retry(self, tenant: TenantSpec, request: SimRequest) -> None:
        now = self.loop.time
        if (tenant.stop is not None and now >= tenant.stop) or self.exhausted:
            return
        self.retries += 1
        self._send(tenant, request.attempt + 1, request.prompt_tokens, request.output_tokens)
