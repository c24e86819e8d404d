"""The entitlements' lifetimes over a replayed window, read from the site's database (issue 26).

`apps.simulator.lifetimes` reconstructs each entitlement's fields over the window from the rows now and the
audit log; here the rows and entries are read and each state is turned into the gateway's limits by the same
translation the snapshot uses (`apps.gateway.snapshot.entitlement_limits`). The binding state is not audited
(the control loops keep it): an entitlement that still exists keeps its stored state (Bound when it is Expired
now: its expiry is followed as an event, below), one deleted since is Bound. An expiry (`expires_at`) is
followed: from that instant the entitlement's limits are in state Expired (the gateway's `KeyEntry.limits_at`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from django.core.exceptions import ValidationError

from apps.gateway.config import GatewayConfig
from apps.policy import EntitlementLimits, EntitlementState
from apps.simulator.lifetimes import (
    AuditChange,
    Covered,
    Fields,
    Lifetime,
    cover_records,
    entitlement_history,
)
from apps.simulator.replay import PoolPicture, Recorded, Timeline


@dataclass
class Lifetimes:
    """Per pool the pictures with their entitlements' timelines, and what to tell about them."""

    pictures: dict[str, PoolPicture]
    followed: list[str]  # the changes followed, in words
    gaps: list[str]  # where the history is incomplete, in words


def follow_lifetimes(pictures: dict[str, PoolPicture], records: Sequence[Recorded], *, start: float, end: float,
                     config: GatewayConfig) -> Lifetimes:
    """`pictures` (the pools now) with each entitlement's lifetime from `start` (the virtual time's origin) to
    `end`, from the audit log; stretched over its recorded requests where the log has gaps."""
    from apps.audit.models import AuditEntry
    from apps.audit.recorder import SPECS
    from apps.pools.models import TokenEntitlement, TokenPool

    audited = SPECS["pools.TokenEntitlement"].fields(TokenEntitlement)
    rows = list(TokenEntitlement.objects.values("id", "state", "created_at", *audited))
    present = {str(row["id"]): {f: row[f] for f in audited} for row in rows}
    stored_state = {str(row["id"]): str(row["state"]).lower() for row in rows}
    since = dt.datetime.fromtimestamp(start, tz=dt.UTC)
    entries = AuditEntry.objects.filter(kind="TokenEntitlement", at__gte=since).values_list(
        "at", "id", "action", "object_id", "object_name", "before", "after")
    changes = [AuditChange(at.timestamp(), seq, action, oid, name, before, after)
               for at, seq, action, oid, name, before, after in entries.iterator()]
    late = [str(row["id"]) for row in rows if row["created_at"] is not None and row["created_at"] > since]
    logged = set(AuditEntry.objects.filter(kind="TokenEntitlement", action="create", object_id__in=late)
                 .values_list("object_id", flat=True))
    unlogged = _unlogged_creations([row for row in rows if str(row["id"]) in set(late) - logged], present)
    history = entitlement_history(present, changes + [change for change, _words in unlogged], start=start)
    pools = {pk: pool for pk, pool in ((p.pk, p) for p in TokenPool.objects.filter(name__in=pictures))}
    translate = _Translator(pools, config, present, stored_state, pictures)
    arrivals: dict[str, list[float]] = {}
    for r in records:
        arrivals.setdefault(r.entitlement, []).append(r.arrived)
    gaps = [words for _change, words in unlogged]
    gaps += [f"The audit log contradicts itself: {gap}." for gap in history.gaps]
    followed: list[str] = []
    timelines: dict[str, dict[str, Timeline]] = {name: {} for name in pictures}
    for name, lifetime in history.lifetimes.items():
        covered = cover_records(lifetime, arrivals.get(name, ()), end=end)
        gaps += _gap_words(name, covered, start)
        followed += _followed_words(name, covered.lifetime, start, end)
        for pool_name, timeline in translate.timelines(covered.lifetime, start=start, end=end, gaps=gaps,
                                                       followed=followed).items():
            timelines[pool_name][name] = timeline
    out = {}
    for pool_name, picture in pictures.items():
        mine = timelines[pool_name]
        entitlements = dict(picture.entitlements)
        for name, timeline in mine.items():
            if name not in entitlements:
                entitlements[name] = next(limits for limits in (timeline.initial, *(c[1] for c in timeline.changes))
                                          if limits is not None)
        out[pool_name] = replace(picture, entitlements=entitlements, timelines=mine)
    return Lifetimes(out, followed, gaps)


def _unlogged_creations(rows: list[dict[str, Any]], present: dict[str, Fields]) -> list[tuple[AuditChange, str]]:
    """Rows created in the window (their `created_at`) whose creation the audit log does not have (entries
    missing, or written around the audit): their creation at that time, and why it is a gap."""
    out = []
    for row in rows:
        oid = str(row["id"])
        name = str(present[oid].get("name", ""))
        at = row["created_at"].timestamp()
        out.append((AuditChange(at, -1, "create", oid, name, None, dict(present[oid])),
                    f"Entitlement {name!r} was created at {_when(at)} by its row, but the audit log has no entry "
                    f"of it: the audit history is incomplete (entries missing, or written around the audit); the "
                    f"replay holds its limits from its creation as it is now."))
    return out


class _Translator:
    """Fields (audited, JSON or Python values) -> the gateway's limits, per pool."""

    def __init__(self, pools: dict[int, Any], config: GatewayConfig, present: dict[str, Fields],
                 stored_state: dict[str, str], pictures: dict[str, PoolPicture]) -> None:
        from apps.pools.models import TokenEntitlement

        self.model = TokenEntitlement
        self.pools = pools
        self.config = config
        self.pictures = pictures
        # The present rows by name: their limits are the snapshot's own (the pictures'), their state stored.
        self.present = {str(fields["name"]): (fields, stored_state[oid]) for oid, fields in present.items()}

    def limits(self, fields: Fields, gaps: list[str]) -> tuple[str, EntitlementLimits, float | None] | None:
        """The pool, the limits (Bound, or the row's stored state; an expiry is an event of its own) and the
        expiry (epoch seconds) of one state; None when it is in no replayed pool or cannot be read."""
        name = str(fields.get("name", ""))
        pool_id = _int(fields.get("pool_id"))
        pool = None if pool_id is None else self.pools.get(pool_id)
        if pool is None:
            return None  # another pool, or one deleted since: not replayed here
        now, state = self.present.get(name, (None, EntitlementState.BOUND.value))
        picture = self.pictures[pool.name].entitlements.get(name)
        try:
            expires_at = self.model._meta.get_field("expires_at").to_python(fields.get("expires_at"))
            if now is not None and fields == now and picture is not None:
                limits = picture
            else:
                limits = replace(self._built(fields, pool), state=state)
        except (TypeError, ValueError, ValidationError) as error:
            gaps.append(f"Entitlement {name!r}: a past state in the audit log cannot be read ({error}); "
                        f"that state is not replayed.")
            return None
        if limits.state == EntitlementState.EXPIRED.value:
            limits = replace(limits, state=EntitlementState.BOUND.value)  # expired at its expiry: `timelines`
        return pool.name, limits, None if expires_at is None else expires_at.timestamp()

    def _built(self, fields: Fields, pool: Any) -> EntitlementLimits:
        from apps.gateway.snapshot import entitlement_limits

        entitlement = self.model()
        for field in self.model._meta.concrete_fields:
            if field.attname in fields:
                setattr(entitlement, field.attname, field.to_python(fields[field.attname]))
        entitlement.expires_at = None  # the expiry is an event at its time (`timelines`), not a state now
        return entitlement_limits(entitlement, kv_bytes_per_token=float(pool.bytes_per_token),
                                  tenant_id=str(fields.get("tenant_id", "")),
                                  default_max_tokens=self.config.default_max_tokens,
                                  context_window=self.config.context_window)

    def timelines(self, lifetime: Lifetime, *, start: float, end: float, gaps: list[str],
                  followed: list[str]) -> dict[str, Timeline]:
        """The lifetime's states as limits, split by pool (a state in another pool is absence from this one);
        an expiry inside a state's span is a change to its limits in state Expired then (what the gateway's
        snapshot answers from its `expires_at` on: `KeyEntry.limits_at`)."""
        states = [(start, lifetime.initial), *((t, f) for t, f in lifetime.changes if start < t <= end)]
        translated = [(t, None if f is None else self.limits(f, gaps)) for t, f in states]
        out: dict[str, Timeline] = {}
        for pool_name in {item[0] for _t, item in translated if item is not None}:
            own: list[tuple[float, EntitlementLimits | None]] = []
            for index, (at, item) in enumerate(translated):
                if item is None or item[0] != pool_name:
                    own.append((at, None))
                    continue
                _pool, limits, expires = item
                expired = replace(limits, state=EntitlementState.EXPIRED.value)
                until = translated[index + 1][0] if index + 1 < len(translated) else end
                if expires is not None and expires <= at:
                    own.append((at, expired))
                    continue
                own.append((at, limits))
                if expires is not None and expires < until:
                    own.append((expires, expired))
                    followed.append(f"Entitlement {lifetime.name!r} expired {expires - start:.1f} s into the "
                                    f"window (its expires_at): refused from then on, as the gateway refused it.")
            out[pool_name] = Timeline(own[0][1], tuple(_changed(own[1:], own[0][1])))
        return out


def _changed(states: list[tuple[float, EntitlementLimits | None]],
             first: EntitlementLimits | None) -> list[tuple[float, EntitlementLimits | None]]:
    """Only the states that change the limits (an update of an unaudited-by-the-replay field is none)."""
    out = []
    last = first
    for when, limits in states:
        if limits != last:
            out.append((when, limits))
            last = limits
    return out


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _offset(at: float, start: float) -> str:
    return f"{at - start:.1f} s into the window" if at >= start else f"{start - at:.1f} s before the window"


def _when(at: float) -> str:
    return dt.datetime.fromtimestamp(at, tz=dt.UTC).isoformat()


def _gap_words(name: str, covered: Covered, start: float) -> list[str]:
    out = []
    if covered.before_creation is not None:
        count, first, created = covered.before_creation
        out.append(f"Entitlement {name!r} was created at {_when(created)} ({_offset(created, start)}) by the audit "
                   f"log, after {count} of its recorded requests (the first {_offset(first, start)}): the audit "
                   f"history is incomplete (entries missing, or changes written around it); the replay holds its "
                   f"limits from its first recorded request on.")
    if covered.after_deletion is not None:
        count, last, deleted = covered.after_deletion
        out.append(f"Entitlement {name!r} was deleted at {_when(deleted)} ({_offset(deleted, start)}) by the audit "
                   f"log, before {count} of its recorded requests (the last {_offset(last, start)}): the audit "
                   f"history is incomplete; the replay holds its limits to its last recorded request.")
    return out


def _followed_words(name: str, lifetime: Lifetime, start: float, end: float) -> list[str]:
    steps = []
    existed = lifetime.initial is not None
    for at, fields in lifetime.changes_within(start, end):
        steps.append(("deleted" if fields is None else "changed" if existed else "created") + f" {at - start:.1f} s")
        existed = fields is not None
    if not steps:
        return []
    return [f"Entitlement {name!r} follows its audit history through the window: {', '.join(steps)} into it "
            f"(as it was at each moment, not as it is now)."]
