"""The request log (issue 26): every request the gateway decides, recorded off the request path.

A request that reached admission (its key, pool and prompt known) leaves one `Entry` when it ends, whatever
the end: served, refused (at the offer, after its wait ran out, or shed by an inference gateway upstream), an
error, a client gone, a preemption, a backend timeout. The request path only appends a tuple to a bounded
buffer (`RequestLog.record`, a few microseconds); what writes it to `RequestLogRecord` runs in the background:

- in-process store: the buffer goes to the database every `GATEWAY_USAGE_FLUSH_S` (one bulk INSERT in a
  worker thread). A process killed outright (SIGKILL) loses what it recorded since its last flush (at most
  `GATEWAY_USAGE_FLUSH_S`, default 2 s), as it loses that much usage.
- Redis store: the buffer goes to a Redis list every `PUSH_S` (one RPUSH of the batch), and the
  `request_log_drain` tick (Celery, `run_ticks`, or the embedded server's ticker: not the gateway's event loop)
  drains that list into the database, one runner at a time (a lock in Redis), trimming the list only after the
  rows are written; a flush that dies midway leaves them in the list for the next one (rows are unique by
  request id: written twice is written once). A stopping gateway pushes and drains once more, waiting for a
  drain that runs now (it read the list before that push). A SIGKILL loses at most the last `PUSH_S` (1 s) of
  this process's records; what reached Redis is kept as Redis keeps its data.

Either way a database that is away keeps the records for the next flush (in the buffer, bounded by
`BUFFER_CAPACITY`: past it the oldest go and are counted in `dropped`; or in the Redis list). Requests still
in flight at a SIGKILL are not recorded (nor is their usage). With `GATEWAY_REQUEST_LOG_DAYS=0` the gateway
has no request log at all: nothing is recorded and the request path does not look.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import datetime as dt
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, NamedTuple

from apps.gateway.background_thread import background_executor
from apps.gateway.context import ClientGone, RequestContext
from apps.gateway.errors import GatewayError

if TYPE_CHECKING:
    from apps.gateway.parse import ParsedRequest
    from apps.gateway.snapshot import KeyEntry, PoolInfo

logger = logging.getLogger(__name__)

# Records held in the process at most (past it, the oldest are dropped and counted): ~25 MB.
BUFFER_CAPACITY = 100_000
# With Redis, how often this process's records go to the shared list (what a SIGKILL can lose).
PUSH_S = 1.0
# Records written to the database per batch, and batches per flush (the rest waits for the next flush).
BATCH = 2_000
BATCHES_PER_FLUSH = 50
# How long a flush may hold the drain lock before another process may take over.
DRAIN_LEASE_MS = 60_000
# How long a stopping gateway's flush waits for a drain that holds the lock now (a tick's, mid-batch: it read
# the list before this process's last push, so it would leave those records there); past it they stay in the
# list for the next `request_log_drain` tick.
FLUSH_WAIT_S = 10.0
LOCK_POLL_S = 0.05

# Trim the list by what was written, only while the lock is still this flush's (else another took over and
# trims itself); and give the lock back.
_TRIM = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('LTRIM', KEYS[1], tonumber(ARGV[2]), -1)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


class Entry(NamedTuple):
    """One request as the request path leaves it (a tuple: nothing built that the flush can build)."""

    request_id: str
    arrived: float  # epoch seconds
    tenant_id: int
    pool: str
    entitlement: str
    service_class: str
    service_tier: str
    stream: bool
    prompt_tokens: int
    max_tokens: int | None
    completion_tokens: int
    outcome: str
    reason: str
    queue_ms: float
    ttft_ms: float | None
    duration_ms: float


def outcome_of(ctx: RequestContext, exc: BaseException | None) -> tuple[str, str]:
    """(outcome, reason) of a request that ended with `exc` (None: it ran to its end)."""
    if exc is None:
        if ctx.served.broken:  # mid-stream
            return ("timeout" if "Timeout" in ctx.served.broken else "error"), "upstream_error"
        if ctx.status >= 400:
            return "error", f"upstream_status_{ctx.status}"
        return "served", ""
    if isinstance(exc, GatewayError):
        if exc.status in (400, 429):  # admission's refusals, a wait run out, a shed upstream
            return "rejected", exc.code
        if exc.status == 502 and "Timeout" in exc.message:  # httpx's ReadTimeout, ConnectTimeout, ...
            return "timeout", exc.code
        return "error", exc.code
    if ctx.preempted:
        return "preempted", "preempted"
    if ctx.disconnected or isinstance(exc, ClientGone):
        return "cancelled", "client_disconnected"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", "shutdown"
    return "error", "internal_error"


def entry_of(ctx: RequestContext, key: KeyEntry, pool: PoolInfo, parsed: ParsedRequest, input_tokens: int,
             exc: BaseException | None) -> Entry:
    outcome, reason = outcome_of(ctx, exc)
    now = time.perf_counter()
    served = ctx.served
    _, completion = served.counts(input_tokens)
    first = served.first_chunk_at
    return Entry(
        ctx.request_id, time.time() - (now - ctx.started), key.tenant_id, pool.name, key.entitlement,
        str(key.limits.service_class), ctx.service_tier if ctx.proxied else "", parsed.stream, input_tokens,
        parsed.max_tokens, completion, outcome, reason, ctx.queue_ms,
        None if first is None else (first - ctx.started) * 1000.0, (now - ctx.started) * 1000.0,
    )


class RequestLog:
    """The process's buffer of records and its way to the database (directly, or through a Redis list)."""

    def __init__(self, *, capacity: int = BUFFER_CAPACITY) -> None:
        self.buffer: collections.deque[Entry] = collections.deque(maxlen=capacity)
        self.dropped = 0
        self.redis: Any = None
        self.list_key = ""
        self.lock_key = ""
        # The encoding and the database writes: a thread of its own, at a lower priority than the event loop's
        # (`apps.gateway.background_thread`), started on the first flush.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            self._executor = background_executor("gw-request-log")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Let the thread go (after the last flush)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def attach(self, redis: Any, prefix: str) -> None:
        """Go through this Redis (the state store's client) from now on; its two keys share a hash slot."""
        self.redis = redis
        self.list_key = f"{prefix}{{reqlog}}:list"
        self.lock_key = f"{prefix}{{reqlog}}:lock"

    def record(self, entry: Entry) -> None:
        if len(self.buffer) == self.buffer.maxlen:
            self.dropped += 1
        self.buffer.append(entry)

    def _take(self) -> list[Entry]:
        taken = list(self.buffer)
        self.buffer.clear()
        return taken

    def _put_back(self, entries: list[Entry]) -> None:
        """Entries a write failed to take, back in front of what came since (the oldest dropped past capacity)."""
        newer = self._take()
        for entry in [*entries, *newer]:
            self.record(entry)

    async def push(self) -> int:
        """With Redis: this process's records to the shared list (one RPUSH); returns how many."""
        if self.redis is None or not self.buffer:
            return 0
        entries = self._take()
        try:
            # Encoded in the thread: ~6 us a record, a pause of the event loop the size of a second's records
            # otherwise (the switch interval lets the loop back in within 1 ms: `favour_the_event_loop`).
            await self.redis.rpush(self.list_key, *await self._in_thread(_encoded, entries))
        except BaseException:
            self._put_back(entries)
            raise
        return len(entries)

    async def flush(self) -> int:
        """Records to the database (with Redis: pushed, then the shared list drained); returns rows written."""
        if self.redis is not None:
            await self.push()
            return await self.drain(wait_s=FLUSH_WAIT_S)
        if not self.buffer:
            return 0
        entries = self._take()
        try:
            return await self._in_thread(_write_in_thread, entries)
        except BaseException:
            self._put_back(entries)
            raise

    async def drain(self, *, close_connections: bool = False, wait_s: float = 0.0) -> int:
        """With Redis: the shared list (every process's pushed records) to the database, in batches, by one
        flush at a time (a lock in Redis); returns rows written (0 when another process drains now and does not
        end within `wait_s`). `close_connections`: the worker threads close their database connections after
        each write (a tick's event loop and its threads last one run: nothing would reuse them)."""
        token = uuid.uuid4().hex
        if not await self._lock(token, wait_s):
            if wait_s > 0:
                logger.warning("request log: another drain held the lock for %.0f s; the records pushed stay in "
                               "Redis (%s) for the next request_log_drain tick", wait_s, self.list_key)
            return 0
        written = 0
        try:
            for _ in range(BATCHES_PER_FLUSH):
                raw = await self.redis.lrange(self.list_key, 0, BATCH - 1)
                if not raw:
                    break
                written += await self._in_thread(_write_encoded_in_thread, raw,  # decoded there (`push`)
                                                 close_connections)
                if not await self.redis.eval(_TRIM, 2, self.list_key, self.lock_key, token, len(raw),
                                             DRAIN_LEASE_MS):
                    break  # the lock ran out and another flush took over: it trims what it writes
                if len(raw) < BATCH:
                    break
        finally:
            await self.redis.eval(_UNLOCK, 1, self.lock_key, token)
        return written

    async def _lock(self, token: str, wait_s: float) -> bool:
        """The drain lock, polled for up to `wait_s` while another drain holds it."""
        deadline = time.monotonic() + wait_s
        while not await self.redis.set(self.lock_key, token, nx=True, px=DRAIN_LEASE_MS):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(LOCK_POLL_S)
        return True


_COLUMNS = ("request_id", "arrived_at", "tenant_id", "pool", "entitlement", "service_class", "service_tier", "stream",
            "prompt_tokens", "max_tokens", "completion_tokens", "outcome", "reason", "queue_ms", "ttft_ms",
            "duration_ms")


def _encoded(entries: list[Entry]) -> list[str]:
    return [json.dumps(entry) for entry in entries]


def _write_in_thread(entries: list[Entry]) -> int:
    from django.db import close_old_connections

    close_old_connections()  # a worker thread's connection the database may have closed meanwhile
    return request_log_write(entries)


def _write_encoded_in_thread(encoded: list[str], close_connections: bool = False) -> int:
    """Records as the Redis list holds them (`_encoded`) to the database, decoded in the worker thread."""
    try:
        return _write_in_thread([Entry(*json.loads(item)) for item in encoded])
    finally:
        if close_connections:
            from django.db import connections

            connections.close_all()  # this thread's own


def request_log_write(entries: list[Entry]) -> int:
    """Write records (a worker thread) in one transaction; one already there (by request id) is left as it is.

    One prepared INSERT run for every row (`executemany`), not the ORM's `bulk_create`: building a model and
    preparing its 16 fields took about 6 times the CPU a row (measured 2026-11-26: ~370 against ~60 us on a
    loaded 2-core machine), CPU this process's requests lose (the GIL); `python -m bench.request_log`."""
    from django.db import connection, transaction

    from apps.gateway.models import RequestLogRecord

    quote = connection.ops.quote_name
    adapt = connection.ops.adapt_datetimefield_value
    utc = dt.UTC
    sql = (f"INSERT INTO {quote(RequestLogRecord._meta.db_table)} ({', '.join(quote(c) for c in _COLUMNS)}) "
           f"VALUES ({', '.join(['%s'] * len(_COLUMNS))}) ON CONFLICT ({quote('request_id')}) DO NOTHING")
    rows = [
        # Naive UTC (what the database connection's time zone is): the adapter skips its conversion.
        (e.request_id, adapt(dt.datetime.fromtimestamp(round(e.arrived, 3), tz=utc).replace(tzinfo=None)), e.tenant_id, e.pool,
         e.entitlement, e.service_class, e.service_tier, e.stream, max(0, e.prompt_tokens), e.max_tokens,
         max(0, e.completion_tokens), e.outcome, e.reason[:64], round(e.queue_ms, 3),
         None if e.ttft_ms is None else round(e.ttft_ms, 3), round(e.duration_ms, 3))
        for e in entries
    ]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.executemany(sql, rows)
    return len(rows)


def request_log_prune(*, days: int, now: dt.datetime | None = None) -> int:
    """Delete records older than `days` days (all of them when 0: the log is off); returns how many."""
    from apps.gateway.models import RequestLogRecord

    records = RequestLogRecord.objects.all()
    if days > 0:
        records = records.filter(arrived_at__lt=(now or dt.datetime.now(tz=dt.UTC)) - dt.timedelta(days=days))
    deleted, _ = records.delete()
    return deleted
