"""Seed 002's AIMD sweep on the token-pools state machine: what the gateway runs since its dispatch budget became
a check of the one machine (issue 23), beside the seed's own DRR gate that `apps.simulator.experiment_seed002`
keeps.

The load and the controller are the AIMD experiment's (`experiment_seed002.aimd_config`); the tenants hold elastic
entitlements without limits of their own, and the controller's cap (per worker there, two workers) becomes the
pool's budget (`TokenPoolsAdmission` with `admission.aimd`). The machine waits only where the budget binds and
refuses at the pool's capacity (seed 000), so its p99 is not the DRR gate's: the report says what it is.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from apps.simulator.simulation import SimConfig, Simulation, percentile


def machine_scenario(config: SimConfig, admission: dict[str, Any]) -> tuple[SimConfig, dict[str, Any]]:
    """The AIMD experiment's config and DRR admission as the token-pools machine runs them."""
    workers = int(admission.get("workers", 1))
    tenants = [replace(tenant, entitlement={"service_class": "elastic"}) for tenant in config.tenants]
    spec: dict[str, Any] = {"policy": "token-pools", "wait_timeout_s": float(admission.get("acquire_timeout_s", 1.0))}
    aimd = admission.get("aimd")
    if aimd:
        per_pool = {key: value for key, value in aimd.items() if key != "enabled"}
        for key in ("cap_per_worker_min", "cap_per_worker_max", "cap_per_worker_initial"):
            if per_pool.get(key) is not None:
                per_pool[key] = int(per_pool[key]) * workers
        spec["aimd"] = per_pool
    return replace(config, tenants=tenants), spec


def machine_point(simulation: Simulation, tail_s: float, lower: float, upper: float) -> dict[str, Any]:
    horizon = simulation.loop.time
    tail = [ttft for when, _, ttft, _ in simulation.finished if when >= horizon - tail_s]
    admission: Any = simulation.cluster.admission
    caps = [cap for when, cap, _ in admission.budget_samples if when > horizon - tail_s]
    stats = simulation.cluster.stats
    tail_p99 = percentile(tail, 99)
    return {
        "ttft_p99_tail_s": tail_p99,
        "tail_in_band": tail_p99 is not None and lower <= tail_p99 <= upper,
        "tail_cap_min": min(caps) if caps else None,
        "tail_cap_max": max(caps) if caps else None,
        "decreases": sum(1 for _, _, action in admission.budget_samples if action == "decrease"),
        "completed": stats.completed,
        "rejected": stats.rejected,
        "expired": stats.lost.get("expired", 0),
        "output_tokens_per_s": sum(i.output_tokens for i in simulation.cluster.instances) / horizon,
    }


def machine_table(points: dict[int, dict[str, Any]], fmt: Any) -> list[str]:
    """The report's table of the machine's arm (`fmt` formats a number as the report does)."""
    lines = [
        "",
        "The same load on the token-pools state machine, what the gateway runs since its dispatch budget became a "
        "check of the one machine (issue 23): elastic entitlements, the controller's cap x 2 workers as the pool's "
        "budget. The machine waits only while the budget (not the capacity) is full, up to the 1 s acquire timeout, "
        "and refuses at the pool's 256 slots (`pool_contended`), so its p99 does not climb to the 2 s target the "
        "seed's queue reaches: the controller then holds or grows the budget.",
        "",
        "| cap per worker (initial) | p99 TTFT tail (s) | tail in band | budget in tail (min..max) | decreases "
        "| completed | refused | waits expired | tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cap, point in points.items():
        lines.append(
            f"| {cap} | {fmt(point['ttft_p99_tail_s'])} | {'yes' if point['tail_in_band'] else 'no'} "
            f"| {fmt(point['tail_cap_min'])}..{fmt(point['tail_cap_max'])} | {point['decreases']} "
            f"| {point['completed']} | {point['rejected']} | {point['expired']} | {fmt(point['output_tokens_per_s'], 0)} |"
        )
    return lines
