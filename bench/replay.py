"""How fast `manage.py replay` replays a recorded window (issue 26): N synthetic records (three entitlements of a
2-replica, 16-slot pool, Poisson arrivals, lognormal lengths) written through the request log's own write path
into a fresh SQLite database, then replayed under the current entitlements and under a proposed manifest that
halves the guaranteed entitlement's concurrency. Prints the simulator's records/s (replayed requests over the
simulation's wall time, both columns) and the whole command's (reading the records and applying the manifest
in its rolled-back transaction included).

    python -m bench.replay [--records 20000] [--rate 15]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import tempfile
import time
from pathlib import Path

from tests.support.manifests import documents, entitlement

START = 1_790_000_000.0  # 2026-09-21: any instant; the window is given as ISO times

POOL = """
apiVersion: tokenpools.io/v1alpha1
kind: Tenant
metadata: {name: bench}
spec: {displayName: Bench}
---
apiVersion: tokenpools.io/v1alpha1
kind: TokenPool
metadata: {name: bench-pool}
spec:
  model: bench/model
  backend: {kind: vllm, replicas: [{url: "http://127.0.0.1:9001"}, {url: "http://127.0.0.1:9002"}]}
  scaling: {minReplicas: 1, maxReplicas: 4}
  capacityPerReplica: {slots: 16, tokensPerSecond: 20000, kvCacheGiB: 20}
  kvGeometry: {layers: 36, kvHeads: 8, headDim: 128, bytesPerElement: 2}
"""


def manifest(guaranteed: int) -> str:
    """The pool and its three entitlements, the guaranteed one of concurrency `guaranteed`."""
    return documents(
        POOL,
        entitlement("bench-guaranteed", tenant="bench", pool="bench-pool", service_class="guaranteed",
                    slo_target_ms=1000, tokens_per_second=12000, kv_cache_gib=4, concurrency=guaranteed),
        entitlement("bench-elastic", tenant="bench", pool="bench-pool", service_class="elastic",
                    slo_target_ms=2000, tokens_per_second=8000, kv_cache_gib=4, concurrency=12),
        entitlement("bench-spot", tenant="bench", pool="bench-pool", service_class="spot",
                    slo_target_ms=5000, tokens_per_second=4000, kv_cache_gib=2, concurrency=8),
    )


def write_records(count: int, rate: float, tenant_id: int) -> float:
    """`count` records at `rate` requests/s; returns the window's length in seconds."""
    from apps.gateway.request_log import Entry, request_log_write

    rng = random.Random(7)
    names = ("bench-guaranteed", "bench-elastic", "bench-spot")
    classes = ("guaranteed", "elastic", "spot")
    at = 0.0
    entries = []
    for index in range(count):
        at += rng.expovariate(rate)
        which = rng.choices((0, 1, 2), weights=(5, 3, 2))[0]
        prompt = max(8, round(rng.lognormvariate(5.5, 0.6)))
        completion = max(2, round(rng.lognormvariate(4.5, 0.5)))
        refused = rng.random() < 0.05
        ttft = 20 + prompt * 0.05
        entries.append(Entry(
            f"req_{index:032x}", START + at, tenant_id, "bench-pool", names[which], classes[which],
            "" if refused else classes[which], True, prompt, 256, 0 if refused else completion,
            "rejected" if refused else "served", "concurrency_limit_exceeded" if refused else "", 0.0,
            None if refused else ttft, 1.0 if refused else ttft + (completion - 1) * 15.0))
    for offset in range(0, len(entries), 5000):
        request_log_write(entries[offset:offset + 5000])
    return at + 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=15.0, help="recorded requests/s")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tokenpools-replay-") as tmp:
        os.environ["DATABASE_URL"] = f"sqlite:///{tmp}/bench.sqlite3"
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokenpools_site.settings")
        import django

        django.setup()
        import datetime as dt

        from django.core.management import call_command

        from apps.pools.manifests import manifests_apply
        from apps.tenancy.models import Tenant
        from apps.tenancy.services import SYSTEM

        call_command("migrate", verbosity=0)
        manifests_apply(actor=SYSTEM, documents=manifest(16))
        length = write_records(args.records, args.rate, Tenant.objects.get(slug="bench").pk)
        proposed = Path(tmp) / "proposed.yaml"
        proposed.write_text(manifest(8))
        since = dt.datetime.fromtimestamp(START, dt.UTC).isoformat()
        until = dt.datetime.fromtimestamp(START + length, dt.UTC).isoformat()
        out = io.StringIO()
        started = time.perf_counter()
        call_command("replay", "--since", since, "--until", until, "-f", str(proposed), "--format", "json",
                     "--progress", "off", stdout=out)
        whole = time.perf_counter() - started
    window = json.loads(out.getvalue())["window"]
    print(f"window: {window['records']} records over {length:.0f} s at {args.rate:g} requests/s, 3 entitlements")
    print(f"simulator: {window['replayed_requests']} requests replayed (current + proposed) in "
          f"{window['wall_seconds']:.2f} s: {window['records_per_second']:,} records/s")
    print(f"whole command (read, apply rolled back, two replays, report): {whole:.2f} s: "
          f"{window['replayed_requests'] / whole:,.0f} records/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
