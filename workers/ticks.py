"""The periodic jobs of the control plane: one registry, three runners.

Each tick is a name, a period and a service (a plain function that does the work through the
apps' services). The same registry drives
- Celery beat (`workers.celery` builds `beat_schedule` from `tick_specs()`; the task calls `run_tick`),
- the standalone loop `python manage.py run_ticks` (a `Ticker` in the foreground),
- the in-process ticker of the embedded server (`start_in_process_ticker()`, a daemon thread).

Rules every runner keeps, implemented once in `run_tick` and `Ticker`:
- no overlap: a firing is skipped while the previous run of the same tick is still going (a slow
  tick never stacks up; the next firing after it finishes runs normally);
- a failing tick is logged and simply runs again next period (no retry storm, no dead loop).

Periods default to the seeds' values (EWMA every 1 s; AIMD every 5 s over a 30 s window); the settings'
`TOKENPOOLS_TICK_PERIODS` (from `TOKENPOOLS_TICK_<NAME>_S` in the environment) changes them.
"""

from __future__ import annotations

import concurrent.futures
import enum
import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TickSpec:
    name: str
    period_s: float
    # "module:function", resolved on first use so that importing the registry (Celery's config,
    # the settings) does not import Django models.
    target: str
    description: str = ""

    def resolve(self) -> Callable[[], Any]:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


DEFAULT_TICKS: tuple[TickSpec, ...] = (
    TickSpec("ewma", 1.0, "apps.gateway.ticks:tick_ewma", "debt and burst EWMAs of every active entitlement"),
    TickSpec("aimd", 5.0, "apps.gateway.ticks:tick_aimd", "AIMD budget of every pool from its p99 TTFT window"),
    TickSpec("scrape", 5.0, "workers.services:tick_scrape", "vLLM /metrics of every replica, measured capacity"),
    TickSpec("autoscale", 15.0, "workers.services:tick_autoscale", "desired replicas of every pool"),
    TickSpec("expiry", 30.0, "workers.services:tick_expiry", "entitlements past expires_at become Expired"),
    TickSpec("usage_rollup", 300.0, "workers.services:tick_usage_rollup", "per-minute usage rolled up hourly"),
    TickSpec("request_log", 600.0, "workers.services:tick_request_log",
             "request log records older than GATEWAY_REQUEST_LOG_DAYS deleted"),
    TickSpec("request_log_drain", 2.0, "apps.gateway.ticks:tick_request_log_drain",
             "request log records the gateways pushed to Redis written to the database"),
    TickSpec("dashboard", 1.0, "apps.dashboard.telemetry:publish_tick",
             "one live-dashboard sample of every pool, to its websocket group"),
)


def _overrides() -> Mapping[str, float]:
    # Imported here: tokenpools_site.settings imports this module for the registry's names and defaults.
    from django.conf import settings

    return dict(settings.TOKENPOOLS_TICK_PERIODS or {})


def tick_specs(names: Iterable[str] | None = None) -> dict[str, TickSpec]:
    """The registry with the configured periods (settings' TOKENPOOLS_TICK_PERIODS, else the defaults)."""
    overrides = _overrides()
    wanted = None if names is None else set(names)
    specs: dict[str, TickSpec] = {}
    for spec in DEFAULT_TICKS:
        if wanted is not None and spec.name not in wanted:
            continue
        period = float(overrides.get(spec.name, spec.period_s))
        if not period > 0:
            raise ValueError(f"tick {spec.name!r} needs a positive period, got {period!r}")
        specs[spec.name] = TickSpec(spec.name, period, spec.target, spec.description)
    if wanted is not None and wanted - set(specs):
        raise KeyError(f"unknown ticks: {', '.join(sorted(wanted - set(specs)))}")
    return specs


class Outcome(enum.StrEnum):
    RAN = "ran"
    SKIPPED = "skipped"
    FAILED = "failed"


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(name: str) -> threading.Lock:
    with _locks_guard:
        lock = _locks.get(name)
        if lock is None:
            lock = _locks[name] = threading.Lock()
        return lock


def run_tick(name: str, service: Callable[[], Any] | None = None) -> Outcome:
    """Run one tick now unless a run of it is still going in this process; never raises."""
    lock = _lock_for(name)
    if not lock.acquire(blocking=False):
        logger.info("tick %s skipped: the previous run is still going", name)
        return Outcome.SKIPPED
    try:
        fn = service or tick_specs([name])[name].resolve()
        _close_old_db_connections()
        fn()
        return Outcome.RAN
    except Exception:
        logger.exception("tick %s failed; it runs again next period", name)
        return Outcome.FAILED
    finally:
        _close_old_db_connections()
        lock.release()


def _close_old_db_connections() -> None:
    # Ticks run in long-lived threads and worker processes: drop connections the database closed or
    # that outlived CONN_MAX_AGE (Django does this around requests, nobody does it around ticks). A
    # connection inside a caller's transaction (a test, a service calling run_tick) is left alone.
    try:
        from django.db import connections

        for connection in connections.all(initialized_only=True):
            if not connection.in_atomic_block:
                connection.close_if_unusable_or_obsolete()
    except Exception:  # the settings may not be configured (a bare unit test of the ticker)
        logger.debug("closing old database connections failed", exc_info=True)


class Ticker:
    """Fires every due tick on a thread pool; a tick still running at its next firing is skipped.

    Time comes from `clock` (seconds, monotonic) so that tests step it by hand and call
    `run_pending()`; `run_forever` polls it for the standalone loop and the in-process thread.
    Services may be given directly (`services`), else they are resolved from each spec's target.
    """

    def __init__(
        self,
        specs: Mapping[str, TickSpec],
        *,
        clock: Callable[[], float] = time.monotonic,
        services: Mapping[str, Callable[[], Any]] | None = None,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        if not specs:
            raise ValueError("a ticker needs at least one tick")
        self.specs = dict(specs)
        self.clock = clock
        self._services = dict(services or {})
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            max_workers=len(self.specs), thread_name_prefix="tick"
        )
        start = clock()
        # Everything fires once at start, then every period.
        self.next_due: dict[str, float] = {name: start for name in self.specs}
        self.running: dict[str, concurrent.futures.Future[Outcome]] = {}
        self.counts: dict[str, dict[str, int]] = {name: {o.value: 0 for o in Outcome} for name in self.specs}
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _service(self, name: str) -> Callable[[], Any]:
        service = self._services.get(name)
        if service is None:
            service = self._services[name] = self.specs[name].resolve()
        return service

    def _count(self, name: str, outcome: Outcome) -> None:
        with self._count_lock:
            self.counts[name][outcome.value] += 1

    def _run(self, name: str, service: Callable[[], Any]) -> Outcome:
        outcome = run_tick(name, service)
        self._count(name, outcome)  # before the future resolves, so callers see the count
        return outcome

    def run_pending(self) -> list[str]:
        """Start every tick that is due; returns the names started (skipped ones are counted)."""
        now = self.clock()
        started: list[str] = []
        for name, spec in self.specs.items():
            if now < self.next_due[name]:
                continue
            # The next firing is one period from now, not from the missed slot: no catch-up burst.
            self.next_due[name] = now + spec.period_s
            previous = self.running.get(name)
            if previous is not None and not previous.done():
                logger.info("tick %s skipped: the previous run is still going", name)
                self._count(name, Outcome.SKIPPED)
                continue
            self.running[name] = self._executor.submit(self._run, name, self._service(name))
            started.append(name)
        return started

    def seconds_until_next(self) -> float:
        return max(0.0, min(self.next_due.values()) - self.clock())

    def run_forever(self, *, max_sleep_s: float = 0.5) -> None:
        """Loop until `stop()`; sleeps until the next tick is due (at most `max_sleep_s`)."""
        while not self._stop.is_set():
            try:
                self.run_pending()
            except RuntimeError:  # the executor shut down under us: stop() was called
                if self._stop.is_set():
                    break
                raise
            self._stop.wait(min(max_sleep_s, self.seconds_until_next()) or 0.01)

    def start(self) -> threading.Thread:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self.run_forever, name="tokenpools-ticker", daemon=True)
            self._thread.start()
        return self._thread

    def stop(self, *, wait: bool = True) -> None:
        self._stop.set()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._executor.shutdown(wait=wait)


# In-process ticking (embedded server) ------------------------------------------------------------

# Ticks the embedded server runs itself. The AIMD tick is left out: the gateway ticks it (apps.gateway.app,
# every GATEWAY_AIMD_TICK_S): alone, its own controller per pool; with Redis and no Celery, the pool's one
# shared controller, run by one gateway process per period under a short lock. Celery beat and
# `run_ticks` run the shared AIMD tick here (`tick_aimd`), which publishes the budget in the gateway's store.
IN_PROCESS_TICKS = ("ewma", "scrape", "autoscale", "expiry", "usage_rollup", "request_log", "request_log_drain",
                    "dashboard")
# Ticks that read what only a server process holds (its schedulers, counters and channel layer): they
# run in every server process even when Celery runs the others, and never under Celery beat.
SERVER_ONLY_TICKS = ("dashboard",)

_in_process: Ticker | None = None
_in_process_guard = threading.Lock()


def ticks_mode() -> str:
    """Who runs the ticks: 'celery', 'in-process' or 'off' (`apps.gateway.ticks.ticks_mode`; imported on use,
    so that importing this registry, as the settings do, stays free of the apps)."""
    from apps.gateway.ticks import ticks_mode as mode

    return mode()


def start_in_process_ticker(names: Iterable[str] = IN_PROCESS_TICKS, *, force: bool = False,
                            services: Mapping[str, Callable[[], Any]] | None = None) -> Ticker | None:
    """Start the ticks inside this process (once; later calls return the same ticker).

    When Celery runs the ticks (`ticks_mode()`), only the server-only ones start here, unless `force`. Call it from the
    server's startup with the gateway's own `services` (`BackgroundLoops.tick_services()`): the ticks that need
    the gateway's in-process state store reach it through them.
    """
    global _in_process
    mode = ticks_mode()
    if mode == "off" and not force:
        return None
    if mode == "celery" and not force:
        names = [name for name in names if name in SERVER_ONLY_TICKS]
        if not names:
            return None
    with _in_process_guard:
        if _in_process is None:
            _in_process = Ticker(tick_specs(names), services=services)
            _in_process.start()
            logger.info("in-process ticker started: %s", ", ".join(_in_process.specs))
        return _in_process


def stop_in_process_ticker() -> None:
    global _in_process
    with _in_process_guard:
        if _in_process is not None:
            _in_process.stop(wait=False)
            _in_process = None
