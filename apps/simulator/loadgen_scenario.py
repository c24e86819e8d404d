"""A load generator scenario: its YAML read and checked (every error names the field, ``streams[1].rate``),
and the API keys its streams name resolved (a secret, ``env:VAR`` or ``entitlement:NAME`` from the demo's key
file). `apps.simulator.loadgen` runs it."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apps.simulator.workload import LengthSpec, RatePhase, WorkloadError

STREAM_FIELDS = {"name", "key", "rate", "concurrency", "arrival", "cv", "input", "output", "stream",
                 "phases", "endpoint", "start", "stop"}
SCENARIO_FIELDS = {"model", "duration", "seed", "streams", "timeout"}

class ScenarioError(ValueError):
    """A scenario that cannot be run; the message names the field (``streams[1].rate``)."""


@dataclass(frozen=True)
class StreamSpec:
    name: str
    key: str  # a secret, ``env:VAR`` or ``entitlement:NAME``; resolved by `key_resolve`
    rate: float
    concurrency: int
    input: LengthSpec
    output: LengthSpec
    stream: bool = False
    phases: tuple[RatePhase, ...] = ()
    arrival: str = "poisson"
    cv: float = 1.0
    endpoint: str = "chat"  # or "completions"
    start: float = 0.0
    stop: float | None = None


@dataclass(frozen=True)
class Scenario:
    streams: tuple[StreamSpec, ...]
    model: str = "demo-pool"
    duration: float = 60.0
    seed: int = 0
    timeout: float = 60.0  # seconds one request may take before it counts as an error


# ---- parsing -----------------------------------------------------------------------------------------
def _number(raw: Any, where: str, *, minimum: float = 0.0, integer: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise ScenarioError(f"{where}: expected a number, got {raw!r}")
    if raw < minimum:
        raise ScenarioError(f"{where}: must be at least {minimum:g}, got {raw!r}")
    if integer and int(raw) != raw:
        raise ScenarioError(f"{where}: expected a whole number, got {raw!r}")
    return float(raw)


def _unknown(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(raw) - allowed)
    if extra:
        # A typo (``concurency``) would otherwise silently fall back to a default.
        raise ScenarioError(f"{where}.{extra[0]}: unknown field (known: {', '.join(sorted(allowed))})")


def _phases(raw: Any, where: str) -> tuple[RatePhase, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ScenarioError(f"{where}: expected a list of {{at, rate}}, got {raw!r}")
    phases = []
    for i, item in enumerate(raw):
        here = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ScenarioError(f"{here}: expected a mapping with 'at' and 'rate', got {item!r}")
        _unknown(item, {"at", "rate"}, here)
        for name in ("at", "rate"):
            if name not in item:
                raise ScenarioError(f"{here}.{name}: missing")
        phases.append(RatePhase(_number(item["at"], f"{here}.at"), _number(item["rate"], f"{here}.rate")))
    return tuple(sorted(phases, key=lambda p: p.at))


def _length(raw: Any, where: str, default: int) -> LengthSpec:
    try:
        return LengthSpec.parse(default if raw is None else raw, where)
    except WorkloadError as error:
        raise ScenarioError(str(error)) from error


def stream_parse(raw: Any, where: str) -> StreamSpec:
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: expected a mapping, got {raw!r}")
    _unknown(raw, STREAM_FIELDS, where)
    key = raw.get("key")
    if not isinstance(key, str) or not key.strip():
        raise ScenarioError(f"{where}.key: expected a secret, 'env:VAR' or 'entitlement:NAME', got {key!r}")
    default_name = key.split(":", 1)[1] if key.startswith(("entitlement:", "env:")) else ""
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"{where}.name: give each stream a name (a literal key has none to borrow)")
    phases = _phases(raw.get("phases"), f"{where}.phases")
    rate = _number(raw.get("rate", 0.0), f"{where}.rate")
    if rate == 0 and not any(p.rate > 0 for p in phases):
        raise ScenarioError(f"{where}.rate: the stream never sends (rate 0 and no phase with a rate)")
    concurrency = int(_number(raw.get("concurrency", 16), f"{where}.concurrency", minimum=1, integer=True))
    arrival = raw.get("arrival", "poisson")
    if arrival not in ("poisson", "gamma"):
        raise ScenarioError(f"{where}.arrival: expected 'poisson' or 'gamma', got {arrival!r}")
    cv = _number(raw.get("cv", 1.0), f"{where}.cv")
    if cv <= 0:
        raise ScenarioError(f"{where}.cv: must be above 0, got {cv!r}")
    stream = raw.get("stream", False)
    if not isinstance(stream, bool):
        raise ScenarioError(f"{where}.stream: expected true or false, got {stream!r}")
    endpoint = raw.get("endpoint", "chat")
    if endpoint not in ("chat", "completions"):
        raise ScenarioError(f"{where}.endpoint: expected 'chat' or 'completions', got {endpoint!r}")
    start = _number(raw.get("start", 0.0), f"{where}.start")
    stop = None if raw.get("stop") is None else _number(raw["stop"], f"{where}.stop")
    return StreamSpec(
        name=name, key=key.strip(), rate=rate, concurrency=concurrency,
        input=_length(raw.get("input"), f"{where}.input", 64),
        output=_length(raw.get("output"), f"{where}.output", 64),
        stream=stream, phases=phases, arrival=arrival, cv=cv, endpoint=endpoint, start=start, stop=stop,
    )


def scenario_parse(raw: Any) -> Scenario:
    if not isinstance(raw, dict):
        raise ScenarioError(f"scenario: expected a mapping with 'streams', got {type(raw).__name__}")
    _unknown(raw, SCENARIO_FIELDS, "scenario")
    items = raw.get("streams")
    if not isinstance(items, list) or not items:
        raise ScenarioError("streams: expected a non-empty list of streams")
    streams = tuple(stream_parse(item, f"streams[{i}]") for i, item in enumerate(items))
    names = [s.name for s in streams]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ScenarioError(f"streams[{i}].name: {name!r} is used by another stream")
    model = raw.get("model", "demo-pool")
    if not isinstance(model, str) or not model:
        raise ScenarioError(f"model: expected a model or pool name, got {model!r}")
    duration = _number(raw.get("duration", 60.0), "duration")
    if duration <= 0:
        raise ScenarioError("duration: must be above 0")
    seed = int(_number(raw.get("seed", 0), "seed", integer=True))
    timeout = _number(raw.get("timeout", 60.0), "timeout")
    if timeout <= 0:
        raise ScenarioError("timeout: must be above 0")
    return Scenario(streams=streams, model=model, duration=duration, seed=seed, timeout=timeout)


def scenario_load(path: Path) -> Scenario:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ScenarioError(f"scenario: cannot read {path}: {error.strerror or error}") from error
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ScenarioError(f"scenario: {path} is not valid YAML: {error}") from error
    return scenario_parse(raw)


def key_resolve(ref: str, where: str, *, env: Mapping[str, str], keys_file: Path) -> str:
    """The secret a stream's `key` names: a literal secret, ``env:VAR`` or ``entitlement:NAME`` (read from the
    demo key file that ``seed_demo --write-keys`` writes)."""
    if ref.startswith("env:"):
        var = ref[4:]
        if not env.get(var):
            raise ScenarioError(f"{where}: environment variable {var} is not set")
        return env[var]
    if ref.startswith("entitlement:"):
        name = ref[len("entitlement:"):]
        try:
            keys = json.loads(keys_file.read_text(encoding="utf-8"))
        except OSError as error:
            raise ScenarioError(
                f"{where}: no key file {keys_file} ({error.strerror}); "
                "run `python manage.py seed_demo --write-keys var/demo-keys.json`"
            ) from error
        except ValueError as error:
            raise ScenarioError(f"{where}: {keys_file} is not JSON: {error}") from error
        if not isinstance(keys, dict) or not isinstance(keys.get(name), str):
            raise ScenarioError(f"{where}: no key for entitlement {name!r} in {keys_file}")
        return str(keys[name])
    return ref


def keys_resolve(scenario: Scenario, *, env: Mapping[str, str], keys_file: Path) -> dict[str, str]:
    return {
        s.name: key_resolve(s.key, f"streams[{i}].key", env=env, keys_file=keys_file)
        for i, s in enumerate(scenario.streams)
    }
