"""Scenario files (YAML): cluster, admission, tenants and capacity events, validated with messages that name
the offending field. See `apps/simulator/scenarios/*.yaml` for complete examples.

```yaml
name: example
seed: 7
horizon_s: 90                  # optional: stop at this virtual time
num_requests: 5000             # optional: stop generating after this many requests
cluster: {num_instances: 1, max_num_seqs: 16, latency_model: fixed, decode_ms_per_token: 66.7}
admission: {policy: token-pools, tick_s: 1.0}     # or a BLIS policy bundle: {policy: tier-shed, ...}
tenants:
  - name: guaranteed-a
    slo_class: critical
    slo_target_ms: 1000
    rate: 1.4                  # open loop; or `concurrency: 6` for closed-loop clients
    input: 64                  # or {dist: lognormal, mean: 512, sigma: 0.6, min: 8, max: 4096}
    output: {dist: uniform, min: 32, max: 176}
    start: 0
    stop: 90
    entitlement: {service_class: guaranteed, concurrency: 6}   # apps.policy.EntitlementLimits' fields, e.g.
                               # queue_max: 2, queue_max_wait_ms: 500 (absent: the class's default queue)
capacity_events:
  - {at: 30, remove: [1]}
  - {at: 120, restore: [1]}
  - {at: 40, slots: 8, instances: [0]}
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from apps.policy.errors import PolicyConfigError
from apps.simulator.admission import entitlement_limits
from apps.simulator.simulation import CapacityEvent, SimConfig
from apps.simulator.workload import LengthSpec, RatePhase, TenantSpec, WorkloadError


class ScenarioError(ValueError):
    """A scenario or policy file that cannot be used; the message names the file and the field."""


@dataclass
class Scenario:
    name: str
    config: SimConfig
    admission: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)


_CLUSTER_FIELDS = {
    "model": str,
    "gpu": str,
    "latency_model": str,
    "prefill_ms_per_token": float,
    "decode_ms_per_token": float,
    "hardware_file": str,
    "tensor_parallel": int,
    "num_instances": int,
    "max_num_seqs": int,
    "kv_blocks": int,
    "block_size": int,
    "max_batched_tokens": int,
    "routing": str,
}
_TENANT_KEYS = {
    "name", "slo_class", "rate", "concurrency", "arrival", "cv", "input", "output", "start", "stop", "phases",
    "think_time_s", "retries", "retry_backoff_s", "slo_target_ms", "entitlement",
}  # fmt: skip


def _number(
    value: Any, where: str, *, kind: type = float, minimum: float | None = None, positive: bool = False
) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(f"{where}: expected a number, got {value!r}")
    if kind is int and int(value) != value:
        raise ScenarioError(f"{where}: expected an integer, got {value!r}")
    if not math.isfinite(value):
        raise ScenarioError(f"{where}: must be finite, got {value!r}")
    if positive and value <= 0:
        raise ScenarioError(f"{where}: must be positive, got {value!r}")
    if minimum is not None and value < minimum:
        raise ScenarioError(f"{where}: must be >= {minimum}, got {value!r}")
    return kind(value)


def parse_tenant(raw: Any, index: int) -> TenantSpec:
    where = f"tenants[{index}]"
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: expected a mapping, got {raw!r}")
    unknown = set(raw) - _TENANT_KEYS
    if unknown:
        raise ScenarioError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_TENANT_KEYS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"{where}.name: a non-empty string is required")
    where = f"tenants[{name}]"
    try:
        input_spec = LengthSpec.parse(raw.get("input", 512), f"{where}.input")
        output_spec = LengthSpec.parse(raw.get("output", 128), f"{where}.output")
    except WorkloadError as error:
        raise ScenarioError(str(error)) from None
    rate = _number(raw.get("rate", 0.0), f"{where}.rate", minimum=0)
    concurrency = _number(raw.get("concurrency", 0), f"{where}.concurrency", kind=int, minimum=0)
    phases_raw = raw.get("phases") or []
    if not isinstance(phases_raw, list):
        raise ScenarioError(f"{where}.phases: expected a list of {{at, rate}}")
    phases = []
    for number, phase in enumerate(phases_raw):
        if not isinstance(phase, dict) or set(phase) != {"at", "rate"}:
            raise ScenarioError(f"{where}.phases[{number}]: expected {{at: seconds, rate: requests/s}}")
        phases.append(
            RatePhase(
                _number(phase["at"], f"{where}.phases[{number}].at", minimum=0),
                _number(phase["rate"], f"{where}.phases[{number}].rate", minimum=0),
            )
        )
    if rate == 0 and concurrency == 0 and not phases:
        raise ScenarioError(f"{where}: give a rate (open loop), phases, or a concurrency (closed loop)")
    arrival = str(raw.get("arrival", "poisson")).lower()
    if arrival not in ("poisson", "gamma"):
        raise ScenarioError(f"{where}.arrival: expected poisson or gamma, got {arrival!r}")
    start = _number(raw.get("start", 0.0), f"{where}.start", minimum=0)
    stop = raw.get("stop")
    if stop is not None:
        stop = _number(stop, f"{where}.stop", minimum=0)
        if stop <= start:
            raise ScenarioError(f"{where}: stop ({stop}) must come after start ({start})")
    entitlement = raw.get("entitlement") or {}
    if not isinstance(entitlement, dict):
        raise ScenarioError(f"{where}.entitlement: expected a mapping")
    slo_target = raw.get("slo_target_ms")
    tenant = TenantSpec(
        name=name,
        slo_class=str(raw.get("slo_class", "standard")),
        rate=rate,
        concurrency=concurrency,
        arrival=arrival,
        cv=_number(raw.get("cv", 1.0), f"{where}.cv", positive=True),
        input=input_spec,
        output=output_spec,
        start=start,
        stop=stop,
        phases=tuple(sorted(phases, key=lambda p: p.at)),
        think_time_s=_number(raw.get("think_time_s", 0.0), f"{where}.think_time_s", minimum=0),
        retries=_number(raw.get("retries", 0), f"{where}.retries", kind=int, minimum=0),
        retry_backoff_s=_number(raw.get("retry_backoff_s", 1.0), f"{where}.retry_backoff_s", positive=True),
        slo_target_ms=None
        if slo_target is None
        else _number(slo_target, f"{where}.slo_target_ms", positive=True),
        entitlement=dict(entitlement),
    )
    try:  # the entitlement the token-pools admission will build, checked here so the error names the tenant
        entitlement_limits(tenant)
    except PolicyConfigError as error:
        raise ScenarioError(f"{where}.entitlement: {error}") from None
    return tenant


def parse_capacity_event(raw: Any, index: int, num_instances: int) -> CapacityEvent:
    where = f"capacity_events[{index}]"
    if not isinstance(raw, dict) or "at" not in raw:
        raise ScenarioError(f"{where}: expected a mapping with 'at' and one of remove/restore/slots")
    at = _number(raw["at"], f"{where}.at", minimum=0)
    actions = [key for key in ("remove", "restore", "slots") if key in raw]
    if len(actions) != 1:
        raise ScenarioError(f"{where}: give exactly one of remove, restore, slots")
    action = actions[0]
    targets = raw.get("instances", list(range(num_instances))) if action == "slots" else raw[action]
    if not isinstance(targets, list) or not targets:
        raise ScenarioError(f"{where}: instances must be a non-empty list of indexes")
    indexes = tuple(_number(t, f"{where}.instances", kind=int, minimum=0) for t in targets)
    for target in indexes:
        if target >= num_instances:
            raise ScenarioError(f"{where}: instance {target} does not exist (num_instances={num_instances})")
    slots = _number(raw["slots"], f"{where}.slots", kind=int, minimum=1) if action == "slots" else 0
    return CapacityEvent(at, action, indexes, slots)


def read_yaml(path: str | Path, what: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ScenarioError(f"cannot read {what} {path}: {error.strerror or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ScenarioError(f"{what} {path} is not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{what} {path}: the top level must be a mapping")
    return data


SCENARIO_KEYS = frozenset({
    "name", "description", "seed", "horizon_s", "num_requests", "cluster", "admission", "tenants",
    "capacity_events", "sample_interval_s",
})  # fmt: skip


def parse_scenario(data: dict[str, Any], source: str = "<scenario>") -> Scenario:
    allowed = SCENARIO_KEYS
    unknown = set(data) - allowed
    try:
        if unknown:
            raise ScenarioError(f"unknown top-level keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        config = SimConfig()
        cluster = data.get("cluster") or {}
        if not isinstance(cluster, dict):
            raise ScenarioError("cluster: expected a mapping")
        extra_cluster = {"admission_latency_ms", "routing_latency_ms"}
        for key, value in cluster.items():
            if key in extra_cluster:
                setattr(config, key.replace("_ms", "_s"), _number(value, f"cluster.{key}", minimum=0) / 1000)
                continue
            kind = _CLUSTER_FIELDS.get(key)
            if kind is None:
                raise ScenarioError(
                    f"cluster.{key}: unknown key; allowed: {sorted({*_CLUSTER_FIELDS, *extra_cluster})}"
                )
            if kind is str:
                if not isinstance(value, str):
                    raise ScenarioError(f"cluster.{key}: expected a string, got {value!r}")
                setattr(config, key, value)
            else:
                setattr(config, key, _number(value, f"cluster.{key}", kind=kind, positive=kind is int))
        if config.latency_model not in ("roofline", "fixed"):
            raise ScenarioError(
                f"cluster.latency_model: expected roofline or fixed, got {config.latency_model!r}"
            )
        if config.routing not in ("round-robin", "least-loaded", "kv-aware"):
            raise ScenarioError(
                f"cluster.routing: expected round-robin, least-loaded or kv-aware, got {config.routing!r}"
            )
        if "seed" in data:
            config.seed = _number(data["seed"], "seed", kind=int)
        if data.get("horizon_s") is not None:
            config.horizon_s = _number(data["horizon_s"], "horizon_s", positive=True)
        if data.get("num_requests") is not None:
            config.num_requests = _number(data["num_requests"], "num_requests", kind=int, positive=True)
        if data.get("sample_interval_s") is not None:
            config.sample_interval_s = _number(data["sample_interval_s"], "sample_interval_s", positive=True)
        tenants_raw = data.get("tenants")
        if not isinstance(tenants_raw, list) or not tenants_raw:
            raise ScenarioError("tenants: a non-empty list is required")
        config.tenants = [parse_tenant(raw, index) for index, raw in enumerate(tenants_raw)]
        names = [t.name for t in config.tenants]
        if len(set(names)) != len(names):
            raise ScenarioError(f"tenants: names must be unique, got {names}")
        events_raw = data.get("capacity_events") or []
        if not isinstance(events_raw, list):
            raise ScenarioError("capacity_events: expected a list")
        config.capacity_events = [
            parse_capacity_event(raw, index, config.num_instances) for index, raw in enumerate(events_raw)
        ]
        admission = data.get("admission") or {}
        if not isinstance(admission, dict):
            raise ScenarioError("admission: expected a mapping")
        if config.horizon_s is None and config.num_requests is None:
            endless = [t.name for t in config.tenants if t.stop is None]
            if endless:
                raise ScenarioError(
                    f"tenants {endless} never stop: set horizon_s, num_requests or their stop times"
                )
    except ScenarioError as error:
        raise ScenarioError(f"{source}: {error}") from None
    return Scenario(str(data.get("name") or Path(source).stem), config, dict(admission), data)


def load_scenario(path: str | Path) -> Scenario:
    return parse_scenario(read_yaml(path, "scenario file"), str(path))


def config_field_names() -> set[str]:
    return {f.name for f in fields(SimConfig)}
