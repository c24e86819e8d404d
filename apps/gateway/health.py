"""Health endpoints for load balancers, kubelets and vLLM clients: no authentication, no request metrics.

- `GET /healthz`: the process is up and its event loop answers (liveness). Touches nothing else: a liveness
  probe that failed with the database would have every replica restarted for an outage none of them can fix.
- `GET /readyz`: this process can serve (readiness): the database answers (checked at most once per
  `DATABASE_CACHE_S`), the state store answers a PING through its own client (the in-process store always
  does), and every pool has at least one replica the gateway holds healthy. What "healthy" means is what the
  gateway already knows from its health probes and failed connections (routing.py, background.py): no backend is
  probed per /readyz. 200 `{"status": "ok", "checks": {...}}`, else 503 with the same body saying what is not
  ready (`"status": "not ready"`, or `"starting"` while the gateway could not start yet). Pool names are
  site-wide and shown; nothing names a tenant or an entitlement, and errors are reduced to their type (a
  driver's message may carry a host or a user name).
- `GET /health`: as vLLM answers it (200, empty body), since vLLM's clients (guidellm) check it before they
  start; like vLLM's it says the server is up.

HEAD is answered like GET, without the body.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from apps.gateway.context import JSON_TYPE, RequestContext
from apps.gateway.errors import GatewayError

if TYPE_CHECKING:
    from apps.gateway.app import Gateway

logger = logging.getLogger(__name__)

HEALTH_PATHS = frozenset({"/healthz", "/readyz", "/health"})
# A probe every second from every load balancer must not become a query each: one at most per this period.
DATABASE_CACHE_S = 1.0
DATABASE_TIMEOUT_S = 2.0
STORE_TIMEOUT_S = 1.0
# How long /readyz waits for a gateway that has not started (it starts it) before it answers "starting".
START_TIMEOUT_S = 5.0
OK = "ok"


class Health:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._database: tuple[float, str] | None = None
        self._database_task: asyncio.Task[str] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: dict[str, Any] | None = None

    async def serve(self, ctx: RequestContext) -> None:
        path, method = ctx.scope["path"], ctx.scope["method"]
        if method not in ("GET", "HEAD"):
            raise GatewayError(405, "method_not_allowed", f"Use GET or HEAD on {path}.")
        if path == "/health":
            status, body, headers = 200, b"", []
        elif path == "/healthz":
            status, body, headers = 200, json.dumps({"status": OK}).encode(), [JSON_TYPE]
        else:
            ready, report = await self.readiness()
            status, body, headers = (200 if ready else 503), json.dumps(report).encode(), [JSON_TYPE]
        await ctx.respond(status, b"" if method == "HEAD" else body,
                          [*headers, (b"cache-control", b"no-store")])

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, the body of /readyz)."""
        starting = await self._start()
        database, store = await asyncio.gather(self.database(), self.store())
        checks: dict[str, Any] = {"database": database, "state_store": store, "pools": self.pools()}
        if starting is not None:
            checks["gateway"] = starting
        ready = starting is None and database == OK and store == OK and all(
            state == OK for state in checks["pools"].values())
        report = {"status": OK if ready else "starting" if starting is not None else "not ready", "checks": checks}
        if report != self._last:  # a change is logged once, not on every probe
            log = logger.info if ready else logger.warning
            log("gateway readiness: %s", json.dumps(report))
            self._last = report
        return ready, report

    async def _start(self) -> str | None:
        """Start the gateway if it has not (it starts on its first request or the server's lifespan);
        None once started, else what stopped it."""
        gateway = self.gateway
        if gateway._started:
            return None
        try:
            await asyncio.wait_for(gateway.start(), START_TIMEOUT_S)
        except TimeoutError:
            return "starting"
        except Exception as exc:
            logger.debug("gateway start from /readyz failed", exc_info=True)
            return f"not started: {type(exc).__name__}"
        return None

    async def database(self) -> str:
        """OK or why not, at most one query per `DATABASE_CACHE_S` whatever the number of probes."""
        cached = self._database
        if cached is not None and time.monotonic() - cached[0] < DATABASE_CACHE_S:
            return cached[1]
        if self._database_task is None or self._database_task.done():
            self._database_task = asyncio.get_running_loop().create_task(self._query_database())
        return await asyncio.shield(self._database_task)

    async def _query_database(self) -> str:
        if self._executor is None:
            # Its own thread: a slow snapshot load (the snapshot's thread) must not read as a database down.
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gw-readyz")
        future = asyncio.get_running_loop().run_in_executor(self._executor, _select_one)
        try:
            result = OK if await asyncio.wait_for(future, DATABASE_TIMEOUT_S) else "unexpected answer"
        except TimeoutError:
            result = f"unreachable: no answer in {DATABASE_TIMEOUT_S:g} s"
        except Exception as exc:
            result = f"unreachable: {type(exc).__name__}"
        self._database = (time.monotonic(), result)
        return result

    async def store(self) -> str:
        store = self.gateway.store
        if store is None:
            return "not created"
        try:
            await store.ping(timeout_s=STORE_TIMEOUT_S)
        except TimeoutError:
            return f"unreachable: no answer in {STORE_TIMEOUT_S:g} s"
        except Exception as exc:
            return f"unreachable: {type(exc).__name__}"
        return OK

    def pools(self) -> dict[str, str]:
        """Each pool of the snapshot: OK when the gateway holds at least one of its replicas healthy."""
        gateway = self.gateway
        snapshot = gateway.snapshots.current
        if snapshot is None:
            return {}
        states: dict[str, str] = {}
        for pool in snapshot.pools.values():
            replicas = gateway.replica_set(pool)  # as the health loop does: the snapshot's replicas
            if not replicas.urls:
                states[pool.name] = "no replica"
            elif not replicas.candidates():
                states[pool.name] = "no healthy replica"
            else:
                states[pool.name] = OK
        return states

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _select_one() -> bool:
    from django.db import close_old_connections, connection

    close_old_connections()  # a connection broken by an earlier outage, or past its age, is not reused
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            row = cursor.fetchone()
        return row is not None and row[0] == 1
    finally:
        close_old_connections()
