"""Honest metrics (issue 28, item 3): every family of /metrics, summed over its labels as a PromQL `sum()`
does, equals what the state store and the usage records say, so no series counts anything twice.

A real gateway serves three entitlements of one tenant that has a shared quota (one of them with a quota
of its own, one refused by its own), while requests are in flight and after they finished; each family is
then summed by the labels an operator groups by and compared with the store's own counts (in flight, quota
used and reserved, debt) and the usage records (requests, refusals, tokens). A family the table below does
not know fails the test: a new family must say what it adds up to."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import pytest

from apps.gateway.models import UsageRecord
from apps.gateway.usage import usage_records_upsert_batch
from tests.support.metrics import scrape

pytestmark = pytest.mark.django_db

BODY = {"model": "tiny-model", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4}
_SERIES = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
TENANT_QUOTA, CHAT_QUOTA = 100_000, 50_000
RATES = {"acme-chat": 1000, "acme-spare": 300, "acme-batch": 200}

# Families of the pool or a replica (no tenant's): one series per pool (and replica), nothing to add up.
POOL_LEVEL = frozenset({"flow_control_pool_budget", "flow_control_budget_utilization", "flow_control_pool_saturation",
                        "tokenpools_replica_healthy", "tokenpools_replica_kv_usage", "tokenpools_pool_desired_replicas",
                        "gateway_pending_releases"})

KEYS_ONLY = -1.0
Series = list[tuple[str, dict[str, str], float]]


def parse(text: str) -> tuple[dict[str, str], Series]:
    """(family -> type, every sample as (name, labels, value))."""
    types: dict[str, str] = {}
    samples: Series = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            match = _SERIES.match(line)
            assert match, line
            samples.append((match.group(1), dict(_LABEL.findall(match.group(2) or "")), float(match.group(3))))
    return types, samples


def summed(samples: Series, name: str, by: Iterable[str]) -> dict[tuple[str, ...], float]:
    """`sum by (<by>) (<name>)`."""
    by = tuple(by)
    totals: dict[tuple[str, ...], float] = {}
    for sample, labels, value in samples:
        if sample == name:
            key = tuple(labels.get(label, "") for label in by)
            totals[key] = totals.get(key, 0.0) + value
    return totals


def _fire(h: Any, names: list[str]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(h.url + "/v1/chat/completions", json=BODY,
                                                      headers=h.auth(h.secrets[name])) for name in names))
    return asyncio.run(run())


def _store_truth(h: Any) -> dict[str, Any]:
    """What the store holds: in flight by entitlement, quotas (the tenant's once, each entitlement's own),
    debt/burst by entitlement."""
    gateway, snapshot = h.gateway, h.gateway.snapshots.current
    pool = snapshot.pools["tiny"]
    in_flight = h.server.call(gateway.store.in_flight(pool=pool))
    tenant_quota: dict[str, tuple[float, float, float]] = {}
    own_quota: dict[str, tuple[float, float, float]] = {}
    dynamics: dict[str, tuple[float, float]] = {}
    now = dt.datetime.now(dt.UTC)
    for entry in snapshot.keys.values():
        usage = h.server.call(gateway.store.entitlement_usage(limits=entry.limits, pool="tiny"))
        dynamics[entry.entitlement] = (usage.debt, usage.burst)
        charges = [rule.charge_at(now) for rule in entry.quotas]
        for standing in h.server.call(gateway.store.quota_standings(scope=str(entry.tenant_id), charges=charges)):
            values = (standing.used, standing.reserved, standing.charge.limit)
            if standing.charge.key == "tenant":
                tenant_quota[entry.tenant_slug] = values
            else:
                own_quota[entry.entitlement] = values
    return {"in_flight": in_flight, "tenant_quota": tenant_quota, "own_quota": own_quota, "dynamics": dynamics}


def _read(h: Any) -> tuple[dict[str, str], Series, dict[str, Any]]:
    h.server.call(h.gateway.loops.store_view())
    truth = _store_truth(h)
    types, samples = parse(scrape(h.url))
    return types, samples, truth


def _check_in_flight(samples: Series, truth: dict[str, Any]) -> None:
    """The in-flight families against the store's own count (nothing waits here: concurrency suffices)."""
    by_entitlement = {("acme", "tiny", name): float(n) for name, n in truth["in_flight"].items() if n}
    total = sum(truth["in_flight"].values())
    for family in ("gateway_store_in_flight", "gateway_entitlement_in_flight"):
        got = {k: v for k, v in summed(samples, family, ("tenant", "pool", "entitlement")).items() if v}
        assert got == by_entitlement, family
    assert sum(summed(samples, "gateway_requests_in_flight", ("pool",)).values()) == total
    assert sum(summed(samples, "tokenpools_queue_depth", ("tenant",)).values()) == 0
    assert sum(summed(samples, "flow_control_queue_size", ("pool",)).values()) == 0
    used, reserved, limit = truth["tenant_quota"]["acme"]
    # The tenant's shared quota: once, under the tenant; its sum by tenant is the store's one number.
    assert summed(samples, "tokenpools_tenant_quota_used_tokens", ("tenant",)) == {("acme",): used}
    assert summed(samples, "tokenpools_tenant_quota_reserved_tokens", ("tenant",)) == {("acme",): reserved}
    assert limit == TENANT_QUOTA
    assert summed(samples, "tokenpools_tenant_quota_limit_tokens", ("tenant",)) == {("acme",): limit}


def _usage_totals() -> dict[str, dict[tuple[str, ...], float]]:
    totals: dict[str, dict[tuple[str, ...], float]] = {"requests": {}, "rejected": {}, "prompt": {},
                                                       "completion": {}}
    for record in UsageRecord.objects.select_related("tenant"):
        key = (record.tenant.slug, record.entitlement)
        for field, value in (("requests", record.requests), ("rejected", record.rejected),
                             ("prompt", record.prompt_tokens), ("completion", record.completion_tokens)):
            totals[field][key] = totals[field].get(key, 0.0) + value
    return totals


def _by_tenant(per_entitlement: dict[tuple[str, ...], float]) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for (tenant, _), value in per_entitlement.items():
        out[(tenant,)] = out.get((tenant,), 0.0) + value
    return out


def _nonzero(values: dict[tuple[str, ...], float]) -> dict[tuple[str, ...], float]:
    return {k: v for k, v in values.items() if v}


def expectations(h: Any, truth: dict[str, Any]) -> dict[str, tuple[tuple[str, ...], dict[tuple[str, ...], float]]]:
    """family (a histogram by its _count) -> (the labels it is summed by, what the sum must be)."""
    usage = _usage_totals()
    requests_by_tenant = _by_tenant(usage["requests"])
    admitted = sum(usage["requests"].values())
    tokens = {(tenant, kind): value for kind in ("prompt", "completion")
              for (tenant,), value in _by_tenant(usage[kind]).items()}
    used, reserved, limit = truth["tenant_quota"]["acme"]
    own = truth["own_quota"]
    limits = {e.entitlement: e.limits for e in h.gateway.snapshots.current.keys.values()}
    ent = ("tenant", "entitlement")
    return {
        "gateway_requests_admitted_total": (ent, usage["requests"]),
        "gateway_requests_rejected_total": (ent, _nonzero(usage["rejected"])),
        "gateway_tokens_total": (("tenant", "kind"), tokens),
        "gateway_tier_requests_total": (("tenant",), requests_by_tenant),
        "gateway_tier_tokens_total": (("tenant", "kind"), tokens),
        "gateway_ttft_seconds_count": (("tenant",), requests_by_tenant),
        "gateway_request_duration_seconds_count": (("pool",), {("tiny",): admitted}),
        "tokenpools_queue_wait_seconds_count": (("tenant",), {}),
        "gateway_store_in_flight": (ent, {}),
        "gateway_entitlement_in_flight": (ent, {}),
        "gateway_requests_in_flight": (("pool",), {("tiny",): 0.0}),
        "tokenpools_queue_depth": (ent, {}),
        "flow_control_queue_size": (("pool",), {("tiny",): 0.0}),
        "tokenpools_tenant_quota_used_tokens": (("tenant",), {("acme",): used}),
        "tokenpools_tenant_quota_reserved_tokens": (("tenant",), {("acme",): reserved}),
        "tokenpools_tenant_quota_limit_tokens": (("tenant",), {("acme",): limit}),
        "tokenpools_entitlement_quota_used_tokens": (ent, {("acme", n): v[0] for n, v in own.items()}),
        "tokenpools_entitlement_quota_reserved_tokens": (ent, {("acme", n): v[1] for n, v in own.items()}),
        "tokenpools_entitlement_quota_limit_tokens": (ent, {("acme", n): v[2] for n, v in own.items()}),
        "tokenpools_tenant_quota_used_amount": (("tenant",), {}),
        "tokenpools_tenant_quota_reserved_amount": (("tenant",), {}),
        "tokenpools_tenant_quota_limit_amount": (("tenant",), {}),
        "tokenpools_entitlement_quota_used_amount": (ent, {}),
        "tokenpools_entitlement_quota_reserved_amount": (ent, {}),
        "tokenpools_entitlement_quota_limit_amount": (ent, {}),
        "tokenpools_entitlement_info": (("tenant", "pool"), {("acme", "tiny"): float(len(RATES))}),
        "tokenpools_entitlement_tokens_per_second": (("tenant",), {("acme",): float(sum(RATES.values()))}),
        "tokenpools_entitlement_slo_ttft_seconds": (ent, {("acme", n): lim.slo_target_ms / 1000.0
                                                          for n, lim in limits.items()
                                                          if lim.slo_target_ms is not None}),
        "tokenpools_entitlement_debt": (ent, {("acme", n): d for n, (d, _) in truth["dynamics"].items()}),
        "tokenpools_entitlement_burst": (ent, {("acme", n): b for n, (_, b) in truth["dynamics"].items()}),
        # A weight per entitlement (nothing to add): one series per entitlement, its keys compared.
        "tokenpools_entitlement_priority": (ent, {("acme", n): KEYS_ONLY for n in RATES}),
    }


def _family_of(name: str, types: dict[str, str]) -> str:
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base if base in types and types[base] == "histogram" else name


def test_every_family_summed_over_its_labels_equals_the_stores_and_the_usage_totals(
        gateway_factory: Any, upstream_factory: Any, acme: Any, metrics_token: str) -> None:
    acme.quota_tokens, acme.quota_window = TENANT_QUOTA, "day"
    acme.save()
    upstream, _ = upstream_factory(first_token_delay_s=1.0)
    h = gateway_factory(
        upstreams=[upstream],
        entitlement={"tokens_per_second": RATES["acme-chat"], "quota_tokens": CHAT_QUOTA, "quota_window": "day"},
        extra_entitlements={
            "acme-spare": {"service_class": "elastic", "tokens_per_second": RATES["acme-spare"]},
            "acme-batch": {"service_class": "elastic", "tokens_per_second": RATES["acme-batch"], "quota_tokens": 1,
                           "quota_window": "day"}})
    names = ["acme-chat"] * 3 + ["acme-spare"] * 2 + ["acme-batch"]
    answers: list[httpx.Response] = []
    firing = threading.Thread(target=lambda: answers.extend(_fire(h, names)))
    firing.start()
    try:
        deadline = asyncio.run(_until(lambda: h.running() == 5))
        assert deadline, "the five requests never were in flight together"
        types, samples, truth = _read(h)
        assert sum(truth["in_flight"].values()) == 5
        _check_in_flight(samples, truth)
    finally:
        firing.join(timeout=30)
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * 5 + [429], [r.text for r in answers]

    # This process's usage counts, written as the flush writes them (here, in the test's database transaction).
    usage_records_upsert_batch(dict(h.gateway.usage._pending))
    types, samples, truth = _read(h)
    expected = expectations(h, truth)
    found: list[str] = []
    for name in sorted({_family_of(sample, types) for sample, _, _ in samples} | set(types)):
        family = re.sub(r"_count$", "", name)
        kind = types.get(family)
        if kind == "histogram" and not name.endswith("_count"):
            continue  # checked through its _count
        if name in POOL_LEVEL:
            assert not {"tenant", "entitlement"} & {k for s, labels, _ in samples if s == name for k in labels}
            continue
        if name not in expected:
            found.append(f"{name}: not in the table (say what it sums to)")
            continue
        by, want = expected[name]
        got = summed(samples, name, by)
        if KEYS_ONLY in want.values():
            got = dict.fromkeys(got, KEYS_ONLY)
        # A zero series and a missing one sum the same.
        got, want = _nonzero(got), _nonzero(want)
        if got != want:
            found.append(f"{name}: sum by {by} is {got}, the store/usage say {want}")
    # Every series keyed by entitlement names its tenant and pool.
    for sample, labels, _ in samples:
        if "entitlement" in labels and not (labels.get("tenant") == "acme" and labels.get("pool") == "tiny"):
            found.append(f"{sample}{labels}: no tenant/pool")
    # Per-entitlement values that do not add up (priority, SLO, debt): exactly one series per entitlement.
    for name in ("tokenpools_entitlement_priority", "tokenpools_entitlement_slo_ttft_seconds",
                 "tokenpools_entitlement_debt"):
        keys = [labels["entitlement"] for s, labels, _ in samples if s == name]
        if len(keys) != len(set(keys)):
            found.append(f"{name}: an entitlement with several series {sorted(keys)}")
    assert not found, "\n".join(found)
    # The tenant's quota is what its requests used: once, whichever entitlement served them.
    used = truth["tenant_quota"]["acme"][0]
    assert used == sum(v for k, v in summed(samples, "gateway_tokens_total", ("tenant",)).items() if k == ("acme",))


async def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not await asyncio.to_thread(check):
        if loop.time() > end:
            return False
        await asyncio.sleep(0.02)
    return True
