"""A real client at twice its entitlement's concurrency (issue 23, item 5): vLLM's load tester `guidellm`
(`guidellm run --profile kind=concurrent,streams=8`) against the real site in front of the virtual vLLM, on a
guaranteed entitlement of concurrency 4 (`make bench-guidellm`).

    python -m bench.guidellm_queue [--requests 80] [--stores memory redis] [--write-results]

Each store runs three guidellm benchmarks of `--requests` requests, one after the other:
  * 4 streams on the entitlement with the default queue (8 waiters, 1,000 ms): the entitlement's own rate, every
    request admitted at once;
  * 8 streams on the same entitlement: the 4 extra streams wait in its queue;
  * 8 streams on a twin entitlement with `queue: {max: 0}`: the old behaviour, an immediate 429 over the limit.
A request takes about 0.3 s on the virtual vLLM (30 output tokens at 10 ms), so a waiter waits about one request
time, well under the 1 s the queue allows. guidellm runs from its own environment (`make guidellm-venv`) with
synthetic prompts counted by the project's tiny model's tokenizer (var/models/vllm-tiny): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import httpx

from apps.simulator.processes import free_port, running_http_server
from bench.results import machine_description, write_section
from tests.support.crash import wait_for_workers
from tests.support.manifests import documents, entitlement, tiny_pool
from tests.support.services import PrivateRedis
from tests.support.site import REPO, prepare_site, serving

GUIDELLM = REPO / "var" / "guidellm-venv" / "bin" / "guidellm"
TOKENIZER = REPO / "var" / "models" / "vllm-tiny"
POOL = "tiny"
CONCURRENCY = 4
STREAMS = 8
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 30
DECODE_MS = 10.0
# The site's entitlements: the default queue of a guaranteed one, and the same without a queue.
QUEUED, UNQUEUED = "queued", "no-queue"
STORES = ("memory", "redis")


@dataclass
class Run:
    """What one guidellm benchmark reported."""

    label: str
    streams: int
    completed: int
    errored: int
    incomplete: int
    duration_s: float
    rate: float  # completed requests per second over the benchmark's duration
    latency_mean_s: float
    latency_p50_s: float
    latency_p99_s: float
    errors: Counter
    # The gateway's own view (/metrics), where one process serves: refusals by reason, queue waits.
    gateway: dict[str, float] | None = None

    def row(self, store: str) -> str:
        errors = ", ".join(f"{n} x {e}" for e, n in self.errors.most_common()) or "-"
        if self.gateway is not None:
            refused = {k: int(v) for k, v in self.gateway.items() if k not in ("waited", "wait_s") and v}
            waited = int(self.gateway.get("waited", 0))
            mean_wait = self.gateway.get("wait_s", 0.0) / waited if waited else 0.0
            errors += f"; gateway: refused {refused or 0}, {waited} waited in the queue (mean {mean_wait:.3f} s)"
        return (f"| {store} | {self.label} | {self.streams} | {self.completed} | {self.errored} | {self.incomplete} "
                f"| {self.duration_s:.1f} | {self.rate:.2f} | {self.latency_mean_s:.3f} | {self.latency_p50_s:.3f} "
                f"| {self.latency_p99_s:.3f} | {errors} |")


def manifest(backend_url: str) -> str:
    queued = entitlement(QUEUED, tenant="acme", pool=POOL, service_class="guaranteed", concurrency=CONCURRENCY)
    unqueued = entitlement(UNQUEUED, tenant="acme", pool=POOL, service_class="guaranteed", concurrency=CONCURRENCY)
    # No queue: a request over the entitlement's concurrency is refused at once (the behaviour before issue 23).
    unqueued = unqueued.replace("sloTargetMs: 2000}", "sloTargetMs: 2000, queue: {max: 0}}")
    assert "queue: {max: 0}" in unqueued
    # Pool slots and rates well above the entitlements': only the entitlement's own concurrency binds.
    return documents(tiny_pool(POOL, backend_url, slots=64), queued, unqueued)


@contextmanager
def virtual_vllm() -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "backends.virtual_vllm", "--port", str(port), "--served-model-name", POOL,
           "--max-num-seqs", "64", "--latency-model", "fixed", "--prefill-ms-per-token", "0",
           "--decode-ms-per-token", str(DECODE_MS), "--log-level", "warning"]
    with running_http_server(cmd, port=port, name="virtual-vllm", cwd=REPO, startup_timeout_s=60) as (url, _):
        yield url


def _stat(metrics: dict[str, Any], name: str, field: str = "mean") -> float:
    """`metrics[name]["successful"][field]`, a percentile ("p50", "p99") or 0 where guidellm left it out."""
    stats = (metrics.get(name) or {}).get("successful") or {}
    if field.startswith("p"):
        stats = stats.get("percentiles") or {}
    value = stats.get(field)
    return float(value) if isinstance(value, int | float) else 0.0


def _error_reason(request: dict[str, Any]) -> str:
    """An errored request's HTTP status ("429 Too Many Requests"): guidellm keeps httpx's message, not the body
    (the gateway's reasons come from its /metrics instead), or the exception's name for a failure without one."""
    error = str((request.get("info") or {}).get("error") or request.get("error") or "")
    status = re.search(r"'(\d{3} [A-Za-z -]+)'", error)
    if status:
        return status.group(1)
    return error.split("(", 1)[0] or "unknown"


def gateway_counts(url: str, token: str, name: str) -> dict[str, float]:
    """This serving process's refusals of entitlement `name` by reason, and its queue waits ("waited", and
    "wait_s" their sum), from /metrics. Per process: with several workers it is one worker's share only."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if f'entitlement="{name}"' not in line or line.startswith("#"):
            continue
        value = float(line.rsplit(" ", 1)[1])
        if line.startswith("gateway_requests_rejected_total"):
            reason = re.search(r'reason="([^"]*)"', line)
            key = reason.group(1) if reason else "?"
            counts[key] = counts.get(key, 0.0) + value
        elif line.startswith("tokenpools_queue_wait_seconds_count"):
            counts["waited"] = counts.get("waited", 0.0) + value
        elif line.startswith("tokenpools_queue_wait_seconds_sum"):
            counts["wait_s"] = counts.get("wait_s", 0.0) + value
    return counts


def parse_report(path: Path, label: str, streams: int) -> Run:
    """The one benchmark of a guidellm JSON report (format version 2, guidellm 0.8)."""
    report = json.loads(path.read_text())
    benchmarks = report.get("benchmarks") or []
    if len(benchmarks) != 1:
        raise ValueError(f"{path}: expected one benchmark, found {len(benchmarks)}")
    bench = benchmarks[0]
    metrics = bench.get("metrics") or {}
    totals = metrics.get("request_totals") or bench.get("scheduler_metrics", {}).get("requests_made") or {}
    duration = float(bench.get("duration") or 0.0)
    completed = int(totals.get("successful", 0))
    errored_requests = (bench.get("requests") or {}).get("errored") or []
    return Run(
        label=label, streams=streams, completed=completed, errored=int(totals.get("errored", 0)),
        incomplete=int(totals.get("incomplete", 0)), duration_s=duration,
        rate=completed / duration if duration > 0 else 0.0,
        latency_mean_s=_stat(metrics, "request_latency"), latency_p50_s=_stat(metrics, "request_latency", "p50"),
        latency_p99_s=_stat(metrics, "request_latency", "p99"),
        errors=Counter(_error_reason(r) for r in errored_requests),
    )


def guidellm(url: str, key: str, streams: int, requests: int, out: Path) -> None:
    """`guidellm run` with the concurrent profile; its JSON report written to `out`."""
    if not GUIDELLM.exists():
        raise SystemExit(f"{GUIDELLM} not found: run `make guidellm-venv`")
    cmd = [str(GUIDELLM), "run",
           "--backend", f"kind=openai_http,target={url},model={POOL},api_key={key},timeout=60,http2=false",
           "--profile", f"kind=concurrent,streams={streams}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={TOKENIZER}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


PLAN = (("entitlement's rate (within its concurrency)", QUEUED, CONCURRENCY),
        ("default queue (8 waiters, 1,000 ms)", QUEUED, STREAMS),
        ("no queue (`queue: {max: 0}`)", UNQUEUED, STREAMS))


def measure_store(store: str, requests: int, workdir: Path, backend_url: str) -> list[Run]:
    redis = PrivateRedis() if store == "redis" else None
    env = {"TOKENPOOLS_TICKS": "off"}
    if redis is not None:
        redis.start()
        env |= {"REDIS_URL": redis.url, "GATEWAY_STATE_BACKEND": "redis"}
    try:
        site = prepare_site(workdir, tenants=["acme"], manifest=manifest(backend_url), key_for=[QUEUED, UNQUEUED],
                            env=env)
        workers = 2 if redis is not None else 1
        runs = []
        with serving(site, workers=workers, log_name=f"serve-{store}.log") as (url, process):
            if workers > 1:
                wait_for_workers(process.pid, workers)
            for index, (label, name, streams) in enumerate(PLAN, 1):
                started = time.monotonic()
                print(f"[{store} {index}/{len(PLAN)}] guidellm concurrent@{streams}, {requests} requests on "
                      f"{name!r} ...", file=sys.stderr, flush=True)
                out = workdir / f"guidellm-{store}-{index}.json"
                token = site.env["METRICS_TOKEN"]
                before = gateway_counts(url, token, name) if workers == 1 else None
                guidellm(url, site.keys[name], streams, requests, out)
                run = parse_report(out, label, streams)
                if before is not None:
                    after = gateway_counts(url, token, name)
                    run.gateway = {k: v - before.get(k, 0.0) for k, v in after.items()}
                print(f"[{store} {index}/{len(PLAN)}] {run.completed} completed, {run.errored} errored, "
                      f"{run.incomplete} incomplete, {run.rate:.2f} req/s ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)
                runs.append(run)
        return runs
    finally:
        if redis is not None:
            redis.stop()


HEADER = ("| store | entitlement | streams | completed | errored | incomplete | duration s | completed/s "
          "| latency mean s | p50 s | p99 s | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def render(results: dict[str, list[Run]], requests: int) -> str:
    rows = "\n".join(run.row("in-process" if store == "memory" else "Redis, `serve --workers 2`")
                     for store, runs in results.items() for run in runs)
    notes = []
    for store, runs in results.items():
        own, queued, refused = runs
        # The entitlement's rate: its concurrency over the time one request takes when nothing waits.
        expected = CONCURRENCY / own.latency_mean_s if own.latency_mean_s else 0.0
        share = queued.rate / own.rate if own.rate else 0.0
        notes.append(f"- {store}: the entitlement's rate is {own.rate:.2f} completed/s at {CONCURRENCY} streams "
                     f"({CONCURRENCY} / {own.latency_mean_s:.3f} s = {expected:.2f}); at {STREAMS} streams with "
                     f"its queue {queued.rate:.2f}/s ({share:.0%} of it), mean latency {queued.latency_mean_s:.3f} s "
                     f"(the wait: {queued.latency_mean_s - own.latency_mean_s:+.3f} s); without a queue "
                     f"{refused.completed} of {requests} completed.")
    return (f"`guidellm run --profile kind=concurrent,streams=N` (guidellm 0.8.1, `make guidellm-venv`), "
            f"{requests} requests of {PROMPT_TOKENS} prompt and {OUTPUT_TOKENS} output tokens (synthetic) per "
            f"benchmark, through the site to the virtual vLLM ({DECODE_MS:.0f} ms per output token), on a guaranteed "
            f"entitlement of concurrency {CONCURRENCY}. Measured {date.today().isoformat()} on "
            f"{machine_description()}.\n\n{HEADER}\n{rows}\n\n" + "\n".join(notes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=80, help="requests per guidellm benchmark")
    parser.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    parser.add_argument("--write-results", action="store_true", help="rewrite the section in bench/RESULTS.md")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep guidellm's JSON reports and the site's logs in DIR (default: a removed temp dir)")
    args = parser.parse_args(argv)
    results: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="tokenpools-guidellm-") as tmp, virtual_vllm() as backend_url:
        for store in args.stores:
            workdir = (args.keep or Path(tmp)) / store
            workdir.mkdir(parents=True)
            results[store] = measure_store(store, args.requests, workdir, backend_url)
    body = render(results, args.requests)
    print(body)
    if args.write_results:
        write_section("A real client at twice its concurrency (guidellm, issue 23)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
