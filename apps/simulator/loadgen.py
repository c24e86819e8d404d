"""A small load generator for the live gateway (``python manage.py loadgen --scenario FILE``).

A scenario lists streams, each one API key with an open-loop request rate (Poisson or bursty gamma, with
rate phases), token lengths, a client-side concurrency cap and streaming on or off. Arrival times and lengths
come from the simulator's own workload code (`apps.simulator.workload` run on its event loop), so a seed
gives the same requests here as in virtual time; this module only sends them as real HTTP requests (the
scenario file is read and checked in `apps.simulator.loadgen_scenario`).

A 429 is obeyed, not hammered: the stream sends nothing until its `Retry-After` has passed, and the arrivals
that fall in that window are counted as *held*. Arrivals that find the stream's cap of requests in flight
are counted as *capped*; neither kind is queued, so the load stays open loop and memory stays flat.

Plain Python plus httpx: no Django, so it also runs outside the project's settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from apps.simulator.engine import EventLoop
from apps.simulator.loadgen_scenario import Scenario, ScenarioError, StreamSpec, keys_resolve, scenario_load
from apps.simulator.workload import TenantSpec, Workload
from backends.virtual_vllm.instance import SimRequest

NO_RETRY_AFTER_PAUSE_S = 1.0  # a 429 without Retry-After still pauses the stream this long


class Writer(Protocol):
    """Where progress and the summary go: a text file, or a management command's OutputWrapper."""

    def write(self, text: str, /) -> Any: ...

    def flush(self) -> Any: ...


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds since the run (or the current cycle) started
    stream: str
    input_tokens: int
    output_tokens: int




# ---- arrivals ----------------------------------------------------------------------------------------
class _Collector:
    """Stands in for the simulator's gateway: it only records what the workload submits."""

    def __init__(self) -> None:
        self.requests: list[SimRequest] = []

    def submit(self, request: SimRequest) -> None:
        self.requests.append(request)


def arrivals(scenario: Scenario, *, duration: float, seed: int) -> list[Arrival]:
    """Every request of one run of `duration` seconds, in time order, drawn by the simulator's workload."""
    tenants = [
        TenantSpec(
            name=s.name, rate=s.rate, arrival=s.arrival, cv=s.cv, input=s.input, output=s.output,
            start=s.start, stop=duration if s.stop is None else min(s.stop, duration), phases=s.phases,
        )
        for s in scenario.streams
    ]
    loop = EventLoop()
    collector = _Collector()
    workload = Workload(loop, collector, tenants, seed)
    workload.start()
    loop.run(until=duration)
    return [
        Arrival(r.arrival, r.tenant, r.prompt_tokens, r.output_tokens)
        for r in collector.requests
        if r.arrival < duration
    ]


# ---- the run -----------------------------------------------------------------------------------------
@dataclass
class StreamStats:
    sent: int = 0
    ok: int = 0
    rejected: int = 0  # 429s
    errors: int = 0  # other statuses, timeouts, refused connections
    capped: int = 0  # not sent: the stream's concurrency cap was reached
    held: int = 0  # not sent: inside a 429's Retry-After window
    in_flight: int = 0
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)  # x-tokenpools-reject-reason of the 429s
    paused_until: float = 0.0

    def percentile(self, q: float) -> float | None:
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def retry_after_s(headers: httpx.Headers) -> float:
    """How long a 429 asks the client to wait: `retry-after-ms` when present (finer), else `Retry-After`."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue  # an HTTP date: rare from a gateway, and the fallback pause is safe
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
    return NO_RETRY_AFTER_PAUSE_S


def request_body(scenario: Scenario, spec: StreamSpec, arrival: Arrival) -> tuple[str, dict[str, Any]]:
    # One word per prompt token: the virtual vLLM's tokenizer counts words, real ones come close enough.
    prompt = " ".join(["hello"] * max(1, arrival.input_tokens))
    body: dict[str, Any] = {"model": scenario.model, "max_tokens": arrival.output_tokens, "stream": spec.stream}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _usage_tokens(data: Any) -> int:
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else 0


class LoadGenerator:
    def __init__(
        self,
        scenario: Scenario,
        keys: Mapping[str, str],
        *,
        url: str,
        duration: float,
        seed: int,
        repeat: bool = False,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.scenario = scenario
        self.specs = {s.name: s for s in scenario.streams}
        self.keys = dict(keys)
        self.url = url.rstrip("/")
        self.duration = duration
        self.seed = seed
        self.repeat = repeat
        self.clock = clock
        self.transport = transport
        self.stats = {s.name: StreamStats() for s in scenario.streams}
        self.stop = asyncio.Event()
        self.started = 0.0
        self.cycles = 0

    def _schedule(self) -> Iterator[tuple[float, Arrival]]:
        """(offset since start, arrival) for one run, or cycle after cycle with `repeat` (each cycle with
        its own seed, so a long demo is not the same minute over and over)."""
        cycle = 0
        while True:
            for arrival in arrivals(self.scenario, duration=self.duration, seed=self.seed + cycle):
                yield cycle * self.duration + arrival.at, arrival
            cycle += 1
            self.cycles = cycle
            if not self.repeat:
                return

    async def run(self, progress: Writer | None = None, progress_every_s: float = 1.0) -> dict[str, StreamStats]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.scenario.timeout, connect=10.0)
        self.started = self.clock()
        tasks: set[asyncio.Task[None]] = set()
        reporter = asyncio.create_task(self._report(progress, progress_every_s)) if progress else None
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits,
                                     transport=self.transport) as client:
            try:
                for offset, arrival in self._schedule():
                    delay = self.started + offset - self.clock()
                    if delay > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.stop.wait(), timeout=delay)
                    if self.stop.is_set():
                        break
                    self._dispatch(client, arrival, tasks)
                if tasks and not self.stop.is_set():
                    # Let the requests still out finish (each is bounded by the request timeout).
                    waiter = asyncio.ensure_future(asyncio.wait(set(tasks)))
                    stopper = asyncio.ensure_future(self.stop.wait())
                    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    stopper.cancel()
                    waiter.cancel()
            finally:
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                if reporter is not None:
                    reporter.cancel()
                    await asyncio.gather(reporter, return_exceptions=True)
        if progress is not None:
            progress.write(self.progress_line() + "\n")
            progress.flush()
        return self.stats

    def _dispatch(self, client: httpx.AsyncClient, arrival: Arrival, tasks: set[asyncio.Task[None]]) -> None:
        stats = self.stats[arrival.stream]
        spec = self.specs[arrival.stream]
        if self.clock() < stats.paused_until:
            stats.held += 1
            return
        if stats.in_flight >= spec.concurrency:
            stats.capped += 1
            return
        stats.sent += 1
        stats.in_flight += 1
        task = asyncio.create_task(self._send(client, spec, stats, arrival))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _send(self, client: httpx.AsyncClient, spec: StreamSpec, stats: StreamStats, arrival: Arrival) -> None:
        path, body = request_body(self.scenario, spec, arrival)
        headers = {"Authorization": f"Bearer {self.keys[spec.name]}"}
        began = self.clock()
        try:
            async with client.stream("POST", path, json=body, headers=headers) as response:
                status = response.status_code
                stats.statuses[status] = stats.statuses.get(status, 0) + 1
                if status == 429:
                    stats.rejected += 1
                    reason = response.headers.get("x-tokenpools-reject-reason", "unknown")
                    stats.reasons[reason] = stats.reasons.get(reason, 0) + 1
                    stats.paused_until = max(stats.paused_until, self.clock() + retry_after_s(response.headers))
                    await response.aread()
                    return
                if status != 200:
                    stats.errors += 1
                    await response.aread()
                    return
                tokens = await (self._read_stream(response) if spec.stream else self._read_json(response))
            stats.ok += 1
            stats.output_tokens += tokens
            stats.latencies.append(self.clock() - began)
        except (httpx.HTTPError, ValueError):
            stats.errors += 1
        finally:
            stats.in_flight -= 1

    @staticmethod
    async def _read_json(response: httpx.Response) -> int:
        return _usage_tokens(json.loads(await response.aread()))

    @staticmethod
    async def _read_stream(response: httpx.Response) -> int:
        tokens = 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            tokens = _usage_tokens(json.loads(data)) or tokens
        return tokens

    async def _report(self, out: Writer, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            out.write(self.progress_line() + "\n")
            out.flush()

    def elapsed(self) -> float:
        return self.clock() - self.started

    def progress_line(self) -> str:
        parts = [
            f"{name} {s.sent}/{s.ok}/{s.rejected}/{s.errors}" + (f" ({s.in_flight} out)" if s.in_flight else "")
            for name, s in self.stats.items()
        ]
        return f"[{self.elapsed():6.1f}s] sent/ok/429/err  " + " | ".join(parts)


def summary_table(stats: Mapping[str, StreamStats], elapsed: float) -> str:
    header = ("stream", "sent", "ok", "429", "errors", "capped", "held", "ok/s", "tok/s", "p50 s", "p95 s")
    rows = [header]
    for name, s in stats.items():
        p50, p95 = s.percentile(0.5), s.percentile(0.95)
        rows.append((
            name, str(s.sent), str(s.ok), str(s.rejected), str(s.errors), str(s.capped), str(s.held),
            f"{s.ok / elapsed:.2f}" if elapsed > 0 else "-",
            f"{s.output_tokens / elapsed:.0f}" if elapsed > 0 else "-",
            "-" if p50 is None else f"{p50:.2f}", "-" if p95 is None else f"{p95:.2f}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    reasons = [f"  {name}: " + ", ".join(f"{r} {n}" for r, n in sorted(s.reasons.items()))
               for name, s in stats.items() if s.reasons]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths,
                                                                                                    strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if reasons:
        lines += ["429 reasons:", *reasons]
    lines.append(f"{elapsed:.1f}s; capped = cap of requests in flight reached, held = inside a 429's Retry-After"
                 " (neither was sent)")
    return "\n".join(lines)


def main(
    *,
    scenario_path: Path,
    url: str,
    duration: float | None,
    seed: int | None,
    keys_file: Path,
    repeat: bool,
    stdout: Writer,
    stderr: Writer,
    env: Mapping[str, str] | None = None,
) -> int:
    """Load, resolve keys, run until the scenario ends (or SIGINT/SIGTERM), print the summary. Exit codes:
    0 after a run (stopped early included), 2 for a scenario that cannot run (the message names the field)."""
    import signal

    try:
        scenario = scenario_load(scenario_path)
        if duration is not None and duration <= 0:
            raise ScenarioError(f"--duration: must be above 0, got {duration:g}")
        keys = keys_resolve(scenario, env=os.environ if env is None else env, keys_file=keys_file)
    except ScenarioError as error:
        stderr.write(f"loadgen: error: {scenario_path}: {error}\n")
        return 2
    generator = LoadGenerator(
        scenario, keys, url=url, duration=duration or scenario.duration,
        seed=scenario.seed if seed is None else seed, repeat=repeat,
    )
    stderr.write(
        f"loadgen: {len(scenario.streams)} stream(s) -> {url} for "
        f"{'ever (repeating ' if repeat else ''}{generator.duration:g}s{')' if repeat else ''}; Ctrl-C stops\n"
    )

    async def go() -> None:
        loop = asyncio.get_running_loop()
        # Ctrl-C and SIGTERM (a launcher stopping us) both end the run the same clean way: stop sending,
        # cancel what is in flight, print the summary.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, generator.stop.set)
        await generator.run(progress=stderr)

    asyncio.run(go())
    stdout.write(summary_table(generator.stats, generator.elapsed()) + "\n")
    stdout.flush()
    return 0
