"""The live arms of an experiment: the scenario's tenants as real clients (`apps.simulator.live`) against the
real site (`manage.py serve` on a fresh database, one per arm: a fresh pool) in front of real backends, or
straight against the backend (no admission control at all).

Arms: `token-pools` (the in-process store, one process), `redis` (the Redis store, `serve --workers 2`, a
private Redis), `no-admission` (the same clients straight to the backend: nothing is refused, the backend
queues what it cannot run). Backends: `vllm-cpu` (N real vLLMs serving the experiment model, a bigger
random-weight model of the tiny model's kind (`live_vllm.EXPERIMENT_MODEL_ARGS`), each on a core of its own
when there are several) or `virtual` (N virtual vLLM replicas with the scenario's latency
model, e.g. the H100 roofline).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from apps.simulator.live import (
    LiveRecord,
    LiveWorkload,
    live_entitlement,
    scenario_manifest,
    scenario_site_env,
)
from apps.simulator.live_site import REPO, manage, prepare_site, running_ticks, serving
from apps.simulator.live_vllm import SERVED_MODEL_NAME, ensure_experiment_model, running_vllm
from apps.simulator.processes import free_port, running_http_server, stop_process_group, wait_for_port
from apps.simulator.scenario import Scenario
from apps.simulator.simulation import SimConfig
from apps.simulator.workload import TenantSpec

ARMS = ("token-pools", "redis", "no-admission")
BACKENDS = ("vllm-cpu", "virtual")
POOL = "experiment"
OWNER = "exp"


@dataclass(frozen=True)
class Backend:
    urls: tuple[str, ...]
    model: str  # the name the backend serves


def virtual_vllm_cmd(config: SimConfig, port: int, model: str) -> list[str]:
    """A virtual vLLM replica whose instance model is the simulator's (the scenario's cluster settings)."""
    cmd = [sys.executable, "-m", "backends.virtual_vllm", "--port", str(port), "--served-model-name", model,
           "--max-num-seqs", str(config.max_num_seqs), "--latency-model", config.latency_model,
           "--prefill-ms-per-token", str(config.prefill_ms_per_token),
           "--decode-ms-per-token", str(config.decode_ms_per_token), "--block-size", str(config.block_size)]
    if config.kv_blocks:
        cmd += ["--kv-blocks", str(config.kv_blocks)]
    if config.latency_model == "roofline":
        cmd += ["--roofline-model", config.model, "--gpu", config.gpu]
    return cmd


@contextlib.contextmanager
def live_backend(kind: str, config: SimConfig, replicas: int = 1) -> Iterator[Backend]:
    if kind not in BACKENDS:
        raise ValueError(f"unknown backend {kind!r}; one of {', '.join(BACKENDS)}")
    with contextlib.ExitStack() as stack:
        urls = []
        if kind == "vllm-cpu":
            # One core each when there are several: replicas that share the machine's cores would slow
            # each other down, and taking one out would then speed the other up (not a capacity drop).
            cores = os.cpu_count() or 1
            for index in range(replicas):
                url, _process = stack.enter_context(running_vllm(
                    max_num_seqs=config.max_num_seqs, pin_cpu=index % cores if replicas > 1 else None,
                    model_dir=ensure_experiment_model()))
                urls.append(url)
            yield Backend(tuple(urls), SERVED_MODEL_NAME)
            return
        for _ in range(replicas):
            port = free_port()
            url, _process = stack.enter_context(running_http_server(
                virtual_vllm_cmd(config, port, POOL), port=port, name="virtual-vllm", cwd=REPO, startup_timeout_s=60))
            urls.append(url)
        yield Backend(tuple(urls), POOL)


def calibrate_decode_ms(backend: Backend, *, streams: int, prompt_tokens: int, output_tokens: int) -> float:
    """Milliseconds per output token of one stream while `streams` run together on every replica (a
    request's whole time, prefill included, over its output tokens, with full batches), the median over the
    streams, after one warm-up round."""

    async def one(client: httpx.AsyncClient, url: str) -> float:
        body = {"model": backend.model, "prompt": " ".join(["hello"] * prompt_tokens), "max_tokens": output_tokens,
                "stream": True, "ignore_eos": True}
        started = time.monotonic()
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for _line in response.aiter_lines():
                pass
        # The whole request over its tokens (what the scenario's per-token time makes a request last): timing
        # from the first chunk instead read near zero whenever the server's front end, starved of the CPU,
        # sent a whole answer in one burst.
        return (time.monotonic() - started) * 1000.0 / max(1, output_tokens)

    async def rounds() -> float:
        # Every replica at once, each with a full batch: the speed each has while the others run too.
        urls = backend.urls
        async with httpx.AsyncClient(timeout=300) as client:
            await asyncio.gather(*(one(client, url) for url in urls for _ in range(streams)))
            return statistics.median(await asyncio.gather(*(one(client, url) for url in urls for _ in range(streams))))

    return asyncio.run(rounds())


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A Redis of the run's own on a free port, nothing saved."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(port, timeout_s=30, proc=proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process_group(proc)


def admin_token(env: dict[str, str]) -> str:
    out = manage(env, "shell", "-c", "from django.contrib.auth import get_user_model; "
                                     "from rest_framework.authtoken.models import Token; "
                                     "u = get_user_model().objects.create_superuser('ops', 'ops@example.com', 'ops-pass-123'); "
                                     "print(Token.objects.create(user=u).key)")
    return out.strip().splitlines()[-1]


def operator_hooks(url: str, token: str) -> tuple[Callable[[TenantSpec], Awaitable[str]],
                                                  Callable[[TenantSpec], Awaitable[None]]]:
    """What an operator does when a tenant joins (create its entitlement and a key through the REST API)
    and leaves (delete the entitlement)."""
    headers = {"Authorization": f"Token {token}"}

    async def call(client: httpx.AsyncClient, method: str, path: str, expected: int, what: str,
                   **kwargs: Any) -> httpx.Response:
        # An operator tries again when the site answers 5xx (SQLite shared by two workers can be busy).
        for attempt in range(5):
            response = await client.request(method, path, **kwargs)
            if response.status_code == expected:
                return response
            if response.status_code < 500:
                break
            await asyncio.sleep(0.5 * (attempt + 1))
        raise RuntimeError(f"{what} failed ({response.status_code}): {response.text[:300]}")

    async def join(tenant: TenantSpec) -> str:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
            await call(client, "POST", "/api/v1/entitlements/", 201, f"creating {tenant.name}'s entitlement",
                       json=live_entitlement(tenant, pool=POOL, owner=OWNER))
            key = await call(client, "POST", "/api/v1/keys/", 201, f"creating {tenant.name}'s key",
                             json={"entitlement": tenant.name, "name": "live"})
            return str(key.json()["secret"])

    async def leave(tenant: TenantSpec) -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
            await call(client, "DELETE", f"/api/v1/entitlements/{tenant.name}/", 204,
                       f"deleting {tenant.name}'s entitlement")

    return join, leave


SAMPLED = ("gateway_store_in_flight", "flow_control_pool_saturation", "flow_control_pool_budget",
           "tokenpools_entitlement_debt", "tokenpools_entitlement_priority")


def enabled_replicas(events: list[Any], when: float, replicas: int, slots_per_replica: int) -> list[bool]:
    """Which replicas the scenario's capacity events leave enabled at `when`: a `slots` event becomes that
    many slots' worth of whole replicas; `remove` / `restore` name instances."""
    enabled = [True] * replicas
    for event in sorted(events, key=lambda e: e.at):
        if event.at > when:
            break
        if event.action == "slots":
            keep = max(0, min(replicas, -(-event.slots // slots_per_replica)))
            enabled = [i < keep for i in range(replicas)]
        else:
            for index in event.instances:
                if 0 <= index < replicas:
                    enabled[index] = event.action == "restore"
    return enabled


async def operate_capacity(url: str, token: str, backend: Backend, events: list[Any], slots_per_replica: int,
                           started: float) -> None:
    """Carry out the scenario's capacity events as an operator would: disable and re-enable replicas of the
    pool through the REST API at the events' times."""
    headers = {"Authorization": f"Token {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        for event in sorted(events, key=lambda e: e.at):
            await asyncio.sleep(max(0.0, started + event.at - time.monotonic()))
            flags = enabled_replicas(events, event.at, len(backend.urls), slots_per_replica)
            body = {"replicas": [{"url": u, "enabled": on} for u, on in zip(backend.urls, flags, strict=True)]}
            response = await client.patch(f"/api/v1/pools/{POOL}/", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"capacity event at {event.at} s failed: {response.text}")


async def sample_metrics(url: str, horizon_s: float, samples: list[dict[str, Any]], *, token: str = "") -> None:
    """Once a second, the gateway's own view from `/metrics`: what the store holds per entitlement, the
    pool's saturation and budget (the slots held over time, as the gateway sees them)."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=5, headers=headers) as client:
        while (elapsed := time.monotonic() - started) < horizon_s:
            with contextlib.suppress(httpx.HTTPError):
                text = (await client.get(url + "/metrics")).text
                sample: dict[str, Any] = {"t": round(elapsed, 2)}
                for line in text.splitlines():
                    name, _, value = line.partition(" ")
                    if name.split("{", 1)[0] in SAMPLED:
                        sample[name] = float(value)
                samples.append(sample)
            await asyncio.sleep(1.0)


async def _with_progress(work: Awaitable[list[LiveRecord]], horizon_s: float, label: str,
                         show: bool) -> list[LiveRecord]:
    if not show:
        return await work
    from tqdm import tqdm

    task = asyncio.ensure_future(work)
    with tqdm(total=round(horizon_s), unit="s", desc=label, file=sys.stderr, mininterval=1.0) as bar:
        started = time.monotonic()
        while not task.done():
            await asyncio.sleep(1.0)
            bar.n = min(round(horizon_s), round(time.monotonic() - started))
            bar.refresh()
    return task.result()


def arm_env(arm: str, scenario: Scenario, redis_url: str | None = None) -> dict[str, str]:
    """The settings an arm's site runs with beyond its database (the scenario's pricing, the store's)."""
    env: dict[str, str] = scenario_site_env(scenario.config.tenants)
    if arm == "redis":
        assert redis_url is not None, "the redis arm needs a Redis"
        env |= {"GATEWAY_STATE_BACKEND": "redis", "REDIS_URL": redis_url}
    return env


def run_arm(arm: str, scenario: Scenario, backend: Backend, workdir: Path, *, progress: bool = True,
            redis_url: str | None = None, samples: list[dict[str, Any]] | None = None,
            slots_per_replica: int | None = None, static_entitlements: bool = False) -> list[LiveRecord]:
    """One live arm of the (already scaled) scenario; returns every request's record. With a gateway,
    `samples` collects its `/metrics` view once a second. `static_entitlements`: every tenant's entitlement
    is in place from the start and stays (no operator creating one when its tenant joins, deleting it when
    it leaves; the clients still come and go at their times): one set of entitlements for the whole run (a
    replay follows the entitlements' lifetimes either way: `apps.simulator.lifetimes`)."""
    config = scenario.config
    assert config.horizon_s is not None
    horizon = float(config.horizon_s)
    workdir.mkdir(parents=True, exist_ok=True)
    if arm == "no-admission":
        workload = LiveWorkload(config.tenants, url=backend.urls, keys=dict.fromkeys(
            (t.name for t in config.tenants), "none"), model=backend.model, seed=config.seed, horizon_s=horizon)
        return asyncio.run(_with_progress(workload.run(), horizon, arm, progress))
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
    per_replica = slots_per_replica or config.max_num_seqs
    if config.capacity_events and len(backend.urls) < 2:
        raise ValueError("a scenario with capacity events needs at least 2 replicas live (--replicas 2): one is "
                         "taken out and brought back")
    # The manifest has the entitlements present at the start (all of them, when static).
    present = [replace(t, start=0.0) for t in config.tenants] if static_entitlements else config.tenants
    manifest = scenario_manifest(present, pool=POOL, owner=OWNER, backend_urls=list(backend.urls),
                                 slots_per_replica=per_replica, model=backend.model)
    # Each arm on a fresh database and pool, also when a report folder is used again.
    (workdir / "site.sqlite3").unlink(missing_ok=True)
    site = prepare_site(workdir, tenants=[OWNER], manifest=manifest,
                        key_for=[t.name for t in present if t.start == 0])
    token = admin_token(site.env)
    env = arm_env(arm, scenario, redis_url)
    workers = 2 if arm == "redis" else 1
    # With Redis (a broker) `serve` leaves the periodic ticks to Celery beat; the run starts them as an
    # operator would (`manage.py run_ticks`), else no EWMA tick would ever price debt or burst.
    ticks = running_ticks(site, env=env) if arm == "redis" else contextlib.nullcontext()
    with serving(site, env=env, workers=workers) as (url, _server), ticks:
        join, leave = (None, None) if static_entitlements else operator_hooks(url, token)
        workload = LiveWorkload(config.tenants, url=url, keys=site.keys, model=POOL, seed=config.seed,
                                horizon_s=horizon, on_join=join, on_leave=leave)

        async def both() -> list[LiveRecord]:
            sampled = sample_metrics(url, horizon, samples if samples is not None else [],
                                     token=site.env.get("METRICS_TOKEN", ""))
            helpers = [asyncio.ensure_future(sampled)]
            if config.capacity_events:
                helpers.append(asyncio.ensure_future(operate_capacity(
                    url, token, backend, list(config.capacity_events), per_replica, time.monotonic())))
            try:
                return await _with_progress(workload.run(), horizon, arm, progress)
            finally:
                for helper in helpers:
                    if helper.done() and not helper.cancelled() and helper.exception() is not None:
                        raise helper.exception()  # type: ignore[misc]
                    helper.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await helper

        return asyncio.run(both())
