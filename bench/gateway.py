"""Gateway overhead: direct to an instant upstream, through tokenpools (in-process and Redis state) and
through LiteLLM's proxy, measured with wrk in one run.

    python -m bench.gateway [--duration 10] [--concurrency 1 32 256] [--paced-rate 50 500] [--no-litellm]
                            [--request-log on|off|both] [--stores memory redis] [--redis-core 1 0 any]
                            [--redis-socket tcp unix] [--neighbours paused|running]
                            [--ticks own-process|gateway|both]
                            [--cpu-idle halt|poll]
                            [--write-results]

The upstream is nginx answering every OpenAI call with a fixed body (it is what the proxies are measured
around, and it must not be the bottleneck). The proxy under test is pinned to core 0; nginx, Redis and
wrk share core 1 (until 2026-11-27 Redis was left unpinned, wherever the scheduler put it), so "requests/s" is
per gateway process on one core. With the Redis store the periodic ticks run in a `run_ticks` process on core 1
too, at the lowest priority (nice 19), as a Celery worker runs them beside a deployment's gateways, on machines of
its own (`--ticks gateway`: in the gateway's process). Gateways measured side by side (a baseline commit, extra
entitlements, several places for Redis) take turns; the others are stopped meanwhile (`--neighbours paused`).

Two kinds of measurement per target:
- closed loop (wrk's default): every stream sends its next request as soon as the last one is answered.
  This gives the maximum sustained requests/s; its latency is mostly queueing (Little's law: at 32 streams
  and X req/s a request waits 32/X s whatever the per-request cost is).
- paced (`--paced-rate`): 32 streams whose requests together arrive as a Poisson process of a fixed rate
  (each connection waits an exponential time of mean 32/rate s before its next request). Below a target's capacity this gives the latency the proxy adds to
  each request while 32 streams are open and the process is not saturated; the lowest default rate (50/s)
  is below LiteLLM's capacity too, so the two are compared there.

The request log (issue 26) costs what it costs on the request path: with `--request-log both` (the default)
every store runs two servers of the same site side by side, the log on (`GATEWAY_REQUEST_LOG_DAYS=7`) and off
(`=0`, label `, log off`), measured in alternation (`measure_alternating`); the report adds their ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from bench.baseline import source_tree
from bench.cpu_idle import MODES, IdleStatesUnavailable, idle_states
from bench.otlp_sink import OtlpSink
from bench.results import machine_description, save_rows, write_section
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.services import free_port, running_redis, stop_process_group, wait_for_port
from tests.support.site import PreparedSite, prepare_site, running_ticks, serving

REPO = Path(__file__).resolve().parents[1]
LITELLM = REPO / "var" / "litellm-venv" / "bin" / "litellm"
MODEL = "bench-model"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
UPSTREAM_CHAT = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1,
    "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
}
LITELLM_MASTER_KEY = "sk-bench-" + secrets.token_hex(16)
SERVER_CORE = "0"
OTEL_SUFFIX = " +otel"
LOADGEN_CORE = "1"


PACED_STREAMS = 32


@dataclass
class Measurement:
    target: str
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    errors: int
    paced_rate: float | None = None  # offered requests/s of a paced run; None for the closed loop
    # CPU time the server process (and its children) spent a request (user + system): what a cost on the
    # request path shows even on a machine other jobs share, where requests/s swings with their load.
    cpu_us_per_request: float | None = None


# A gateway's URL -> its server's process id (CPU time read from /proc around each measurement).
SERVER_PIDS: dict[str, int] = {}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live children (/proc; 0.0 where there is none)."""
    tick = os.sysconf("SC_CLK_TCK")

    def own(p: int) -> float:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)

    total = own(pid)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            total += own(int(stat.parent.name))
    return total


def _pinned(core: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", core, *cmd] if shutil.which("taskset") else cmd


def pin_pids(pids: list[int], cores: str) -> None:
    """Move running processes onto `cores` (a taskset list; "any": leave them where the scheduler puts them)."""
    if cores == "any" or shutil.which("taskset") is None:
        return
    for pid in pids:
        subprocess.run(["taskset", "-p", "-c", cores, str(pid)], capture_output=True, check=True)


def pin_redis(url: str, cores: str) -> None:
    """Move the Redis server at `url` onto `cores` (`pin_pids`)."""
    client = redis.Redis.from_url(url)
    try:
        pid = int(client.info("server")["process_id"])
    finally:
        client.close()
    pin_pids([pid], cores)


@contextlib.contextmanager
def _process(cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[subprocess.Popen]:
    with open(log or os.devnull, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            stop_process_group(proc)


@contextlib.contextmanager
def nginx_upstream(workdir: Path) -> Iterator[str]:
    port = free_port()
    body = json.dumps(UPSTREAM_CHAT).replace("'", "\\'")
    completion = json.dumps(
        {"id": "cmpl-bench", "object": "text_completion", "created": 1, "model": MODEL,
         "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    )
    conf = workdir / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 10000000;
  keepalive_timeout 120s;
  client_body_temp_path {workdir}/body;
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    default_type application/json;
    location = /v1/chat/completions {{ return 200 '{body}'; }}
    location = /v1/completions {{ return 200 '{completion}'; }}
    location = /v1/models {{ return 200 '{{"object":"list","data":[{{"id":"{MODEL}","object":"model"}}]}}'; }}
    location = /health {{ return 200 ''; }}
    location = /metrics {{ default_type text/plain; return 200 'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\\n'; }}
    location / {{ return 404 '{{"error":"not found"}}'; }}
  }}
}}
""")
    with _process(_pinned(LOADGEN_CORE, ["nginx", "-c", str(conf), "-p", str(workdir), "-g", "daemon off;"])) as proc:
        wait_for_port(port, proc=proc)
        yield f"http://127.0.0.1:{port}"


def prepare_bench_site(workdir: Path, upstream: str, repo: Path = REPO, extra_entitlements: int = 0) -> PreparedSite:
    """A fresh site with one pool on the upstream and one roomy dedicated entitlement (never the limit),
    served from `repo` (this checkout, or another commit's for a side-by-side run); with `extra_entitlements`,
    that many more small ones of another tenant in the same pool (idle: what a large platform's snapshot and
    state machine hold beside the one that is measured)."""
    env = {"REDIS_URL": "", "GATEWAY_STATE_BACKEND": "memory", "PYTHONPATH": str(repo)}
    manifests = [documents(
        tiny_pool(MODEL, upstream, slots=100_000, tokens_per_second=1_000_000_000, kv_cache_gib=100_000),
        entitlement("bench", tenant="bench", pool=MODEL, service_class="dedicated", concurrency=50_000,
                    tokens_per_second=100_000_000, kv_cache_gib=1000, slo_target_ms=1000),
    )]
    for first in range(0, extra_entitlements, 1000):  # files of 1,000: one file is bounded by MANIFEST_MAX_BYTES
        manifests.append(documents(*[
            entitlement(f"idle-{i:05d}", tenant="idle", pool=MODEL, service_class="spot", concurrency=1,
                        tokens_per_second=10, kv_cache_gib=0.001)
            for i in range(first, min(extra_entitlements, first + 1000))]))
    suffix = f"-{extra_entitlements}" if extra_entitlements else ""
    return prepare_site(workdir, tenants=["bench", "idle"] if extra_entitlements else ["bench"],
                        manifest=manifests, key_for=["bench"], env=env, repo=repo,
                        database=f"site-{repo.name}{suffix}.sqlite3")


def measure_sites(sites: list[tuple[str, PreparedSite, dict[str, str]]], args: argparse.Namespace,
                  workdir: Path) -> list[Measurement]:
    """Each site with the in-process store, then with Redis; with several sites (this commit and a baseline,
    or this commit with tracing on: a site's own environment) or several places for Redis (`--redis-core`,
    `--redis-socket`), their servers run side by side and are measured in alternation (`measure_alternating`)."""
    rows: list[Measurement] = []
    logs = {"on": [True], "off": [False], "both": [True, False]}[args.request_log]
    for store in args.stores:
        with contextlib.ExitStack() as stack:
            targets: list[tuple[str, str, str]] = []
            for suffix, site, site_env in sites:
                traced = "OTEL_EXPORTER_OTLP_ENDPOINT" in site_env
                for index, (placement, redis_env) in enumerate(_redis_placements(store, args, workdir, stack)):
                    env = {**site_env, **redis_env}
                    if env.get("TOKENPOOLS_TICKS") == "celery":
                        # At the lowest priority: a deployment's worker runs on other machines, not on the
                        # cores that carry requests; here it takes what Redis, nginx and wrk leave of core 1.
                        stack.enter_context(running_ticks(site, env=env, cpu_core=LOADGEN_CORE, nice=19,
                                                          log_name=f"ticks-{site.repo.name}-{index}.log"))
                    for log in logs if not suffix else [True]:  # a baseline commit, tracing, extras: the log on
                        name = f"{store}{'' if log else '-nolog'}-{site.repo.name}{'-otel' if traced else ''}"
                        name += f"-{site.env['DATABASE_URL'].rsplit('/', 1)[-1]}{placement.replace(' ', '-')}"
                        url, proc = stack.enter_context(serving(
                            site, env={**env, "GATEWAY_REQUEST_LOG_DAYS": "7" if log else "0"},
                            log_name=f"gateway-{name}.log", cpu_core=SERVER_CORE))
                        SERVER_PIDS[url] = proc.pid
                        label = f"tokenpools ({store}{'' if log else ', log off'}){suffix}{placement}"
                        targets.append((label, url, site.keys["bench"]))
            if len(targets) == 1:
                rows += measure(*targets[0], args, workdir)
            else:
                rows += measure_alternating(targets, args, workdir, rounds=args.rounds)
    return rows


def _redis_placements(store: str, args: argparse.Namespace, workdir: Path,
                      stack: contextlib.ExitStack) -> list[tuple[str, dict[str, str]]]:
    """For the Redis store, one Redis server per place asked for (its cores, TCP or a unix socket), each with the
    environment a gateway using it gets, and a label suffix when there are several; none for the in-process one."""
    if store != "redis":
        return [("", {})]
    ticks_places = ["own-process", "gateway"] if args.ticks == "both" else [args.ticks]
    places = [(cores, socket, ticks) for cores in args.redis_core for socket in args.redis_socket
              for ticks in ticks_places]
    found = []
    for cores, socket, ticks_place in places:
        socket_path = workdir / f"redis-{secrets.token_hex(4)}.sock"
        unix = ("--unixsocket", str(socket_path), "--unixsocketperm", "700") if socket == "unix" else ()
        redis_url = stack.enter_context(running_redis(*unix))
        pin_redis(redis_url, cores)
        # The periodic ticks (the debt and burst EWMA, the request log's drain, ...): with `--ticks own-process`
        # (the default) in a `run_ticks` process on the load generator's core, as a deployment on Redis runs them
        # in a Celery worker beside its gateways (the gateway keeps its server-only ones); with `--ticks gateway`
        # in the gateway's own process, as with the in-process store (`both`: one Redis and gateway each, side by
        # side). Either way they cost Redis what they cost.
        ticks = "celery" if ticks_place == "own-process" else "in-process"
        env = {"REDIS_URL": redis_url, "GATEWAY_STATE_BACKEND": "redis", "TOKENPOOLS_TICKS": ticks}
        if socket == "unix":  # the gateway's state only: the rest keeps REDIS_URL
            env["GATEWAY_REDIS_URL"] = f"unix://{socket_path}"
        label = ""
        if len(args.redis_core) * len(args.redis_socket) > 1:
            label += f" [Redis on {'any core' if cores == 'any' else 'core ' + cores}, {socket}]"
        if len(ticks_places) > 1:
            label += " [ticks in run_ticks]" if ticks_place == "own-process" else " [ticks in the gateway]"
        found.append((label, env))
    return found


@contextlib.contextmanager
def litellm_proxy(upstream: str, workdir: Path) -> Iterator[str]:
    port = free_port()
    config = workdir / "litellm.yaml"
    # Same upstream, no budgets, no database, no callbacks: the bare proxy path.
    config.write_text(f"""
model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: {upstream}/v1
      api_key: unused
litellm_settings:
  telemetry: false
  drop_params: true
""")
    # Like our gateway, LiteLLM authenticates every request (with its master key, no database).
    env = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "NO_DOCS": "True",
           "DISABLE_ADMIN_UI": "True", "LITELLM_MASTER_KEY": LITELLM_MASTER_KEY}
    cmd = _pinned(SERVER_CORE, [str(LITELLM), "--config", str(config), "--port", str(port), "--host", "127.0.0.1",
                                "--num_workers", "1"])
    with _process(cmd, env=env, log=workdir / "litellm.log") as proc:
        wait_for_port(port, timeout_s=180, proc=proc)
        yield f"http://127.0.0.1:{port}"


def _check_ok(url: str, key: str) -> None:
    deadline = time.monotonic() + 60
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=CHAT_BODY,
                           headers={"Authorization": f"Bearer {key}"}, timeout=10)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not serve a chat completion: {last}")


_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _to_ms(value: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value.strip()).groups()  # type: ignore[union-attr]
    return float(number) * _UNIT_MS[unit]


def run_wrk(url: str, key: str, concurrency: int, duration_s: int, workdir: Path,
            delay_ms: float | None = None) -> tuple[float, float, float, int, int]:
    """One wrk run; with `delay_ms` every connection waits a random time of that mean before each request.

    The waits are exponential, so the streams' requests together arrive as a Poisson process; a fixed wait
    would keep the connections in lockstep and send all of them at once (a burst every `delay_ms`)."""
    script = workdir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(CHAT_BODY))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
        + ("" if delay_ms is None else
           "math.randomseed(os.time())\n"
           f"function delay()\n  return -math.log(1 - math.random()) * {delay_ms:.3f}\nend\n")
    )
    cmd = _pinned(LOADGEN_CORE, ["wrk", "-t1", f"-c{concurrency}", f"-d{duration_s}s", "--latency", "--timeout", "10s",
                                 "-s", str(script), f"{url}/v1/chat/completions"])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    p50 = _to_ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _to_ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return rps, p50, p99, int(non2xx.group(1)) if non2xx else 0, sum(map(int, errors.groups())) if errors else 0


def _loads(args: argparse.Namespace) -> list[tuple[int, float | None]]:
    """(streams, paced rate or None for the closed loop) of every measurement."""
    return [(c, None) for c in args.concurrency] + [(PACED_STREAMS, rate) for rate in args.paced_rate]


def measure_one(label: str, url: str, key: str, load: tuple[int, float | None], args: argparse.Namespace,
                workdir: Path) -> Measurement:
    streams, rate = load
    delay_ms = None if rate is None else PACED_STREAMS / rate * 1000
    pid = SERVER_PIDS.get(url)
    cpu_before = cpu_seconds(pid) if pid else 0.0
    rps, p50, p99, non2xx, errors = run_wrk(url, key, streams, args.duration, workdir, delay_ms=delay_ms)
    cpu_us = None
    if pid and rps:
        cpu_us = (cpu_seconds(pid) - cpu_before) / (rps * args.duration) * 1e6
    shape = f"c={streams:<4}" if rate is None else f"paced {rate:.0f}/s c={streams}"
    cpu = "" if cpu_us is None else f"  cpu {cpu_us:7.1f} us/req"
    print(f"  {label:<30} {shape:<18} {rps:>7.0f} req/s  p50 {p50:7.2f} ms  p99 {p99:7.2f} ms"
          f"  non-2xx {non2xx}  errors {errors}{cpu}", file=sys.stderr)
    return Measurement(label, streams, rps, p50, p99, non2xx, errors, paced_rate=rate, cpu_us_per_request=cpu_us)


def measure(label: str, url: str, key: str, args: argparse.Namespace, workdir: Path) -> list[Measurement]:
    _check_ok(url, key)
    run_wrk(url, key, 8, 2, workdir)  # warm-up: connections, caches, JIT-free but import-lazy paths
    return [measure_one(label, url, key, load, args, workdir) for load in _loads(args)]


@contextlib.contextmanager
def _others_paused(url: str, targets: list[tuple[str, str, str]], pause: bool) -> Iterator[None]:
    """The other gateways of a side-by-side run stopped (SIGSTOP to each one's process group) while `url` is
    measured. They share its core, and an idle gateway still runs its periodic work (ticks, the store view,
    health probes): with five idle beside it, the measured one's p99 at 500/s was 20-41 ms against 6-9 ms with
    one, a neighbour's cost and not its own."""
    groups = [SERVER_PIDS[other] for _, other, _ in targets if other != url and other in SERVER_PIDS] if pause else []
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        for group in groups:
            os.killpg(group, signal.SIGCONT)


def measure_alternating(targets: list[tuple[str, str, str]], args: argparse.Namespace, workdir: Path,
                        rounds: int = 3) -> list[Measurement]:
    """Several servers running at once, measured in turn for every load, `rounds` times in alternating order;
    each figure the median of its rounds. Drift on a shared machine (another job starting) then falls on
    every target alike instead of on whichever was measured last."""
    for _label, url, key in targets:
        _check_ok(url, key)
        run_wrk(url, key, 8, 2, workdir)
    rows: list[Measurement] = []
    pause = args.neighbours == "paused"
    for load in _loads(args):
        taken: dict[str, list[Measurement]] = {label: [] for label, _, _ in targets}
        for round_ in range(rounds):
            for label, url, key in (targets if round_ % 2 == 0 else list(reversed(targets))):
                with _others_paused(url, targets, pause):
                    if pause:  # back from its own pause: its overdue ticks run here
                        run_wrk(url, key, 8, 1, workdir)
                    taken[label].append(measure_one(label, url, key, load, args, workdir))
        for label, runs in taken.items():
            cpu = [r.cpu_us_per_request for r in runs if r.cpu_us_per_request is not None]
            rows.append(Measurement(
                label, load[0], statistics.median(r.requests_per_s for r in runs),
                statistics.median(r.p50_ms for r in runs), statistics.median(r.p99_ms for r in runs),
                sum(r.non_2xx for r in runs), sum(r.errors for r in runs), paced_rate=load[1],
                cpu_us_per_request=statistics.median(cpu) if cpu else None))
    return rows


def report(rows: list[Measurement], args: argparse.Namespace) -> str:
    closed = [r for r in rows if r.paced_rate is None]
    paced = [r for r in rows if r.paced_rate is not None]
    direct = {r.concurrency: r for r in closed if r.target == "direct"}
    by_target: dict[str, dict[int, Measurement]] = {}
    for r in closed:
        by_target.setdefault(r.target, {})[r.concurrency] = r
    lines = [
        f"Command: `python -m bench.gateway --duration {args.duration} --concurrency "
        f"{' '.join(map(str, args.concurrency))} --paced-rate {' '.join(f'{r:g}' for r in args.paced_rate)}"
        f"{' --no-litellm' if args.no_litellm else ''}{f' --baseline {args.baseline}' if args.baseline else ''}"
        f" --request-log {args.request_log} --stores {' '.join(args.stores)} --rounds {args.rounds}"
        f"{f' --extra-entitlements {args.extra_entitlements}' if args.extra_entitlements else ''}"
        f" --redis-core {' '.join(args.redis_core)} --redis-socket {' '.join(args.redis_socket)}"
        f" --neighbours {args.neighbours} --cpu-idle {args.cpu_idle}`  ",
        f"Machine: {machine_description()}; proxy pinned to core {SERVER_CORE}, nginx + wrk on core {LOADGEN_CORE}, "
        f"Redis on core(s) {' / '.join(args.redis_core)} over {' / '.join(args.redis_socket)} (any: unpinned); "
        f"idle cores {MODES[args.cpu_idle]}  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "Upstream: nginx returning a fixed chat completion (instant). Added latency = proxy minus direct at the "
        "same concurrency. Targets: added p50 < 1.5 ms and p99 < 5 ms at 32 streams; >= 5x LiteLLM's "
        "requests/s per process; <= 1/5 of its added latency.",
        "",
        "Closed loop (each stream sends its next request as soon as the last is answered: maximum throughput; "
        "latency here is mostly queueing, streams / throughput):",
        "",
        "| target | streams | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | non-2xx | socket errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += _latency_rows(closed, direct)
    for rate in sorted({r.paced_rate for r in paced if r.paced_rate is not None}):
        at_rate = [r for r in paced if r.paced_rate == rate]
        lines += [
            "",
            f"Paced: {PACED_STREAMS} streams together offering {rate:g} requests/s (below a target's capacity, the "
            "latency each request gains from the proxy while 32 streams are open; above it, queueing again):",
            "",
            "| target | streams | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | non-2xx | socket errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += _latency_rows(at_rate, {r.concurrency: r for r in at_rate if r.target == "direct"})
    litellm = by_target.get("litellm")
    lowest_rate = min((r.paced_rate for r in paced if r.paced_rate is not None), default=None)
    paced_by_target = {r.target: r for r in paced if r.paced_rate == lowest_rate}
    paced_label = "n/a" if lowest_rate is None else f"paced {lowest_rate:g}/s"
    lines += ["", "| tokenpools store | max req/s per process | vs direct | vs LiteLLM | added p50 @32 vs LiteLLM's "
              f"(closed) | added p50 @32 vs LiteLLM's ({paced_label}) |", "|---|---:|---:|---:|---:|---:|"]
    direct_max = max((r.requests_per_s for r in direct.values()), default=0.0)
    for target, per_c in by_target.items():
        if not target.startswith("tokenpools"):
            continue
        best = max(r.requests_per_s for r in per_c.values())
        vs_direct = f"{best / direct_max:.2f}x" if direct_max else "n/a"
        vs_litellm = ratio_closed = ratio_paced = "n/a"
        if litellm:
            vs_litellm = f"{best / max(r.requests_per_s for r in litellm.values()):.1f}x"
            if 32 in per_c and 32 in litellm and 32 in direct:
                ratio_closed = _added_ratio(per_c[32], litellm[32], direct[32])
        if {target, "litellm", "direct"} <= set(paced_by_target):
            ratio_paced = _added_ratio(paced_by_target[target], paced_by_target["litellm"], paced_by_target["direct"])
        lines.append(f"| {target} | {best:.0f} | {vs_direct} | {vs_litellm} | {ratio_closed} | {ratio_paced} |")
    lines += _baseline_rows(rows, args.rounds)
    lines += _request_log_rows(rows, args.rounds)
    lines += _otel_rows(rows, args)
    return "\n".join(lines)


def _otel_rows(rows: list[Measurement], args: argparse.Namespace) -> list[str]:
    """This commit with tracing on (every span exported to the local OTLP sink) against itself with it off,
    measured in the same run: the cost of the traces."""
    by_key = {(r.target, r.concurrency, r.paced_rate): r for r in rows}
    direct = {(r.concurrency, r.paced_rate): r for r in rows if r.target == "direct"}
    lines = []
    for (target, concurrency, rate), traced in by_key.items():
        if not target.endswith(OTEL_SUFFIX):
            continue
        off, plain = by_key.get((target.removesuffix(OTEL_SUFFIX), concurrency, rate)), direct.get((concurrency, rate))
        if off is None or plain is None:
            continue
        load = f"{concurrency} streams" if rate is None else f"paced {rate:g}/s"
        add50, off50 = traced.p50_ms - plain.p50_ms, off.p50_ms - plain.p50_ms
        lines.append(f"| {target.split('(')[1].split(')')[0]} | {load} | {traced.requests_per_s:.0f} "
                     f"({off.requests_per_s:.0f}) | {traced.requests_per_s / off.requests_per_s:.2f} "
                     f"| {add50:.2f} ({off50:.2f}) | {traced.p99_ms - plain.p99_ms:.2f} ({off.p99_ms - plain.p99_ms:.2f}) |")
    if not lines:
        return []
    sink = getattr(args, "otel_sink", None)
    exported = "" if sink is None else (f" The sink received {sink.posts} exports, {sink.spans} spans "
                                        f"({sink.bytes / 1e6:.1f} MB) in the whole run.")
    sampler = " ".join(f"{name}={os.environ[name]}" for name in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")
                       if name in os.environ) or "the default sampler (every request)"
    return ["", "Tracing on (OTEL_EXPORTER_OTLP_ENDPOINT: a local OTLP/HTTP sink, bench/otlp_sink.py; "
            f"{sampler}; the batch processor's defaults) against off, this commit, same run, side by side; "
            f"traced (off):{exported}", "",
            "| store | load | req/s (off) | req/s ratio | added p50 ms (off) | added p99 ms (off) |",
            "|---|---|---:|---:|---:|---:|", *lines]


LOG_OFF = ", log off)"


def _request_log_rows(rows: list[Measurement], rounds: int) -> list[str]:
    """The request log on against off, measured side by side in the same run: requests/s on / off (target:
    within 5%, >= 0.95) and the latency each adds over direct."""
    by_key = {(r.target, r.concurrency, r.paced_rate): r for r in rows}
    direct = {(r.concurrency, r.paced_rate): r for r in rows if r.target == "direct"}
    lines = ["", "Request log on against off (same run: both servers up side by side, measured in alternation, each "
             f"figure the median of {rounds} rounds; target: the log on within 5% of off; CPU us a request is the "
             "server process's user + system time over the requests it answered, the figure a shared machine's "
             "load moves least):", "",
             "| store | load | req/s on (off) | on / off | CPU us/request on (off) | off / on | added p50 ms on (off) "
             "| added p99 ms on (off) | within 5% (req/s, CPU) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    found = False
    for (target, concurrency, rate), off in by_key.items():
        if not target.endswith(LOG_OFF):
            continue
        on = by_key.get((target[: -len(LOG_OFF)] + ")", concurrency, rate))
        plain = direct.get((concurrency, rate))
        if on is None or plain is None or not off.requests_per_s:
            continue
        found = True
        ratio = on.requests_per_s / off.requests_per_s
        load = f"{concurrency} streams" if rate is None else f"paced {rate:g}/s"
        store = target.split("(")[1].split(",")[0]
        cpu_on, cpu_off = on.cpu_us_per_request, off.cpu_us_per_request
        cpu_ratio = cpu_off / cpu_on if cpu_on and cpu_off else None
        cpu = "n/a" if cpu_on is None or cpu_off is None else f"{cpu_on:.0f} ({cpu_off:.0f})"
        verdict = f"{'yes' if ratio >= 0.95 else 'NO'}, " + (
            "n/a" if cpu_ratio is None else "yes" if cpu_ratio >= 0.95 else "NO")
        lines.append(
            f"| {store} | {load} | {on.requests_per_s:.0f} ({off.requests_per_s:.0f}) | {ratio:.3f} | {cpu} "
            f"| {'n/a' if cpu_ratio is None else f'{cpu_ratio:.3f}'} "
            f"| {on.p50_ms - plain.p50_ms:.2f} ({off.p50_ms - plain.p50_ms:.2f}) "
            f"| {on.p99_ms - plain.p99_ms:.2f} ({off.p99_ms - plain.p99_ms:.2f}) | {verdict} |")
    return lines if found else []


def _baseline_rows(rows: list[Measurement], rounds: int = 3) -> list[str]:
    """This commit against the baseline commit measured in the same run: ratios (this / baseline) of
    requests/s (higher is better) and of the latency added over direct (lower is better)."""
    baseline = {r.target.split(" @")[0]: r.target for r in rows if " @" in r.target}
    if not baseline:
        return []
    direct = {(r.concurrency, r.paced_rate): r for r in rows if r.target == "direct"}
    by_key = {(r.target, r.concurrency, r.paced_rate): r for r in rows}
    lines = ["", f"This commit against {next(iter(baseline.values())).split(' @')[1]} (same run: both commits' "
             f"servers up side by side, measured in alternation, each figure the median of {rounds} rounds; ratios this / "
             "baseline; requests/s higher is better, added latency lower is better):", "",
             "| store | load | req/s | req/s ratio | added p50 ms (base) | added p50 ratio | added p99 ms (base) "
             "| added p99 ratio |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for target, base_target in baseline.items():
        for (name, concurrency, rate), ours in by_key.items():
            if name != target:
                continue
            base, plain = by_key.get((base_target, concurrency, rate)), direct.get((concurrency, rate))
            if base is None or plain is None:
                continue
            load = f"{concurrency} streams" if rate is None else f"paced {rate:g}/s"
            add50, base50 = ours.p50_ms - plain.p50_ms, base.p50_ms - plain.p50_ms
            add99, base99 = ours.p99_ms - plain.p99_ms, base.p99_ms - plain.p99_ms
            lines.append(
                f"| {target.split('(')[1].rstrip(')')} | {load} | {ours.requests_per_s:.0f} "
                f"({base.requests_per_s:.0f}) | {ours.requests_per_s / base.requests_per_s:.2f} "
                f"| {add50:.2f} ({base50:.2f}) | {_ratio(add50, base50)} | {add99:.2f} ({base99:.2f}) "
                f"| {_ratio(add99, base99)} |")
    return lines


def _ratio(ours: float, base: float) -> str:
    return f"{ours / base:.2f}" if base > 0.05 else "n/a"


def _latency_rows(rows: list[Measurement], direct: dict[int, Measurement]) -> list[str]:
    lines = []
    for r in rows:
        base = direct.get(r.concurrency)
        add50 = "" if r.target == "direct" or base is None else f"{r.p50_ms - base.p50_ms:.2f}"
        add99 = "" if r.target == "direct" or base is None else f"{r.p99_ms - base.p99_ms:.2f}"
        lines.append(f"| {r.target} | {r.concurrency} | {r.requests_per_s:.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} "
                     f"| {add50} | {add99} | {r.non_2xx} | {r.errors} |")
    return lines


def _added_ratio(ours: Measurement, theirs: Measurement, direct: Measurement) -> str:
    added_ours, added_theirs = ours.p50_ms - direct.p50_ms, theirs.p50_ms - direct.p50_ms
    return f"{added_ours / added_theirs:.2f}" if added_theirs > 0 else "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=10, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--paced-rate", type=float, nargs="*", default=[50.0, 500.0],
                        help=f"requests/s offered together by {PACED_STREAMS} paced streams, one run per rate "
                             "(none: skip the paced runs)")
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (when var/litellm-venv is missing)")
    parser.add_argument("--baseline", metavar="REF",
                        help="also measure the gateway of this commit (e.g. HEAD~1), side by side in the same run")
    parser.add_argument("--request-log", choices=["on", "off", "both"], default="both",
                        help="the gateway's request log (GATEWAY_REQUEST_LOG_DAYS 7 or 0); both: side by side")
    parser.add_argument("--stores", nargs="+", choices=["memory", "redis"], default=["memory", "redis"],
                        help="the gateway state stores to measure")
    parser.add_argument("--redis-core", nargs="+", default=[LOADGEN_CORE], metavar="CORES",
                        help="taskset core list of the Redis servers (default: the load generator's core, away from "
                             "the proxy's); any: unpinned; several: one Redis and gateway each, side by side")
    parser.add_argument("--redis-socket", nargs="+", choices=["tcp", "unix"], default=["tcp"],
                        help="how the gateway reaches its Redis: TCP on loopback, or a unix socket (Redis beside "
                             "it); both: side by side")
    parser.add_argument("--neighbours", choices=["paused", "running"], default="paused",
                        help="side by side: the gateways not being measured are stopped (SIGSTOP) meanwhile, or left "
                             "running their periodic work on the same core")
    parser.add_argument("--ticks", choices=["own-process", "gateway", "both"], default="own-process",
                        help="with the Redis store, where the periodic ticks run: a run_ticks process on the load "
                             "generator's core at nice 19 (as Celery runs them beside a deployment's gateways), or the "
                             "gateway's own process (as until 2026-11-27); both: one Redis and gateway each, "
                             "side by side")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of alternation when several servers are measured side by side (median)")
    parser.add_argument("--extra-entitlements", type=int, default=0, metavar="N",
                        help="also measure a site whose pool holds N more (idle) entitlements, side by side")
    parser.add_argument("--otel", action="store_true",
                        help="also measure this commit with tracing on, every span exported over OTLP/HTTP to a "
                             "local sink (bench/otlp_sink.py), side by side with it off")
    parser.add_argument("--cpu-idle", choices=MODES, default="halt",
                        help="halt: the machine's idle states as configured; poll: idle cores poll instead of "
                             "halting while everything is measured (a PM QoS request, bench/cpu_idle.py; root)")
    parser.add_argument("--write-results", action="store_true", help="rewrite the section in bench/RESULTS.md")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None or shutil.which("nginx") is None:
        print("bench.gateway needs wrk and nginx: run `make system-deps`", file=sys.stderr)
        return 2
    if not args.no_litellm and not LITELLM.exists():
        print(f"{LITELLM} is missing: run `make litellm-venv` or pass --no-litellm", file=sys.stderr)
        return 2
    try:
        with idle_states(args.cpu_idle):
            rows = measure_all(args)
    except IdleStatesUnavailable as exc:
        print(f"bench.gateway --cpu-idle poll: {exc}", file=sys.stderr)
        return 2
    text = report(rows, args)
    print(text)
    save_rows("gateway", rows)
    if args.write_results:
        write_section("Gateway overhead (`make bench-gateway`)", text)
    return 0


def measure_all(args: argparse.Namespace) -> list[Measurement]:
    """Direct, every site and LiteLLM, in that order, each against the same nginx upstream."""
    rows: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="tokenpools-bench-") as tmp:
        workdir = Path(tmp)
        with nginx_upstream(workdir) as upstream:
            print(f"upstream {upstream}", file=sys.stderr)
            rows += measure("direct", upstream, "unused", args, workdir)
            with contextlib.ExitStack() as stack:
                no_otel = {"OTEL_SDK_DISABLED": "true"}  # whatever this shell's OTEL_* say: tracing off
                sites = [("", prepare_bench_site(workdir, upstream), no_otel)]
                if args.baseline:
                    tree = stack.enter_context(source_tree(args.baseline))
                    sites.append((f" @{tree.name}", prepare_bench_site(workdir, upstream, tree), no_otel))
                if args.extra_entitlements:
                    sites.append((f" +{args.extra_entitlements} entitlements",
                                  prepare_bench_site(workdir, upstream, extra_entitlements=args.extra_entitlements),
                                  no_otel))
                if args.otel:
                    args.otel_sink = sink = OtlpSink(count_spans=True, cpu=int(LOADGEN_CORE)).start()
                    stack.callback(sink.stop)
                    # The same site (database) served by a second process, its traces on; the sink decodes on the
                    # load generator's core, not the gateway's.
                    sites.append((OTEL_SUFFIX, sites[0][1], {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url}))
                rows += measure_sites(sites, args, workdir)
            if not args.no_litellm:
                with litellm_proxy(upstream, workdir) as url:
                    rows += measure("litellm", url, LITELLM_MASTER_KEY, args, workdir)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
