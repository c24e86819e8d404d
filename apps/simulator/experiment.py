"""One scenario, two clocks: the figures a live run and the simulator are compared on.

A scenario is scaled to the machine (`scale_scenario`): `time_scale` stretches or shrinks every instant
(horizon, joins, leaves, rate phases) and the simulated replica's step times by the same factor, and divides
open-loop rates by it, so the load keeps its shape in slot-seconds; `capacity_scale` multiplies the slots,
the closed-loop clients, the open-loop rates and the entitlements' concurrency. Both runs are then reduced
to the same per-request outcomes (`Outcome`) and the same figures: per entitlement and per phase (the spans
between joins and leaves: before, during and after a burst), time to first token, end-to-end latency,
admissions, 429s by reason and the throttle rate; requests in flight per second; p99 TTFT per 5 s window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from apps.simulator.live import LiveRecord
from apps.simulator.scenario import Scenario
from apps.simulator.simulation import Simulation, percentile
from apps.simulator.workload import RatePhase, TenantSpec

WINDOW_S = 5.0


@dataclass(frozen=True)
class Outcome:
    tenant: str
    sent_at: float
    status: str  # "ok", "429" or "error"
    reason: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None


def scale_scenario(scenario: Scenario, *, time_scale: float = 1.0, capacity_scale: float = 1.0) -> Scenario:
    if time_scale <= 0 or capacity_scale <= 0:
        raise ValueError("--time-scale and --capacity-scale must be positive")

    def at(value: float | None) -> float | None:
        return None if value is None else value * time_scale

    def count(value: int) -> int:
        return 0 if value == 0 else max(1, round(value * capacity_scale))

    tenants = []
    for tenant in scenario.config.tenants:
        entitlement = dict(tenant.entitlement)
        if entitlement.get("concurrency"):
            entitlement["concurrency"] = count(int(entitlement["concurrency"]))
        tenants.append(replace(
            tenant, rate=tenant.rate * capacity_scale / time_scale, concurrency=count(tenant.concurrency),
            start=tenant.start * time_scale, stop=at(tenant.stop), think_time_s=tenant.think_time_s * time_scale,
            retry_backoff_s=tenant.retry_backoff_s * time_scale, entitlement=entitlement,
            phases=tuple(RatePhase(p.at * time_scale, p.rate * capacity_scale / time_scale) for p in tenant.phases),
        ))
    config = replace(
        scenario.config, tenants=tenants, horizon_s=at(scenario.config.horizon_s),
        max_num_seqs=count(scenario.config.max_num_seqs),
        prefill_ms_per_token=scenario.config.prefill_ms_per_token * time_scale,
        decode_ms_per_token=scenario.config.decode_ms_per_token * time_scale,
        capacity_events=[replace(e, at=e.at * time_scale) for e in scenario.config.capacity_events],
    )
    return replace(scenario, config=config)


def phases(tenants: list[TenantSpec], horizon_s: float, events: Any = ()) -> list[tuple[str, float, float]]:
    """The spans between the instants a tenant joins or leaves, or capacity changes: (name, start, end)."""
    instants = [t for spec in tenants for t in (spec.start, spec.stop)] + [e.at for e in events]
    edges = sorted({t for t in instants if t is not None and 0 < t < horizon_s})
    bounds = [0.0, *edges, horizon_s]
    spans = list(zip(bounds, bounds[1:], strict=False))
    names = ["before", "during", "after"] if len(spans) == 3 else [f"phase {i + 1}" for i in range(len(spans))]
    return [(name, start, end) for name, (start, end) in zip(names, spans, strict=True)]


def sim_outcomes(simulation: Simulation) -> list[Outcome]:
    finished = [Outcome(tenant, done - e2e, "ok", ttft_s=ttft, e2e_s=e2e)
                for done, tenant, ttft, e2e in simulation.finished]
    rejected = [Outcome(tenant, when, "429", reason) for when, tenant, reason in simulation.rejections]
    return sorted(finished + rejected, key=lambda o: o.sent_at)


def live_outcomes(records: list[LiveRecord]) -> list[Outcome]:
    out = []
    for record in records:
        status = "ok" if record.status == 200 else "429" if record.status == 429 else "error"
        out.append(Outcome(record.tenant, record.sent_at, status, record.reason, record.ttft_s, record.e2e_s))
    return sorted(out, key=lambda o: o.sent_at)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def tenant_figures(outcomes: list[Outcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == "ok"]
    denied = [o for o in outcomes if o.status == "429"]
    denials: dict[str, int] = {}
    for outcome in denied:
        denials[outcome.reason] = denials.get(outcome.reason, 0) + 1
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    return {
        "offered": len(outcomes), "admitted": len(ok), "rejected": len(denied),
        "errors": sum(1 for o in outcomes if o.status == "error"),
        "throttle_rate": round(len(denied) / len(outcomes), 4) if outcomes else None,
        "ttft_p50_s": _round(percentile(ttft, 50)), "ttft_p99_s": _round(percentile(ttft, 99)),
        "e2e_p50_s": _round(percentile(e2e, 50)), "e2e_p99_s": _round(percentile(e2e, 99)),
        "denials": dict(sorted(denials.items())),
    }


def figures(outcomes: list[Outcome], tenants: list[TenantSpec], horizon_s: float, events: Any = ()) -> dict[str, Any]:
    """Per tenant: the whole run and each phase."""
    spans = phases(tenants, horizon_s, events)
    out: dict[str, Any] = {}
    for spec in sorted(tenants, key=lambda t: t.name):
        mine = [o for o in outcomes if o.tenant == spec.name]
        out[spec.name] = {
            "all": tenant_figures(mine),
            **{name: tenant_figures([o for o in mine if start <= o.sent_at < end]) for name, start, end in spans},
        }
    return out


def in_flight_series(outcomes: list[Outcome], tenants: list[str], horizon_s: float,
                     step_s: float = 1.0) -> dict[str, list[int]]:
    """Requests of each tenant in flight (sent, not yet finished) at each whole step: the slots it held or
    waited for, as the client sees it."""
    points = int(math.ceil(horizon_s / step_s)) + 1
    series = {name: [0] * points for name in tenants}
    for outcome in outcomes:
        if outcome.status != "ok" or outcome.e2e_s is None or outcome.tenant not in series:
            continue
        first = int(math.ceil(outcome.sent_at / step_s))
        last = int(math.floor((outcome.sent_at + outcome.e2e_s) / step_s))
        for index in range(max(0, first), min(points - 1, last) + 1):
            series[outcome.tenant][index] += 1
    return series


def ttft_p99_windows(outcomes: list[Outcome], tenants: list[str], horizon_s: float,
                     window_s: float = WINDOW_S) -> dict[str, list[float | None]]:
    windows = int(math.ceil(horizon_s / window_s))
    out: dict[str, list[float | None]] = {}
    for name in tenants:
        values: list[list[float]] = [[] for _ in range(windows)]
        for outcome in outcomes:
            if outcome.tenant == name and outcome.status == "ok" and outcome.ttft_s is not None:
                index = min(windows - 1, int(outcome.sent_at // window_s))
                values[index].append(outcome.ttft_s)
        out[name] = [_round(percentile(v, 99)) if v else None for v in values]
    return out


def exp1_shape(arms: dict[str, dict[str, Any]], tenants: list[TenantSpec]) -> list[dict[str, Any]]:
    """Seed 000's Experiment 1 claims, checked on each arm's figures: with token pools no guaranteed 429,
    guaranteed p99 TTFT during the burst at most 2x its p99 before, spot throttled; without admission the
    guaranteed p99 during the burst above its p99 before."""
    guaranteed = [t.name for t in tenants if t.entitlement.get("service_class") in ("guaranteed", "dedicated")
                  and t.start == 0]
    spot = [t.name for t in tenants if t.entitlement.get("service_class") in ("spot", "preemptible")]
    checks: list[dict[str, Any]] = []
    for arm, result in arms.items():
        per = result["figures"]
        for name in guaranteed:
            before, during = per[name]["before"]["ttft_p99_s"], per[name]["during"]["ttft_p99_s"]
            ratio = None if not before or during is None else round(during / before, 3)
            if result["admission"]:
                checks.append({"arm": arm, "check": f"{name}: 0 guaranteed 429s",
                               "value": per[name]["all"]["rejected"], "holds": per[name]["all"]["rejected"] == 0})
                checks.append({"arm": arm, "check": f"{name}: p99 TTFT during / before <= 2",
                               "value": ratio, "holds": ratio is not None and ratio <= 2.0})
            else:
                checks.append({"arm": arm, "check": f"{name}: p99 TTFT during / before > 1 (degrades)",
                               "value": ratio, "holds": ratio is not None and ratio > 1.0})
        if result["admission"]:
            for name in spot:
                rate = per[name]["all"]["throttle_rate"]
                checks.append({"arm": arm, "check": f"{name}: spot throttled", "value": rate,
                               "holds": bool(rate)})
    return checks


def sim_dynamics(simulation: Simulation) -> tuple[dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """Debt and priority per entitlement over time, as the simulated ledger's tick recorded them."""
    samples = getattr(simulation.cluster.admission, "debt_samples", [])
    debt: dict[str, list[list[float]]] = {}
    priority: dict[str, list[list[float]]] = {}
    for sample in samples:
        for name, value in sample.debt.items():
            debt.setdefault(name, []).append([round(sample.time, 3), round(value, 5)])
        for name, value in sample.priority.items():
            priority.setdefault(name, []).append([round(sample.time, 3), round(value, 4)])
    return debt, priority


def live_dynamics(samples: list[dict[str, Any]]) -> tuple[dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """Debt and priority per entitlement over time, from the gateway's `/metrics` (what its store holds)."""
    series: dict[str, dict[str, list[list[float]]]] = {"debt": {}, "priority": {}}
    for sample in samples:
        for key, value in sample.items():
            for kind in series:
                prefix = f"tokenpools_entitlement_{kind}{{"
                if key.startswith(prefix) and 'entitlement="' in key:
                    name = key.split('entitlement="', 1)[1].split('"', 1)[0]
                    series[kind].setdefault(name, []).append([sample["t"], round(float(value), 5)])
    return series["debt"], series["priority"]


def debt_decay_s(debt: dict[str, list[list[float]]], recovered_at: float, fraction: float = 0.1) -> float | None:
    """Seconds after `recovered_at` until every entitlement's debt is within `fraction` of its peak (or at
    or below zero); None if it never gets there in the run."""
    peaks = {name: max((v for _t, v in points), default=0.0) for name, points in debt.items()}
    times = sorted({t for points in debt.values() for t, _v in points if t >= recovered_at})
    for when in times:
        if all(_at(points, when) <= max(0.0, fraction * peaks[name]) for name, points in debt.items()):
            return round(when - recovered_at, 2)
    return None


def _at(points: list[list[float]], when: float) -> float:
    value = 0.0
    for t, v in points:
        if t > when:
            break
        value = v
    return value


def exp2_shape(arms: dict[str, dict[str, Any]], tenants: list[TenantSpec],
               outage: tuple[float, float]) -> list[dict[str, Any]]:
    """Seed 000's Experiment 2 claims on each arm with admission: the tightest-SLO entitlement is not denied
    for priority, the loosest absorbs the throttling, debt rises during the outage and decays after it."""
    slo = {t.name: float(t.slo_target_ms or t.entitlement.get("slo_target_ms", 1000.0)) for t in tenants}
    tightest, loosest = min(slo, key=slo.__getitem__), max(slo, key=slo.__getitem__)
    start, end = outage
    checks: list[dict[str, Any]] = []
    for arm, result in arms.items():
        if not result["admission"]:
            continue
        per = result["figures"]
        contended = {name: per[name]["all"]["denials"].get("pool_contended", 0) for name in per}
        checks.append({"arm": arm, "check": f"{tightest} (tightest SLO): no pool_contended denials",
                       "value": contended[tightest], "holds": contended[tightest] == 0})
        checks.append({"arm": arm, "check": f"{loosest} (loosest SLO) absorbs the most pool_contended denials",
                       "value": contended[loosest],
                       "holds": contended[loosest] > 0 and contended[loosest] == max(contended.values())})
        debt = result.get("debt") or {}
        if debt:
            before = max((v for points in debt.values() for t, v in points if t < start), default=0.0)
            during = max((v for points in debt.values() for t, v in points if start <= t < end), default=0.0)
            checks.append({"arm": arm, "check": "debt rises during the outage (peak during > peak before, > 0.01)",
                           "value": round(during, 4), "holds": during > max(before, 0.0) + 0.01})
            decay = debt_decay_s(debt, end)
            checks.append({"arm": arm, "check": "debt decays after recovery (s to within 10% of its peak)",
                           "value": decay, "holds": decay is not None and during > 0.01})
    return checks
