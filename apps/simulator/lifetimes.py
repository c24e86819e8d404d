"""Each entitlement's lifetime over a replayed window, from the audit log (issue 26: a replay "under current").

Pure: no ORM (`apps.simulator.replay_site` reads the audit entries and the rows). "Current" for a recorded
window is the entitlements as they were at each moment of it: created, changed and deleted at their recorded
times. The audit log keeps every create (all audited fields after), update (only the changed fields, before
and after) and delete (all audited fields before) of an entitlement, so the state at the window's start is the
present rows with every later change undone, newest first; the changes inside the window are then replayed as
timed events (`apps.simulator.replay.ReplayAdmission`, through the seed scenarios' join and leave).

Objects are followed by their primary key (the audit's `object_id`), entitlements by name (what a request log
record names): a deleted and recreated entitlement is two objects of one name, a renamed one leaves its old
name and joins under its new one.

Where the history contradicts itself (an update or a delete of an object that, by the later entries, did not
exist then) or contradicts the request log (requests recorded while the entitlement did not exist), entries are
missing: `history_gaps` says so in words, and `cover_records` stretches the lifetime over its records rather
than refusing them all."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

Fields = dict[str, Any]
# Requests recorded this close outside a lifetime are the gateway's snapshot reload, not a gap in the history.
LIFETIME_SLACK_S = 2.0


class AuditChange(NamedTuple):
    """One audit entry of an entitlement (`apps.audit.models.AuditEntry`)."""

    at: float  # epoch seconds
    seq: int  # the entry's id: orders entries of the same instant
    action: str  # create | update | delete
    object_id: str
    object_name: str  # the entitlement's name when the entry was written
    before: Fields | None
    after: Fields | None


@dataclass(frozen=True)
class Lifetime:
    """One entitlement name over the window: its fields at the window's start (None: it did not exist) and each
    later change (epoch seconds, the fields from then on, or None: deleted), oldest first."""

    name: str
    initial: Fields | None
    changes: tuple[tuple[float, Fields | None], ...] = ()

    def at(self, when: float) -> Fields | None:
        """The fields in force at `when` (a change applies from its instant on)."""
        index = bisect.bisect_right([t for t, _ in self.changes], when)
        return self.initial if index == 0 else self.changes[index - 1][1]

    def intervals(self, end: float) -> list[tuple[float, float]]:
        """When it existed, as [from, to) spans up to `end` (a span still open ends there)."""
        out: list[tuple[float, float]] = []
        began: float | None = -float("inf") if self.initial is not None else None
        for when, fields in self.changes:
            if fields is None and began is not None:
                out.append((began, when))
                began = None
            elif fields is not None and began is None:
                began = when
        if began is not None:
            out.append((began, max(end, began)))
        return out

    def changes_within(self, start: float, end: float) -> tuple[tuple[float, Fields | None], ...]:
        return tuple((t, f) for t, f in self.changes if start < t <= end)


@dataclass(frozen=True)
class History:
    lifetimes: dict[str, Lifetime]
    gaps: list[str]  # contradictions found in the audit log itself, in words


def entitlement_history(present: dict[str, Fields], changes: Iterable[AuditChange], *, start: float) -> History:
    """Every entitlement's lifetime from `start` on: `present` is the rows now (object id -> audited fields,
    `name` among them), `changes` the audit entries at or after `start` (any order)."""
    state = {oid: dict(fields) for oid, fields in present.items()}
    gaps: list[str] = []
    events: list[tuple[float, int, str, Fields | None]] = []  # (at, seq, object id, its fields from then on)
    for change in sorted(changes, key=lambda c: (c.at, c.seq), reverse=True):
        if change.at < start:
            continue
        oid = change.object_id
        after = state.get(oid)
        events.append((change.at, change.seq, oid, None if after is None else dict(after)))
        name = _name(change)
        if change.action == "create":
            if after is None:
                gaps.append(f"{name!r} was created at {change.at:.3f} but its later deletion is not in the audit log")
            state.pop(oid, None)
        elif change.action == "delete":
            if after is not None:
                gaps.append(f"{name!r} was deleted at {change.at:.3f} but its later re-creation is not in the audit log")
            state[oid] = {"name": change.object_name, **(change.before or {})}
        else:  # update: only the changed fields; the others are those after it
            if after is None:
                gaps.append(f"{name!r} was changed at {change.at:.3f} but its later deletion is not in the audit log")
                after = {"name": change.object_name, **(change.after or {})}
            state[oid] = {**after, **(change.before or {})}
    events.reverse()
    return History(_by_name(state, events), gaps)


def _name(change: AuditChange) -> str:
    return change.object_name or f"object {change.object_id}"


def _by_name(initial: dict[str, Fields], events: Sequence[tuple[float, int, str, Fields | None]]) -> dict[str, Lifetime]:
    """Objects' states -> names' lifetimes (a rename is the old name's deletion and the new name's creation)."""
    starts: dict[str, Fields] = {}
    for first in initial.values():
        starts[str(first.get("name", ""))] = first
    current = dict(initial)
    named: dict[str, list[tuple[float, Fields | None]]] = {}
    for at, _seq, oid, fields in events:
        previous = current.pop(oid, None)
        if previous is not None and (fields is None or fields.get("name") != previous.get("name")):
            named.setdefault(str(previous.get("name", "")), []).append((at, None))
        if fields is not None:
            current[oid] = fields
            named.setdefault(str(fields.get("name", "")), []).append((at, fields))
    names = set(starts) | set(named)
    return {name: Lifetime(name, starts.get(name), tuple(named.get(name, ()))) for name in sorted(names)}


@dataclass(frozen=True)
class Covered:
    lifetime: Lifetime
    before_creation: tuple[int, float, float] | None = None  # (requests, first of them, the creation moved)
    after_deletion: tuple[int, float, float] | None = None  # (requests, last of them, the deletion moved)


def cover_records(lifetime: Lifetime, arrivals: Sequence[float], *, end: float,
                  slack_s: float = LIFETIME_SLACK_S) -> Covered:
    """The lifetime stretched over its recorded requests: a request the gateway decided while the history says
    the entitlement did not exist means entries are missing (or changes were written around the audit). A
    creation after such requests is moved back to the first of them; a deletion before them (with no creation
    after) is moved past the last. Requests within `slack_s` of a span are the snapshot's reload lag: covered.
    A name with no fields at any time is left as it is (nothing to replay it with)."""
    arrivals = sorted(arrivals)
    before: tuple[int, float, float] | None = None
    after: tuple[int, float, float] | None = None
    for _ in range(len(lifetime.changes) + 2):  # each fix covers at least one more request
        outside = _first_outside(lifetime, arrivals, end, slack_s)
        if outside is None:
            break
        changes = list(lifetime.changes)
        later = next((i for i, (t, f) in enumerate(changes) if t > outside and f is not None), None)
        if later is not None:
            at, fields = changes[later]
            count = sum(1 for a in arrivals if outside <= a < at)
            before = (count + (before[0] if before else 0), outside, at)
            changes[later] = (outside, fields)
        else:
            last_fields = next((f for _t, f in reversed(changes) if f is not None), lifetime.initial)
            deleted = next((i for i in range(len(changes) - 1, -1, -1) if changes[i][1] is None), None)
            if last_fields is None or deleted is None:
                break
            last = arrivals[-1]
            count = sum(1 for a in arrivals if a >= changes[deleted][0])
            after = (count, last, changes[deleted][0])
            changes[deleted] = (last + 1e-6, None)
        lifetime = replace(lifetime, changes=tuple(sorted(changes, key=lambda c: c[0])))
    return Covered(lifetime, before, after)


def _first_outside(lifetime: Lifetime, arrivals: Sequence[float], end: float, slack_s: float) -> float | None:
    spans = lifetime.intervals(max(end, arrivals[-1] if arrivals else end))
    for arrival in arrivals:
        if not any(lo - slack_s <= arrival < hi + slack_s for lo, hi in spans):
            return arrival
    return None
