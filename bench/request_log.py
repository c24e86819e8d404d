"""What the request log costs a gateway process: on the request path, `entry_of` + `RequestLog.record` a
request (timed in a loop); off it, the flush's database write a record (`request_log_write` into a fresh
SQLite database; the thread holds the process's GIL for most of it, so it is CPU the requests lose too).
Compare both with the gateway's CPU time a request (1 / its requests/s per core, `make bench-gateway`).

    python -m bench.request_log [--requests 200000] [--rows 20000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from types import SimpleNamespace
from typing import Any


def path_cost(requests: int) -> float:
    """Microseconds the request path spends recording one request."""
    from apps.gateway.context import RequestContext
    from apps.gateway.request_log import RequestLog, entry_of

    key: Any = SimpleNamespace(tenant_id=1, entitlement="bench", limits=SimpleNamespace(service_class="dedicated"))
    pool: Any = SimpleNamespace(name="bench-model")
    parsed: Any = SimpleNamespace(stream=False, max_tokens=16)
    contexts = []
    for i in range(requests):
        ctx = RequestContext({}, None, None, f"req_{i:032x}")  # type: ignore[arg-type]
        ctx.proxied, ctx.service_tier = True, "dedicated"
        ctx.served.completion_tokens, ctx.served.first_chunk_at = 2, ctx.started + 0.001
        contexts.append(ctx)
    log = RequestLog(capacity=requests)
    started = time.perf_counter()
    for ctx in contexts:
        log.record(entry_of(ctx, key, pool, parsed, 4, None))
    return (time.perf_counter() - started) / requests * 1e6


def flush_cost(rows: int) -> float:
    """Microseconds the flush spends writing one record (SQLite, one transaction of `rows`)."""
    from django.core.management import call_command

    from apps.gateway.request_log import Entry, request_log_write
    from apps.tenancy.models import Tenant

    call_command("migrate", verbosity=0)
    tenant = Tenant.objects.create(slug="bench", name="bench")
    now = time.time()
    entries = [Entry(f"req_{i:032x}", now, tenant.pk, "bench-model", "bench", "dedicated", "dedicated", False, 4,
                     16, 2, "served", "", 0.0, 1.0, 2.0) for i in range(rows)]
    started = time.perf_counter()
    request_log_write(entries)
    return (time.perf_counter() - started) / rows * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--rows", type=int, default=20_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tokenpools-reqlog-") as tmp:
        os.environ["DATABASE_URL"] = f"sqlite:///{tmp}/bench.sqlite3"
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokenpools_site.settings")
        import django

        django.setup()
        on_path = path_cost(args.requests)
        flushed = flush_cost(args.rows)
    print(f"request path: {on_path:.2f} us a request ({args.requests} records)")
    print(f"flush (SQLite): {flushed:.2f} us a record ({args.rows} records in one write)")
    print(f"together: {on_path + flushed:.2f} us a request; at 1,000 requests/s {(on_path + flushed) / 10:.2f}% "
          "of one core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
