"""Scale-out figures: 1, 2 and 4 gateway processes (`manage.py serve --workers N`) on one Redis and on a
real Redis Cluster (3 primaries, 3 replicas), in front of the instant nginx upstream of `bench.gateway`.

    python -m bench.scale_out [--duration 6] [--rounds 3] [--workers 1 2 4] [--concurrency 64] [--paced-rate 200]
                              [--gateway-cores 0] [--write-results]

Three pools whose hash tags fall on the three primaries (the same pools on one Redis), one roomy dedicated
entitlement each; wrk cycles its requests over the three (model, key) pairs. Per row:
- requests/s of a closed loop at `--concurrency` streams, and the added p50/p99 (over the upstream direct)
  of `bench.gateway`'s paced load: 32 streams together offering `--paced-rate` requests/s (Poisson);
- Redis calls per request: INFO commandstats on every primary before and after each measurement (all
  commands but our own INFO), divided by the requests wrk completed; with the commands' own time
  (usec of the commands the gateway sent, an FCALL's including what it ran: the Redis thread's time) per
  request;
- CPU per request of the gateway processes (/proc utime+stime of the serve process group) and of the
  store's Redis processes (INFO cpu), over the closed loop: what a capacity plan divides a core by.

The gateway processes share the cores of `--gateway-cores` (default core 0, as `bench.gateway` pins its one
process); nginx, Redis and wrk run on core 1. On a 2-core machine the processes compete for those cores,
so requests/s does not grow with processes here: the per-request costs are the figures that carry over.
Celery's and the channel layer's Redis (`REDIS_URL`) is a separate server, not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path

import httpx
import redis

from bench.gateway import (
    CHAT_BODY,
    LOADGEN_CORE,
    PACED_STREAMS,
    _pinned,
    _to_ms,
    nginx_upstream,
    pin_pids,
    pin_redis,
)
from bench.results import machine_description, save_rows, write_section
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.redis_cluster import LocalRedisCluster, running_redis_cluster, slot_of
from tests.support.services import running_redis
from tests.support.site import PreparedSite, prepare_site, serving

REPO = Path(__file__).resolve().parents[1]
# `redis-cli --cluster create` with 3 primaries splits the slots in these thirds.
THIRDS = ((0, 5460), (5461, 10922), (10923, 16383))


@dataclass
class Row:
    store: str
    workers: int
    requests_per_s: float  # closed loop
    added_p50_ms: float  # paced
    added_p99_ms: float
    calls_per_request: float  # every command on the store's primaries (closed loop), those inside functions too
    round_trips_per_request: float  # the commands a client sent (FCALL, HELLO, ...): not those inside functions
    fcalls_per_request: float
    redis_usec_per_request: float  # commands' own time on the Redis threads, summed over primaries
    redis_cpu_ms_per_request: float  # the Redis processes' CPU (INFO cpu), summed over primaries
    gateway_cpu_ms_per_request: float  # the gateway processes' CPU, all of them
    non_2xx: int
    errors: int
    commands: dict[str, float]  # calls per request by command (closed loop)


def bench_pools() -> list[str]:
    """One pool name per third of the slots, so on the cluster each primary serves one pool."""
    names: list[str] = []
    index = 0
    for low, high in THIRDS:
        while not low <= slot_of(f"tp:gw:{{pool{index}}}:pool") <= high:
            index += 1
        names.append(f"pool{index}")
        index += 1
    return names


def prepare_scale_site(workdir: Path, upstream: str, pools: list[str]) -> PreparedSite:
    manifest = documents(
        *(tiny_pool(pool, upstream, slots=100_000, tokens_per_second=1_000_000_000, kv_cache_gib=100_000)
          for pool in pools),
        *(entitlement(f"ent-{pool}", tenant="bench", pool=pool, service_class="dedicated", concurrency=50_000,
                      tokens_per_second=100_000_000, kv_cache_gib=1000, slo_target_ms=1000) for pool in pools))
    env = {"REDIS_URL": "", "GATEWAY_STATE_BACKEND": "memory", "PYTHONPATH": str(REPO)}
    return prepare_site(workdir, tenants=["bench"], manifest=manifest, key_for=[f"ent-{p}" for p in pools],
                        env=env, database="site-scale.sqlite3")


def _check_ok(url: str, key: str, model: str) -> None:
    """One chat completion through the gateway before measuring (its first answer may take a moment)."""
    last = ""
    for _ in range(60):
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT_BODY, "model": model},
                           headers={"Authorization": f"Bearer {key}"}, timeout=10)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not serve {model}: {last}")


def wrk_script(workdir: Path, pairs: list[tuple[str, str]], delay_ms: float | None) -> Path:
    """wrk's Lua: requests cycle over the (model, key) pairs; with `delay_ms`, exponential think times."""
    entries = ",\n".join(
        f'  {{{json.dumps("Bearer " + key)}, {json.dumps(json.dumps({**CHAT_BODY, "model": model}))}}}'
        for model, key in pairs)
    script = workdir / ("paced.lua" if delay_ms else "closed.lua")
    script.write_text(
        f"local targets = {{\n{entries}\n}}\nlocal i = 0\n"
        "function request()\n  i = i % #targets + 1\n"
        '  return wrk.format("POST", nil, {["Content-Type"] = "application/json", '
        '["Authorization"] = targets[i][1]}, targets[i][2])\nend\n'
        + ("" if delay_ms is None else
           "math.randomseed(os.time())\n"
           f"function delay()\n  return -math.log(1 - math.random()) * {delay_ms:.3f}\nend\n"))
    return script


@dataclass
class WrkResult:
    requests: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    errors: int


def run_wrk(url: str, script: Path, streams: int, duration_s: int) -> WrkResult:
    cmd = _pinned(LOADGEN_CORE, ["wrk", "-t1", f"-c{streams}", f"-d{duration_s}s", "--latency", "--timeout", "10s",
                                 "-s", str(script), url])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    found = {name: re.search(pattern, out, re.M) for name, pattern in (
        ("p50", r"^\s+50%\s+(\S+)"), ("p99", r"^\s+99%\s+(\S+)"), ("rps", r"Requests/sec:\s+([\d.]+)"),
        ("count", r"(\d+) requests in"), ("non2xx", r"Non-2xx or 3xx responses:\s+(\d+)"),
        ("errors", r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)"))}
    if not all(found[k] for k in ("p50", "p99", "rps", "count")):
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    return WrkResult(int(found["count"].group(1)), float(found["rps"].group(1)),  # type: ignore[union-attr]
                     _to_ms(found["p50"].group(1)), _to_ms(found["p99"].group(1)),  # type: ignore[union-attr]
                     int(found["non2xx"].group(1)) if found["non2xx"] else 0,
                     sum(map(int, found["errors"].groups())) if found["errors"] else 0)


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of a process group: `serve` and its workers."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ... utime(11) stime(12)
                total += int(fields[11]) + int(fields[12])
    return total / tick


@dataclass
class RedisSnapshot:
    calls: dict[str, int]
    usec: float
    cpu_s: float


def redis_snapshot(ports: list[int]) -> RedisSnapshot:
    calls: dict[str, int] = {}
    usec = cpu = 0.0
    for port in ports:
        client = redis.Redis(port=port)
        try:
            stats = client.info("commandstats")
            used = client.info("cpu")
        finally:
            client.close()
        for name, stat in stats.items():
            command = name.removeprefix("cmdstat_")
            if command == "info":
                continue  # ours
            calls[command] = calls.get(command, 0) + int(stat["calls"])
            if command not in INNER:  # an FCALL's time includes the commands it ran: count those once
                usec += float(stat["usec"])
        cpu += float(used["used_cpu_user"]) + float(used["used_cpu_sys"])
    return RedisSnapshot(calls, usec, cpu)


def script_commands() -> set[str]:
    """The commands the store's Lua functions call (commandstats counts them with the client's own), plus the
    replicas' REPLCONF acknowledgements: what is not a client's round trip."""
    found = {"replconf"}
    for path in (REPO / "apps" / "gateway" / "lua").glob("*.lua"):
        found |= {m.lower() for m in re.findall(r"redis\.p?call\(\s*['\"](\w+)", path.read_text(), re.I)}
    return found


INNER = script_commands()


@dataclass
class Target:
    store: str
    url: str
    pairs: list[tuple[str, str]]
    redis_ports: list[int]  # the store's primaries
    pgid: int


def measure(target: Target, workers: int, args: argparse.Namespace, workdir: Path, direct: WrkResult) -> Row:
    """`--rounds` rounds of the closed loop then the paced load on one running site; each figure the median."""
    for model, key in target.pairs:
        _check_ok(target.url, key, model)
    closed = wrk_script(workdir, target.pairs, None)
    run_wrk(f"{target.url}/v1/chat/completions", closed, 8, 2)  # warm-up: every worker's connections, lazy imports
    rounds = [measure_round(target, workers, args, workdir, direct) for _ in range(args.rounds)]
    medians = {f.name: statistics.median(getattr(r, f.name) for r in rounds) for f in fields(Row)[2:-3]}
    row = replace(rounds[len(rounds) // 2], **medians, non_2xx=sum(r.non_2xx for r in rounds),
                  errors=sum(r.errors for r in rounds))
    if args.rounds > 1:
        print(f"  median of {args.rounds}: {row}", file=sys.stderr)
    return row


def measure_round(target: Target, workers: int, args: argparse.Namespace, workdir: Path, direct: WrkResult) -> Row:
    chat = f"{target.url}/v1/chat/completions"
    closed, paced = wrk_script(workdir, target.pairs, None), wrk_script(
        workdir, target.pairs, PACED_STREAMS / args.paced_rate * 1000)
    before, cpu_before = redis_snapshot(target.redis_ports), group_cpu_s(target.pgid)
    loop = run_wrk(chat, closed, args.concurrency, args.duration)
    after, cpu_after = redis_snapshot(target.redis_ports), group_cpu_s(target.pgid)
    pace = run_wrk(chat, paced, PACED_STREAMS, args.duration)
    n = max(loop.requests, 1)
    commands = {c: (after.calls.get(c, 0) - before.calls.get(c, 0)) / n for c in after.calls}
    commands = {c: v for c, v in sorted(commands.items(), key=lambda kv: -kv[1]) if v > 0}
    row = Row(target.store, workers, loop.requests_per_s, pace.p50_ms - direct.p50_ms, pace.p99_ms - direct.p99_ms,
              sum(commands.values()), sum(v for c, v in commands.items() if c not in INNER),
              commands.get("fcall", 0.0), (after.usec - before.usec) / n,
              (after.cpu_s - before.cpu_s) * 1000 / n, (cpu_after - cpu_before) * 1000 / n,
              loop.non_2xx + pace.non_2xx, loop.errors + pace.errors, commands)
    print(f"  {row.store:<13} workers={workers}  {row.requests_per_s:6.0f} req/s  added p50 {row.added_p50_ms:5.2f} "
          f"p99 {row.added_p99_ms:6.2f} ms  calls/req {row.calls_per_request:.2f} round trips/req "
          f"{row.round_trips_per_request:.2f}  redis "
          f"{row.redis_usec_per_request:.0f} us/req  gateway cpu {row.gateway_cpu_ms_per_request:.2f} ms/req"
          f"  non-2xx {row.non_2xx} errors {row.errors}", file=sys.stderr)
    return row


@contextlib.contextmanager
def store(kind: str, site: PreparedSite, workers: int, args: argparse.Namespace) -> Iterator[Target]:
    """The site served by `workers` processes with its state on one Redis or on a Redis Cluster."""
    with contextlib.ExitStack() as stack:
        aux = stack.enter_context(running_redis())  # Celery and the channel layer: not measured
        env = {"REDIS_URL": aux, "GATEWAY_STATE_BACKEND": "redis", "TOKENPOOLS_TICKS": "off"}
        if kind == "one Redis":
            state_url = stack.enter_context(running_redis())
            ports = [int(state_url.rsplit(":", 1)[1].split("/")[0])]
            pin_redis(state_url, LOADGEN_CORE)  # away from the gateway processes
            env["GATEWAY_REDIS_URL"] = state_url
        else:
            cluster: LocalRedisCluster = stack.enter_context(running_redis_cluster())
            pin_pids([p.pid for p in cluster.procs.values()], LOADGEN_CORE)
            ports = sorted(cluster.primaries())
            owners = {cluster.owner(slot_of(f"tp:gw:{{{pool}}}:pool")) for pool in site_pools(site)}
            if len(owners) != len(ports):
                print(f"  warning: the pools fall on {len(owners)} of {len(ports)} primaries", file=sys.stderr)
            env |= {"GATEWAY_REDIS_URL": cluster.url, "GATEWAY_REDIS_CLUSTER": "true"}
        url, proc = stack.enter_context(serving(site, env=env, workers=workers, cpu_core=args.gateway_cores,
                                                log_name=f"serve-{kind.replace(' ', '-')}-{workers}.log"))
        pairs = [(pool, site.keys[f"ent-{pool}"]) for pool in site_pools(site)]
        yield Target(kind, url, pairs, ports, proc.pid)


def site_pools(site: PreparedSite) -> list[str]:
    return sorted(name.removeprefix("ent-") for name in site.keys)


def report(rows: list[Row], direct: WrkResult, args: argparse.Namespace, argv: list[str]) -> str:
    lines = [
        f"Command: `{' '.join(['python -m bench.scale_out', *argv])}`  ",
        f"Machine: {machine_description()}; gateway processes share core(s) {args.gateway_cores}, nginx + Redis "
        "+ wrk on core 1, so more processes compete for the same core(s)  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Three pools, one per cluster primary (the same three on one Redis), requests cycled over them. req/s: "
        f"closed loop at {args.concurrency} streams, {args.duration} s, median of {args.rounds} round(s). Added p50/p99: {PACED_STREAMS} streams "
        f"paced at {args.paced_rate:g} req/s, minus nginx direct (p50 {direct.p50_ms:.2f} ms, p99 "
        f"{direct.p99_ms:.2f} ms). Redis calls, command time (usec of the commands the gateway sent, "
        "wall time on the Redis thread) and Redis CPU: every primary's INFO commandstats / INFO cpu around the closed "
        "loop, per request. Gateway CPU: all serve processes; cores busy = req/s x gateway CPU per request.",
        "",
        "| store | gateway processes | req/s | added p50 ms | added p99 ms | Redis calls/req | round trips/req "
        "(FCALL) | Redis command us/req | Redis CPU ms/req | gateway CPU ms/req | gateway cores busy | non-2xx | socket errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.store} | {r.workers} | {r.requests_per_s:.0f} | {r.added_p50_ms:.2f} | {r.added_p99_ms:.2f} "
            f"| {r.calls_per_request:.1f} | {r.round_trips_per_request:.2f} ({r.fcalls_per_request:.2f}) "
            f"| {r.redis_usec_per_request:.0f} "
            f"| {r.redis_cpu_ms_per_request:.3f} | {r.gateway_cpu_ms_per_request:.2f} "
            f"| {r.requests_per_s * r.gateway_cpu_ms_per_request / 1000:.2f} | {r.non_2xx} | {r.errors} |")
    lines += ["", "Redis calls counts the commands run inside the functions too (INFO commandstats does); round "
              "trips are the commands the gateway sent. Calls per request by command (0.01 and above): " + "; ".join(
                  f"{r.store} x{r.workers}: " + ", ".join(f"{c} {v:.2f}" for c, v in r.commands.items() if v >= 0.005)
                  for r in rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=6, help="seconds per measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="gateway processes per row")
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop streams")
    parser.add_argument("--paced-rate", type=float, default=200.0, help=f"requests/s of the {PACED_STREAMS} paced streams")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per row (figures: their median)")
    parser.add_argument("--gateway-cores", default="0", help="taskset core list of the gateway processes")
    parser.add_argument("--stores", nargs="+", default=["one Redis", "Redis Cluster"],
                        choices=["one Redis", "Redis Cluster"])
    parser.add_argument("--write-results", action="store_true", help="rewrite the section in bench/RESULTS.md")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="tokenpools-scale-") as tmp, nginx_upstream(Path(tmp)) as upstream:
        workdir = Path(tmp)
        direct_script = wrk_script(workdir, [("bench-model", "unused")], PACED_STREAMS / args.paced_rate * 1000)
        direct = run_wrk(f"{upstream}/v1/chat/completions", direct_script, PACED_STREAMS, args.duration)
        print(f"direct (paced {args.paced_rate:g}/s): p50 {direct.p50_ms:.2f} ms p99 {direct.p99_ms:.2f} ms",
              file=sys.stderr)
        site = prepare_scale_site(workdir, upstream, bench_pools())
        for kind in args.stores:
            for workers in args.workers:
                with store(kind, site, workers, args) as target:
                    rows.append(measure(target, workers, args, workdir, direct))
    text = report(rows, direct, args, argv)
    print(text)
    save_rows("scale_out", rows)
    if args.write_results:
        write_section("Gateway scale-out (`make bench-scale-out`)", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
