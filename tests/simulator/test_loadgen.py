"""The load generator (apps.simulator.loadgen, `manage.py loadgen`): scenario parsing names the bad field
and exits 2, arrivals come from the simulator's seeded workload, 429s pause the stream for their Retry-After,
and a run against a real virtual vLLM server counts every request it sent."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.simulator.loadgen import LoadGenerator, arrivals, retry_after_s, summary_table
from apps.simulator.loadgen_scenario import ScenarioError, key_resolve, scenario_parse
from tests.gateway.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "loadgen" / "demo.yaml"


def stream(**extra: Any) -> dict[str, Any]:
    return {"name": "s", "key": "tp-secret", "rate": 5.0, **extra}


# ---- parsing -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"streams": []}, "streams"),
        ({"streams": [stream(rate="fast")]}, "streams[0].rate"),
        ({"streams": [stream(rate=-1)]}, "streams[0].rate"),
        ({"streams": [stream(rate=0)]}, "streams[0].rate"),
        ({"streams": [stream(concurency=4)]}, "streams[0].concurency"),
        ({"streams": [stream(concurrency=0)]}, "streams[0].concurrency"),
        ({"streams": [stream(output={"dist": "lognormal", "mean": -3})]}, "streams[0].output"),
        ({"streams": [stream(stream="yes")]}, "streams[0].stream"),
        ({"streams": [stream(phases=[{"at": 5}])]}, "streams[0].phases[0].rate"),
        ({"streams": [stream(), stream()]}, "streams[1].name"),
        ({"streams": [{"key": "tp-literal", "rate": 1}]}, "streams[0].name"),
        ({"streams": [stream()], "duration": 0}, "duration"),
    ],
)
def test_bad_scenarios_name_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        scenario_parse(raw)
    assert str(caught.value).startswith(field), str(caught.value)


def test_demo_scenario_parses_and_spot_bursts_between_20_and_60_s() -> None:
    import yaml

    scenario = scenario_parse(yaml.safe_load(DEMO.read_text()))
    names = [s.name for s in scenario.streams]
    assert names == ["acme-guaranteed", "acme-elastic", "globex-spot"]  # named after their entitlements
    timeline = arrivals(scenario, duration=scenario.duration, seed=scenario.seed)
    spot = [a.at for a in timeline if a.stream == "globex-spot"]
    burst = sum(20 <= t < 60 for t in spot) / 40
    quiet = sum(t < 20 or t >= 60 for t in spot) / 50
    # 16 slots at 20 ms a step hold about 6 requests/s of 128 tokens: the burst must be well above that.
    assert burst > 10 and quiet < 1, (burst, quiet)


def test_arrivals_are_seeded_and_honour_phases() -> None:
    scenario = scenario_parse({"streams": [
        stream(name="a", rate=20, input={"dist": "lognormal", "mean": 50, "sigma": 0.5}),
        stream(name="b", rate=0, phases=[{"at": 5, "rate": 10}]),
    ]})
    first = arrivals(scenario, duration=10, seed=3)
    assert first == arrivals(scenario, duration=10, seed=3)
    assert first != arrivals(scenario, duration=10, seed=4)
    assert all(first[i].at <= first[i + 1].at for i in range(len(first) - 1))
    assert all(a.at >= 5 for a in first if a.stream == "b")
    assert 120 < sum(a.stream == "a" for a in first) < 280  # Poisson(200)
    assert len({a.input_tokens for a in first if a.stream == "a"}) > 10  # lognormal, not fixed


def test_keys_resolve_from_env_and_the_demo_key_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "demo-keys.json"
    keys_file.write_text(json.dumps({"acme-guaranteed": "tp-from-file"}))
    assert key_resolve("entitlement:acme-guaranteed", "k", env={}, keys_file=keys_file) == "tp-from-file"
    assert key_resolve("env:MY_KEY", "k", env={"MY_KEY": "tp-env"}, keys_file=keys_file) == "tp-env"
    assert key_resolve("tp-literal", "k", env={}, keys_file=keys_file) == "tp-literal"
    with pytest.raises(ScenarioError, match="streams\\[0\\].key: no key for entitlement 'globex-spot'"):
        key_resolve("entitlement:globex-spot", "streams[0].key", env={}, keys_file=keys_file)
    with pytest.raises(ScenarioError, match="MISSING is not set"):
        key_resolve("env:MISSING", "k", env={}, keys_file=keys_file)
    with pytest.raises(ScenarioError, match="seed_demo --write-keys"):
        key_resolve("entitlement:x", "k", env={}, keys_file=tmp_path / "absent.json")


def test_retry_after_prefers_milliseconds_and_falls_back() -> None:
    assert retry_after_s(httpx.Headers({"retry-after": "2", "retry-after-ms": "350"})) == pytest.approx(0.35)
    assert retry_after_s(httpx.Headers({"retry-after": "3"})) == 3.0
    assert retry_after_s(httpx.Headers({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 1.0
    assert retry_after_s(httpx.Headers({})) == 1.0


# ---- 429 handling against a fake gateway ---------------------------------------------------------------
def test_429_pauses_the_stream_for_its_retry_after_instead_of_hammering() -> None:
    seen: list[float] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        seen.append(time.monotonic())
        assert request.headers["authorization"] == "Bearer tp-spot"
        return httpx.Response(429, headers={"retry-after": "1", "retry-after-ms": "800",
                                            "x-tokenpools-reject-reason": "pool_contended"},
                              json={"error": {"code": "pool_contended"}})

    scenario = scenario_parse({"streams": [stream(name="spot", key="tp-spot", rate=50)]})
    generator = LoadGenerator(scenario, {"spot": "tp-spot"}, url="http://gateway", duration=2.0, seed=1,
                              transport=httpx.MockTransport(gateway))
    stats = asyncio.run(generator.run())["spot"]
    # About 100 arrivals in 2 s, but after each 429 the stream waits 0.8 s: at most 3 requests go out.
    assert 1 <= stats.sent == stats.rejected == len(seen) <= 3, stats
    assert stats.held >= 60 and stats.ok == stats.errors == 0
    assert all(b - a >= 0.75 for a, b in zip(seen, seen[1:], strict=False)), seen
    assert stats.reasons == {"pool_contended": stats.rejected}
    assert "pool_contended" in summary_table({"spot": stats}, 2.0)


def test_concurrency_cap_and_errors_are_counted() -> None:
    async def slow_gateway(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["max_tokens"] == 13:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        await asyncio.sleep(0.5)
        return httpx.Response(200, json={"usage": {"completion_tokens": body["max_tokens"]}})

    scenario = scenario_parse({"streams": [stream(name="a", rate=40, concurrency=2, output=7),
                                           stream(name="b", rate=5, output=13)]})
    generator = LoadGenerator(scenario, {"a": "k1", "b": "k2"}, url="http://gateway", duration=1.0, seed=2,
                              transport=httpx.MockTransport(slow_gateway))
    stats = asyncio.run(generator.run())
    a, b = stats["a"], stats["b"]
    assert a.sent <= 6 and a.capped > 20 and a.ok == a.sent and a.output_tokens == 7 * a.ok, a
    assert b.sent >= 1 and b.errors == b.sent and b.ok == 0 and b.statuses == {500: b.sent}, b


def test_stop_ends_a_run_early_and_cancels_what_is_in_flight() -> None:
    async def hanging_gateway(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(60)
        return httpx.Response(200, json={})

    scenario = scenario_parse({"streams": [stream(name="a", rate=20)]})
    generator = LoadGenerator(scenario, {"a": "k"}, url="http://gateway", duration=30.0, seed=1,
                              transport=httpx.MockTransport(hanging_gateway))

    async def go() -> float:
        asyncio.get_running_loop().call_later(0.5, generator.stop.set)
        began = time.monotonic()
        await generator.run()
        return time.monotonic() - began

    assert asyncio.run(go()) < 3.0
    assert generator.stats["a"].sent > 0 and generator.stats["a"].in_flight == 0


# ---- real HTTP: the virtual vLLM, and the command's exit codes -------------------------------------------
@pytest.fixture
def virtual_vllm() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "manage.py", "virtual_vllm", "--port", str(port), "--max-num-seqs", "4",
         "--served-model-name", "demo-model", "--decode-ms-per-token", "5"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "virtual vLLM did not start"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def loadgen(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "manage.py", "loadgen", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.slow
def test_loadgen_command_against_the_virtual_vllm(virtual_vllm: str, tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.yaml"
    # The virtual vLLM ignores keys; what is checked is that each stream's requests go out and come back.
    scenario.write_text(
        "model: demo-model\nduration: 3\nseed: 5\nstreams:\n"
        "  - {name: chat, key: tp-one, rate: 6, input: 20, output: 8, stream: true}\n"
        "  - {name: plain, key: tp-two, rate: 4, input: 10, output: 5, endpoint: completions}\n"
    )
    done = loadgen("--scenario", str(scenario), "--url", virtual_vllm)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line.startswith(("chat", "plain"))}
    for name, tokens in (("chat", 8), ("plain", 5)):
        _, sent, ok, rejected, errors, _capped, _held, _ok_s, tok_s, *_ = rows[name]
        assert int(sent) == int(ok) >= 3 and rejected == errors == "0", rows[name]
        # Output tokens are counted from the usage (streamed too): `tokens` a request over a run of ~3-6 s.
        assert tokens * int(ok) / 7 < float(tok_s) <= tokens * int(ok) / 3, rows[name]
    # The progress line comes once a second on stderr, naming every stream.
    progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(progress) >= 3 and all("chat " in line and "plain " in line for line in progress)
    assert "HTTP Request" not in done.stderr  # httpx's own per-request logging is silenced


def test_loadgen_command_exits_2_naming_the_field(tmp_path: Path) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("streams:\n  - {name: a, key: tp-x, rate: 1, output: {dist: weibull}}\n")
    done = loadgen("--scenario", str(scenario), "--url", "http://127.0.0.1:9")
    assert done.returncode == 2 and "streams[0].output" in done.stderr and "weibull" in done.stderr
    missing_key = tmp_path / "keys.yaml"
    missing_key.write_text("streams:\n  - {key: 'entitlement:acme-guaranteed', rate: 1}\n")
    done = loadgen("--scenario", str(missing_key), "--keys-file", str(tmp_path / "none.json"))
    assert done.returncode == 2 and "streams[0].key" in done.stderr
    done = loadgen("--scenario", str(tmp_path / "absent.yaml"))
    assert done.returncode == 2 and "cannot read" in done.stderr


@pytest.mark.slow
def test_ctrl_c_stops_the_command_cleanly_with_its_summary(virtual_vllm: str, tmp_path: Path) -> None:
    import signal

    scenario = tmp_path / "long.yaml"
    scenario.write_text("model: demo-model\nduration: 300\nstreams:\n"
                        "  - {name: long, key: tp-x, rate: 5, output: 400, stream: true}\n")
    process = subprocess.Popen([sys.executable, "manage.py", "loadgen", "--scenario", str(scenario), "--url",
                                virtual_vllm], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(4)  # past start-up, with streams in flight (400 tokens at 5 ms a step take 2 s)
    began = time.monotonic()
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err[-2000:]
    assert time.monotonic() - began < 10  # in-flight streams are cancelled, not waited for
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    row = next(line.split() for line in out.splitlines() if line.startswith("long"))
    assert int(row[1]) >= 5, out
