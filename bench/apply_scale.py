"""`apply` at scale (issue 27, item 5): one tenant, one pool, N entitlements, on a fresh SQLite database.

    .venv/bin/python -m bench.apply_scale [--sizes 1000 2000 5000 10000] [--quick] [--degraded 0.1] [--write-results]

The manifest is a directory of files of 1,000 entitlements each (a file is bounded by MANIFEST_MAX_BYTES).
Per size, in a fresh process with its own throwaway database (the project's settings, `migrate` into a
temporary DATABASE_URL): the first `manage.py apply -f` of the manifest, an unchanged re-apply, `manage.py diff`
of the unchanged manifest, `diff` of a manifest with 1% of the entitlements changed (their tokens/s: a
capacity change, so binding runs again), and the apply of that manifest; then a page of the REST entitlement
list (`GET /api/v1/entitlements/`, Django's test client as a superuser, one warm-up then `--requests` times: p50/p99) and one
build of the gateway's snapshot (`apps.gateway.snapshot.snapshot_load`). `--degraded F` sizes the pool so
that the newest fraction F of the entitlements does not fit (they are applied Degraded, with a warning each).
The table goes to stdout with the growth exponent of each timing between consecutive sizes (1.0: linear);
progress to stderr; rows to bench/out/apply_scale.json; `--write-results` also rewrites the section of
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POOL = "bench-pool"
TENANT = "bench"
TITLE = "apply at scale (`make bench-apply`)"


@dataclass
class Row:
    entitlements: int
    degraded: int  # how many the manifest's pool cannot bind
    apply_s: float
    reapply_unchanged_s: float
    diff_unchanged_s: float
    diff_changed_s: float
    reapply_changed_s: float  # 1% of the entitlements changed
    # CPU seconds of the same steps (this process: Python and SQLite): what a busy shared machine disturbs less.
    apply_cpu: float
    reapply_unchanged_cpu: float
    diff_unchanged_cpu: float
    diff_changed_cpu: float
    reapply_changed_cpu: float
    list_p50_ms: float
    list_p99_ms: float
    snapshot_s: float
    # The UI's entitlement list (/entitlements/, a logged-in superuser's page), as the REST list.
    ui_list_p50_ms: float = 0.0
    ui_list_p99_ms: float = 0.0


def entitlement_doc(i: int, tokens_per_second: int = 10) -> str:
    return (f"---\napiVersion: tokenpools.io/v1alpha1\nkind: TokenEntitlement\nmetadata: {{name: ent-{i:05d}}}\n"
            f"spec:\n  tenantId: {TENANT}\n  poolRef: {{name: {POOL}}}\n"
            f"  qos: {{serviceClass: guaranteed, sloTargetMs: 500}}\n"
            f"  resources: {{tokensPerSecond: {tokens_per_second}, kvCacheGiB: 0.001, concurrency: 1}}\n")


PER_FILE = 1000  # entitlements per file: a file is bounded (MANIFEST_MAX_BYTES, 1 MiB by default)


def manifest(n: int, *, fit: int | None = None, changed: frozenset[int] = frozenset(),
             start: int = 0, stop: int | None = None) -> str:
    """One tenant, one pool with room for ``fit`` (default all ``n``) of the ``n`` guaranteed entitlements (1 slot,
    10 tokens/s, 0.001 GiB each); the entitlements in ``changed`` ask for 11 tokens/s instead of 10. ``start`` and
    ``stop`` pick a slice of the entitlements (the tenant and the pool come with the first)."""
    fit = n if fit is None else fit
    slots = max(fit, 1)
    head = (f"apiVersion: tokenpools.io/v1alpha1\nkind: Tenant\nmetadata: {{name: {TENANT}}}\n"
            f"spec: {{displayName: Bench}}\n---\n"
            f"apiVersion: tokenpools.io/v1alpha1\nkind: TokenPool\nmetadata: {{name: {POOL}}}\n"
            f"spec:\n  model: bench/model\n"
            f"  backend: {{kind: vllm, replicas: [{{url: 'http://127.0.0.1:9', enabled: true}}]}}\n"
            f"  scaling: {{minReplicas: 1, maxReplicas: 1}}\n"
            # Slots bind exactly `fit`; tokens/s and KV leave room for the changed ones' extra token/s.
            f"  capacityPerReplica: {{slots: {slots}, tokensPerSecond: {slots * 11}, kvCacheGiB: {slots * 0.002:g}}}\n"
            f"  kvGeometry: {{layers: 4, kvHeads: 4, headDim: 64, bytesPerElement: 2}}\n")
    body = "".join(entitlement_doc(i, 11 if i in changed else 10) for i in range(start, n if stop is None else stop))
    return (head if start == 0 else "") + body


def write_manifest(folder: Path, n: int, *, fit: int, changed: frozenset[int] = frozenset()) -> Path:
    """The manifest as a directory of files of ``PER_FILE`` entitlements (as a GitOps repository holds them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for number, start in enumerate(range(0, max(n, 1), PER_FILE)):
        text = manifest(n, fit=fit, changed=changed, start=start, stop=min(n, start + PER_FILE))
        (folder / f"part-{number:03d}.yaml").write_text(text.removeprefix("---\n"))
    return folder


def _call(command: str, path: Path) -> tuple[float, float, int]:
    """Run `manage.py <command> -f path` in this process; (seconds, CPU seconds, exit code)."""
    from django.core.management import call_command
    from django.core.management.base import CommandError

    start, cpu = time.perf_counter(), time.process_time()
    code = 0
    try:
        call_command(command, "-f", str(path), stdout=io.StringIO(), stderr=io.StringIO())
    except SystemExit as exc:  # diff: 1 when something would change
        code = int(exc.code or 0)
    except CommandError as exc:
        raise RuntimeError(f"{command} failed: {exc}") from exc
    return time.perf_counter() - start, time.process_time() - cpu, code


def _list_latencies(requests: int, *, ui: bool = False) -> list[float]:
    """The REST entitlement list (`ui`: the UI's page) as a superuser: one warm-up, then `requests` timed."""
    from django.contrib.auth import get_user_model
    from django.test import Client
    from rest_framework.test import APIClient

    user = get_user_model().objects.filter(username="bench-admin").first() or \
        get_user_model().objects.create_superuser("bench-admin", password="bench-admin-pass-1")
    client: Client
    if ui:
        client, path = Client(), "/entitlements/"
        client.force_login(user)
    else:
        api = APIClient()
        api.force_authenticate(user)
        client, path = api, "/api/v1/entitlements/"
    client.get(path)  # warm-up: the first request builds the URL resolver, serializers and templates
    samples = []
    for _ in range(requests):
        start = time.perf_counter()
        response = client.get(path)
        samples.append(time.perf_counter() - start)
        if response.status_code != 200:
            raise RuntimeError(f"{path} answered {response.status_code}")
    return samples


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def measure(n: int, folder: Path, *, degraded: float = 0.0, requests: int = 50) -> Row:
    """Every timing of one size against the configured (fresh) database; writes its manifests in ``folder``."""
    from apps.gateway.config import GatewayConfig
    from apps.gateway.snapshot import snapshot_load
    from apps.pools.models import EntitlementState, TokenEntitlement

    fit = n - int(n * degraded)
    base = write_manifest(folder / f"apply-{n}", n, fit=fit)
    step = 100  # 1% of them, spread over the list
    changed = write_manifest(folder / f"apply-{n}-changed", n, fit=fit, changed=frozenset(range(0, n, step)))

    def timed(what: str, command: str, path: Path, expect: int) -> tuple[float, float]:
        seconds, cpu, code = _call(command, path)
        if code != expect:
            raise RuntimeError(f"{what}: exit {code}, expected {expect}")
        print(f"  n={n} {what}: {seconds:.2f} s ({cpu:.2f} s CPU)", file=sys.stderr, flush=True)
        return round(seconds, 3), round(cpu, 3)

    apply_s = timed("apply", "apply", base, 0)
    stuck = TokenEntitlement.objects.exclude(state=EntitlementState.BOUND).count()
    if stuck != n - fit:
        raise RuntimeError(f"{stuck} entitlements not Bound, expected {n - fit}")
    reapply_s = timed("re-apply unchanged", "apply", base, 0)
    diff_s = timed("diff unchanged", "diff", base, 0)
    diff_changed_s = timed("diff 1% changed", "diff", changed, 1)
    reapply_changed_s = timed("re-apply 1% changed", "apply", changed, 0)
    samples = _list_latencies(requests)
    ui_samples = _list_latencies(requests, ui=True)
    start = time.perf_counter()
    snapshot = snapshot_load(config=GatewayConfig.from_settings())
    snapshot_s = time.perf_counter() - start
    if len(snapshot.pools[POOL].entitlements) != n:
        raise RuntimeError("the snapshot lacks entitlements")
    print(f"  n={n} list p99 {_p(samples, 0.99) * 1000:.1f} ms, UI list p99 {_p(ui_samples, 0.99) * 1000:.1f} ms, "
          f"snapshot {snapshot_s:.2f} s", file=sys.stderr)
    return Row(n, n - fit, apply_s[0], reapply_s[0], diff_s[0], diff_changed_s[0], reapply_changed_s[0],
               apply_s[1], reapply_s[1], diff_s[1], diff_changed_s[1], reapply_changed_s[1],
               round(_p(samples, 0.5) * 1000, 1), round(_p(samples, 0.99) * 1000, 1), round(snapshot_s, 3),
               round(_p(ui_samples, 0.5) * 1000, 1), round(_p(ui_samples, 0.99) * 1000, 1))


def _one(n: int, degraded: float, requests: int) -> None:
    """Worker: a fresh database in a temporary folder, migrated, then `measure`; the row as JSON on stdout."""
    with tempfile.TemporaryDirectory(prefix="apply-scale-") as folder:
        os.environ["DATABASE_URL"] = f"sqlite:///{folder}/bench.sqlite3"
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokenpools_site.settings")
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        row = measure(n, Path(folder), degraded=degraded, requests=requests)
    print(json.dumps(asdict(row)))


def exponents(rows: list[Row]) -> list[dict[str, float]]:
    """log(t2/t1) / log(n2/n1) of each timing between consecutive sizes: 1.0 is linear, 2.0 quadratic."""
    timed = [f.name for f in fields(Row) if f.name.endswith(("_s", "_cpu"))]
    out = []
    for a, b in zip(rows, rows[1:], strict=False):
        ratio = math.log(b.entitlements / a.entitlements)
        out.append({name: round(math.log(max(getattr(b, name), 1e-6) / max(getattr(a, name), 1e-6)) / ratio, 2)
                    for name in timed})
    return out


def render(rows: list[Row]) -> str:
    from bench.results import machine_description

    names = [f.name for f in fields(Row)]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(str(getattr(r, n)) for n in names) + " |" for r in rows]
    growth = exponents(rows)
    if growth:
        lines += ["", "Growth exponent between consecutive sizes (1.0 linear):", ""]
        keys = list(growth[0])
        lines += ["| sizes | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
        lines += [f"| {a.entitlements}->{b.entitlements} | " + " | ".join(str(g[k]) for k in keys) + " |"
                  for a, b, g in zip(rows, rows[1:], growth, strict=False)]
    return "\n".join(lines) + f"\n\nMachine: {machine_description()}."


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 5000, 10000])
    parser.add_argument("--quick", action="store_true", help="CI size: 100 and 200 entitlements")
    parser.add_argument("--degraded", type=float, default=0.0, help="fraction of entitlements the pool cannot bind")
    parser.add_argument("--requests", type=int, default=50, help="requests of the entitlement list per size")
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        _one(args.one, args.degraded, args.requests)
        return
    sizes = [100, 200] if args.quick else args.sizes
    rows = []
    for n in sizes:
        print(f"n={n}: fresh database", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, "-m", "bench.apply_scale", "--one", str(n), "--degraded",
                              str(args.degraded), "--requests", str(args.requests)],
                             cwd=REPO, stdout=subprocess.PIPE, text=True, check=True)
        rows.append(Row(**json.loads(out.stdout.strip().splitlines()[-1])))
    from bench.results import save_rows, write_section

    text = render(rows)
    print(text)
    print(f"rows: {save_rows('apply_scale', rows)}", file=sys.stderr)
    if args.write_results:
        write_section(TITLE, "`.venv/bin/python -m bench.apply_scale`\n\n" + text)


if __name__ == "__main__":
    main()
