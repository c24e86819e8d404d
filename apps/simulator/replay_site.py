"""What if, against the site's database (issue 26): read a window of the request log, the pools as the gateway
sees them now and as a proposed manifest would leave them, replay the window under both
(`apps.simulator.replay`) and build the report `manage.py replay` prints (and the REST endpoint returns).

The proposed manifest is applied exactly as `apply` applies it (`manifests_apply`: the same validation, the
same writes, the binding of its entitlements) inside a transaction that is always rolled back, after the
gateway's own snapshot of the database (`snapshot_load`) was read inside it: the very limits applying it
would give the gateway, and nothing persisted.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from django.conf import settings
from django.db import transaction

from apps.gateway.config import GatewayConfig
from apps.simulator.replay import (
    Latency,
    PoolPicture,
    PoolRun,
    Recorded,
    figures_of,
    fit_latency,
    recorded_figures,
    replay_pool,
    totals,
)
from apps.simulator.replay_lifetimes import follow_lifetimes

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
COLUMNS = ("recorded", "current", "proposed")


class ReplayInputError(ValueError):
    """A window or manifest the replay cannot use; the message says which and why."""


class EmptyWindow(ReplayInputError):
    """No records in the window."""


def parse_instant(text: str, *, now: dt.datetime, flag: str) -> dt.datetime:
    """`1h` / `30m` / `2d` / `90s` (that long before now) or an ISO 8601 time (UTC when it names no zone)."""
    match = _RELATIVE.match(text)
    if match:
        return now - dt.timedelta(seconds=float(match[1]) * _UNIT_S[match[2]])
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ReplayInputError(f"{flag}: expected a duration before now (90s, 30m, 1h, 2d) or an ISO 8601 time "
                               f"(2026-11-26T14:00:00Z), got {text!r}") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def parse_window(since: str, until: str | None, *, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    start = parse_instant(since, now=now, flag="--since")
    end = now if until is None else parse_instant(until, now=now, flag="--until")
    if end <= start:
        raise ReplayInputError(f"--until ({end.isoformat()}) must be after --since ({start.isoformat()})")
    return start, end


def read_records(*, user: Any, since: dt.datetime, until: dt.datetime, pool: str | None) -> list[Recorded]:
    from apps.gateway.selectors import request_log_window

    return [Recorded(row[0].timestamp(), *row[1:])
            for row in request_log_window(user=user, since=since, until=until, pool=pool).iterator(chunk_size=5000)]


def pool_pictures(names: set[str], config: GatewayConfig) -> dict[str, PoolPicture]:
    """The pools named, as the gateway's snapshot of the database has them now."""
    from apps.gateway.snapshot import snapshot_load

    snapshot = snapshot_load(config=config)
    quoted = {entry.pool_name for entry in snapshot.keys.values() if entry.quotas}
    out = {}
    for name in names:
        info = snapshot.pools.get(name)
        if info is None:
            continue
        replicas = len(info.replica_urls)
        out[name] = PoolPicture(
            name=name, replicas=replicas,
            slots_per_replica=info.concurrency_capacity // replicas if replicas else 0,
            kv_capacity=info.kv_capacity, mean_slo_ms=info.mean_slo_ms,
            entitlements={limits.entitlement_id: limits for limits in info.entitlements},
            owners={ent: owner[0] for ent, owner in snapshot.owners.items() if owner[1] == name},
            has_quotas=name in quoted,
        )
    return out


def proposed_pictures(documents: list[Any] | str, *, actor: Any, names: set[str],
                      config: GatewayConfig) -> dict[str, PoolPicture]:
    """The pools as applying `documents` would leave them, read inside the apply's transaction, rolled back.
    Raises `apps.pools.manifests.ManifestError` (apply's errors) when the manifest is wrong."""
    from apps.audit.context import acting
    from apps.pools.manifests import manifests_apply

    with transaction.atomic():
        with acting(channel="apply", user=actor):
            manifests_apply(actor=actor, documents=documents)
        pictures = pool_pictures(names, config)
        transaction.set_rollback(True)  # never persisted, its on-commit hooks (snapshot reloads) dropped
    return pictures


@dataclass
class Replayed:
    """A column replayed: per pool, the run (None: the pool does not exist under that column)."""

    runs: dict[str, PoolRun]
    pictures: dict[str, PoolPicture]


def _replay_all(records: Sequence[Recorded], pictures: dict[str, PoolPicture], latencies: dict[str, Latency], *,
                start: float, config: GatewayConfig, progress: Callable[[int], None] | None) -> Replayed:
    tick_s = float((getattr(settings, "TOKENPOOLS_TICK_PERIODS", None) or {}).get("ewma", 1.0))
    runs = {}
    for name, picture in sorted(pictures.items()):
        mine = [r for r in records if r.pool == name]
        runs[name] = replay_pool(mine, picture, latencies[name], start=start, tick_s=tick_s,
                                 config=config.admission_config(), dynamics=config.dynamics_config(),
                                 progress=progress)
    return Replayed(runs, pictures)


def whatif_report(*, records: Sequence[Recorded], since: dt.datetime, until: dt.datetime,
                  proposed_documents: list[Any] | str | None = None, actor: Any = None, pool: str | None = None,
                  progress: Callable[[int], None] | None = None, oldest: dt.datetime | None = None,
                  tenant_slugs: dict[int, str] | None = None) -> dict[str, Any]:
    """The report: `{"window", "entitlements": {NAME: {recorded, current, proposed}}, "pools", "caveats"}`."""
    if not records:
        raise EmptyWindow(_empty_message(since, until, pool, oldest))
    config = GatewayConfig.from_settings()
    names = {r.pool for r in records}
    latencies = {name: fit_latency(r for r in records if r.pool == name) for name in names}
    current = pool_pictures(names, config)
    proposed = None
    if proposed_documents is not None:
        proposed = proposed_pictures(proposed_documents, actor=actor, names=names, config=config)
    # Virtual time starts at the first record, not at --since: the pool starts empty either way, and a window
    # that opens long before its first record would otherwise tick the EWMA once a second through the silence.
    start = min(r.arrived for r in records)
    lifetimes = follow_lifetimes(current, records, start=start, end=until.timestamp(), config=config)
    followed = lifetimes.pictures
    columns: dict[str, Replayed] = {"current": _replay_all(records, followed, latencies, start=start, config=config,
                                                           progress=progress)}
    proposal_notes: list[str] = []
    if proposed is not None:
        proposed, proposal_notes = _proposal_over(followed, current, proposed)
        columns["proposed"] = _replay_all(records, proposed, latencies, start=start, config=config, progress=progress)
    recorded, recorded_ttft = recorded_figures(records)
    report = _assemble(records, recorded, recorded_ttft, columns, tenant_slugs or {})
    wall = sum(run.wall_seconds for column in columns.values() for run in column.runs.values())
    replayed = sum(run.requests for column in columns.values() for run in column.runs.values())
    report["window"] = {
        "since": since.isoformat(), "until": until.isoformat(), "pool": pool, "records": len(records),
        "pools": sorted(names), "oldest_record": None if oldest is None else oldest.isoformat(),
        "retention_days": int(getattr(settings, "GATEWAY_REQUEST_LOG_DAYS", 7)),
        "service_times": {name: latencies[name].as_dict() for name in sorted(names)},
        "replayed_requests": replayed, "wall_seconds": round(wall, 4),
        "records_per_second": round(replayed / wall) if wall > 0 else None,
    }
    report["caveats"] = _caveats(records, followed, proposed, columns, latencies, since, oldest)
    report["caveats"] += lifetimes.followed + lifetimes.gaps + proposal_notes
    return report


def _proposal_over(followed: dict[str, PoolPicture], current: dict[str, PoolPicture],
                   proposed: dict[str, PoolPicture]) -> tuple[dict[str, PoolPicture], list[str]]:
    """The proposed column: an entitlement the proposal changes (its limits under the proposal differ from its
    limits now: created, changed or deleted by it) takes the proposed definition for the whole window, from
    its start; every other one follows its recorded lifetime, as under current. (An operator asks "what if
    this had been in force?": in force over the window, not from the moment its entitlement was created.)"""
    out: dict[str, PoolPicture] = {}
    changed: set[str] = set()
    notes = []
    for name, picture in proposed.items():
        now = current.get(name)
        was = now.entitlements if now is not None else {}
        mine = {ent for ent in set(was) | set(picture.entitlements) if was.get(ent) != picture.entitlements.get(ent)}
        changed |= mine
        base = followed.get(name)
        timelines = {} if base is None else {ent: t for ent, t in base.timelines.items() if ent not in mine}
        entitlements = {} if base is None else {ent: lim for ent, lim in base.entitlements.items() if ent not in mine}
        entitlements.update((ent, lim) for ent, lim in picture.entitlements.items() if ent in mine)
        out[name] = replace(picture, entitlements=entitlements, timelines=timelines)
        if base is None:
            continue
        for ent in sorted(mine & set(picture.entitlements)):
            timeline = base.timelines.get(ent)
            if timeline is not None and (timeline.initial is None or timeline.changes):
                notes.append(f"Entitlement {ent!r} did not hold one definition through the window when recorded "
                             f"(created, changed or deleted in it: the audit log); under proposed it holds the "
                             f"proposed one (its reservation included) from the window's start to its end.")
    if changed:
        notes.insert(0, f"Under proposed, the entitlements the proposal changes ({', '.join(repr(n) for n in sorted(changed))}) take "
                        f"its definition for the whole window; the others follow their recorded lifetimes, as "
                        f"under current.")
    return out, notes


def _assemble(records: Sequence[Recorded], recorded: dict[str, dict[str, Any]], recorded_ttft: dict[str, list[float]],
              columns: dict[str, Replayed], tenant_slugs: dict[int, str]) -> dict[str, Any]:
    pool_of: dict[str, str] = {}
    tenant_of: dict[str, str] = {}
    for r in records:
        pool_of.setdefault(r.entitlement, r.pool)
        tenant_of.setdefault(r.entitlement, tenant_slugs.get(r.tenant_id, str(r.tenant_id)))
    for column in columns.values():
        for picture in column.pictures.values():
            for ent in picture.entitlements:
                pool_of.setdefault(ent, picture.name)
                tenant_of[ent] = picture.owners.get(ent, tenant_of.get(ent, ""))
    empty = figures_of(offered=0, rejected_by_reason={}, waited=0, ttft_s=[], peak_debt=None)
    entitlements: dict[str, Any] = {}
    ttft: dict[str, dict[str, list[float]]] = {}
    for name in sorted(pool_of):
        row: dict[str, Any] = {"pool": pool_of[name], "tenant": tenant_of.get(name, "")}
        ttft[name] = {"recorded": recorded_ttft.get(name, [])}
        row["recorded"] = recorded.get(name, empty)
        for label, column in columns.items():
            run = column.runs.get(pool_of[name])
            row[label] = run.figures.get(name) if run is not None else None
            ttft[name][label] = run.ttft.get(name, []) if run is not None else []
        entitlements[name] = row
    pools: dict[str, Any] = {}
    for pool in sorted(set(pool_of.values())):
        mine = [n for n in entitlements if pool_of[n] == pool]
        pools[pool] = {label: totals([entitlements[n][label] for n in mine if entitlements[n].get(label)],
                                     [ttft[n][label] for n in mine])
                       for label in ("recorded", *columns)}
    return {"entitlements": entitlements, "pools": pools, "ttft_s": ttft}


def _caveats(records: Sequence[Recorded], current: dict[str, PoolPicture], proposed: dict[str, PoolPicture] | None,
             columns: dict[str, Replayed], latencies: dict[str, Latency], since: dt.datetime,
             oldest: dt.datetime | None) -> list[str]:
    out = [
        "Open loop: every recorded request is replayed at its recorded instant, once. Clients that wait for an "
        "answer before the next request (closed loop), or retry a refusal, would have sent more (or less) had "
        "more (or fewer) been admitted; the replay cannot know what they would have sent.",
        "The pool starts empty at the window's start: requests in flight before it, and the debt and burst "
        "accumulated before it, are not known to the replay.",
        "Service times come from a per-token model fitted to the pool's served records (window.service_times), "
        "independent of batch size: a change that admits more does not slow the replayed replicas' tokens. The "
        "AIMD dispatch budget and the replicas' saturation signal are not replayed.",
    ]
    recorded_names = {r.entitlement for r in records}
    for pool_name in sorted({r.pool for r in records}):
        if pool_name not in current:
            out.append(f"Pool {pool_name!r} has recorded traffic but no longer exists: its requests are not replayed.")
        if latencies[pool_name].fitted_from == 0:
            out.append(f"Pool {pool_name!r} has no served request in the window: its service times are the "
                       f"simulator's defaults, not fitted.")
    for label, maybe in (("current", current), ("proposed", proposed)):
        if maybe is None:  # no proposed manifest: no such column (not an empty one)
            continue
        pictures = maybe
        known = {ent for picture in pictures.values() for ent in picture.entitlements}
        for name in sorted(recorded_names - known):
            count = sum(1 for r in records if r.entitlement == name)
            out.append(f"Entitlement {name!r} has {count} recorded requests but does not exist under {label}: they "
                       f"are not replayed there, and the room they held when recorded is free for the others.")
        if any(picture.has_quotas for picture in pictures.values()):
            out.append(f"Quotas ({label}) are not replayed: a request a quota would refuse is admitted.")
    if proposed is not None:
        new = {ent for p in proposed.values() for ent in p.entitlements} - recorded_names
        for name in sorted(new):
            out.append(f"Entitlement {name!r} has no recorded traffic in the window: the records cannot say what it "
                       f"would send, so the replay shows it idle (its reservation still counts).")
    guessed = sum(run.guessed_lengths for run in columns["current"].runs.values())
    if guessed:
        out.append(f"{guessed} replayed requests were not served when recorded (refused, failed): their output length "
                   f"is their entitlement's median served completion, capped at their max_tokens.")
    errors = sum(1 for r in records if r.outcome == "error")
    if errors:
        out.append(f"{errors} recorded requests ended in an error (no replica, a backend failing): 'recorded' "
                   f"counts them as errors, a replay serves them.")
    days = int(getattr(settings, "GATEWAY_REQUEST_LOG_DAYS", 7))
    if oldest is not None and since < oldest and since < dt.datetime.now(dt.UTC) - dt.timedelta(days=days):
        out.append(f"The window starts before the request log's retention (GATEWAY_REQUEST_LOG_DAYS={days}): the "
                   f"oldest record is from {oldest.isoformat()}.")
    return out


def _empty_message(since: dt.datetime, until: dt.datetime, pool: str | None, oldest: dt.datetime | None) -> str:
    where = f" in pool {pool!r}" if pool else ""
    message = f"no requests recorded{where} between {since.isoformat()} and {until.isoformat()}"
    days = int(getattr(settings, "GATEWAY_REQUEST_LOG_DAYS", 7))
    if days == 0:
        return message + "; the request log is off (GATEWAY_REQUEST_LOG_DAYS=0)"
    if oldest is None:
        return message + "; the request log has no records at all"
    return message + (f"; the request log keeps {days} days (GATEWAY_REQUEST_LOG_DAYS) and its oldest record is "
                      f"from {oldest.isoformat()}")
