"""A locked pool's entitlements in memory, bound as a sequence of writes would bind them, written once.

Each write to a pool (an entitlement created, changed, moved or deleted; the pool's capacity changed)
re-evaluates every entitlement of the pool (``apps.pools.services``: oldest first, each Bound when its
baseline fits the room the older ones left). ``PoolBinding`` keeps that outcome exact while doing the work
once: it loads the entitlements once, re-walks only from the first entitlement the write can change (an
evaluation is idempotent, so those before it keep their state: a new entitlement, the newest, is one step),
keeps each state change as the history row the write would have written, and at the end writes the rows
that changed in one ``UPDATE`` per distinct state and reason and the history in one ``bulk_create``. Every reason carries the last
write's trigger, as after that write's full evaluation. Each changed entitlement still sends ``post_save``
(``update_fields`` = the state fields), as its own ``save()`` did, so the gateway's snapshot reloads.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from datetime import datetime
from typing import Any

from django.db.models.signals import post_save

from apps.pools.models import (
    GIB,
    RESERVING_CLASSES,
    Capacity,
    EntitlementState,
    EntitlementStateChange,
    TokenEntitlement,
    TokenPool,
)

STATE_FIELDS = ["state", "state_reason", "state_changed_at"]


def _shortfall(need: Capacity, room: Capacity) -> str:
    parts = []
    if need.slots > room.slots:
        parts.append(f"concurrency {need.slots} > {max(room.slots, 0)} free slots")
    if need.tokens_per_second > room.tokens_per_second:
        parts.append(f"tokens/s {need.tokens_per_second} > {max(room.tokens_per_second, 0)} free")
    if need.kv_bytes > room.kv_bytes:
        parts.append(f"KV cache {need.kv_bytes / GIB:g} GiB > {max(room.kv_bytes, 0) / GIB:g} GiB free")
    return "; ".join(parts)


def _stays_bound_oversubscribed(ent: TokenEntitlement, capacity: Capacity) -> bool:
    """A Bound elastic entitlement keeps its binding through a capacity drop (not through losing it all)."""
    return ent.service_class == "elastic" and ent.state == EntitlementState.BOUND and capacity.slots > 0


Room = tuple[int, int, int]  # slots, tokens/s, KV bytes: a Capacity as plain ints (the walk's hot loop)


def evaluate_one(ent: TokenEntitlement, need: Room, room: Room, capacity: Capacity, pool_name: str,
                 now: datetime) -> tuple[str, str, Room]:
    """(target state, reason without trigger, room left for the newer ones) of one entitlement whose
    reservation is ``need``."""
    if ent.expires_at is not None and ent.expires_at <= now:  # ent.is_past_expiry(now)
        return str(EntitlementState.EXPIRED), f"expired at {ent.expires_at.isoformat()}", room
    if ent.service_class not in RESERVING_CLASSES:  # not ent.reserves_capacity
        return str(EntitlementState.BOUND), f"{ent.service_class} reserves no capacity; bound to pool {pool_name}", room
    if need[0] <= room[0] and need[1] <= room[1] and need[2] <= room[2]:
        kind = "time-averaged reservation" if ent.service_class == "elastic" else "reserved baseline"
        return (str(EntitlementState.BOUND), f"{kind} fits pool {pool_name}",
                (room[0] - need[0], room[1] - need[1], room[2] - need[2]))
    shortfall = _shortfall(Capacity(*need), Capacity(*room))
    if _stays_bound_oversubscribed(ent, capacity):
        return (str(EntitlementState.BOUND), f"pool {pool_name} shrank under this time-averaged reservation "
                f"({shortfall}): oversubscribed, shared by priority and debt", room)
    return str(EntitlementState.DEGRADED), f"baseline does not fit pool {pool_name}: {shortfall}", room


def _order(ent: TokenEntitlement) -> tuple[datetime, int]:
    return (ent.created_at, ent.pk)


class PoolBinding:
    """The entitlements of one pool whose row the caller holds locked, evaluated in memory (see the module)."""

    def __init__(self, pool: TokenPool, now: datetime, history: list[EntitlementStateChange] | None = None) -> None:
        self.pool = pool
        self.now = now
        self.capacity = pool.capacity()
        self.entitlements: list[TokenEntitlement] = list(
            pool.entitlements.select_for_update().order_by("created_at", "id"))
        self.stored: dict[int, tuple[str, str, datetime]] = {
            e.pk: (e.state, e.state_reason, e.state_changed_at) for e in self.entitlements}
        self.history = [] if history is None else history  # shared by the bindings of one apply: write order
        self.changes: list[tuple[TokenEntitlement, str, str]] = []
        self._by_pk = {e.pk: e for e in self.entitlements}
        self._base: dict[int, str] = {}
        self._room_after: list[Room] = []  # the room left after each evaluated entitlement
        self._needs: dict[int, Room] = {}  # each one's reservation, computed once (Decimal GiB to bytes)
        self._trigger: str | None = None  # the last write's; None: nothing evaluated yet

    def _position(self, ent: TokenEntitlement) -> int:
        return bisect.bisect_left(self.entitlements, _order(ent), key=_order)

    def get(self, pk: int) -> TokenEntitlement | None:
        return self._by_pk.get(pk)

    def evaluate(self, trigger: str, start: int = 0) -> None:
        """What a write's full evaluation does, walking from ``start`` (the first entitlement it can change)."""
        start = min(start, len(self._room_after))
        cap = self.capacity
        room = self._room_after[start - 1] if start else (cap.slots, cap.tokens_per_second, cap.kv_bytes)
        del self._room_after[start:]
        suffix = f" ({trigger})" if trigger else ""
        for ent in self.entitlements[start:]:
            need = self._needs.get(ent.pk)
            if need is None:
                r = ent.reservation
                need = self._needs[ent.pk] = (r.slots, r.tokens_per_second, r.kv_bytes)
            target, base, room = evaluate_one(ent, need, room, cap, self.pool.name, self.now)
            if ent.state != target:
                self.history.append(EntitlementStateChange(entitlement=ent, from_state=ent.state, to_state=target,
                                                           reason=(base + suffix)[:500], at=self.now))
                self.changes.append((ent, ent.state, target))
                ent.state = target
                ent.state_changed_at = self.now
            self._base[ent.pk] = base
            self._room_after.append(room)
        self._trigger = trigger

    def added(self, ent: TokenEntitlement, trigger: str) -> None:
        """A new (saved) entitlement of this pool: placed in order and evaluated from there."""
        position = self._position(ent)
        self.entitlements.insert(position, ent)
        self._by_pk[ent.pk] = ent
        self.stored[ent.pk] = (ent.state, ent.state_reason, ent.state_changed_at)
        self.evaluate(trigger, position)

    def changed(self, ent: TokenEntitlement, trigger: str) -> None:
        """One of its entitlements (this very object) changed: evaluated from it on."""
        self._needs.pop(ent.pk, None)
        self.evaluate(trigger, self._position(ent))

    def removed(self, ent: TokenEntitlement, trigger: str) -> None:
        """An entitlement left this pool (moved or deleted): the newer ones are evaluated again."""
        position = self._position(ent)
        del self.entitlements[position]
        self._by_pk.pop(ent.pk, None)
        self._needs.pop(ent.pk, None)
        self.stored.pop(ent.pk, None)
        self.evaluate(trigger, position)

    def flush(self) -> list[TokenEntitlement]:
        """Write the states and reasons that changed (not the history: ``write_history``); returns them."""
        if self._trigger is None:
            return []
        suffix = f" ({self._trigger})" if self._trigger else ""
        dirty = []
        for ent in self.entitlements:
            ent.state_reason = (self._base[ent.pk] + suffix)[:500]
            if (ent.state, ent.state_reason, ent.state_changed_at) != self.stored.get(ent.pk):
                dirty.append(ent)
        # One UPDATE per distinct (state, reason, time) and chunk of ids: most entitlements of a pool share their
        # reason ("reserved baseline fits pool p"), and Django's bulk_update (a CASE per row) costs far more.
        groups: dict[tuple[str, str, datetime], list[int]] = defaultdict(list)
        for ent in dirty:
            groups[(ent.state, ent.state_reason, ent.state_changed_at)].append(ent.pk)
        for (state, reason, at), pks in groups.items():
            for start in range(0, len(pks), 500):
                TokenEntitlement.objects.filter(pk__in=pks[start:start + 500]).update(
                    state=state, state_reason=reason, state_changed_at=at)
        for ent in dirty:
            self.stored[ent.pk] = (ent.state, ent.state_reason, ent.state_changed_at)
            post_save.send(sender=TokenEntitlement, instance=ent, created=False, update_fields=frozenset(STATE_FIELDS),
                           raw=False, using=ent._state.db or "default")
        return dirty


def write_history(history: list[EntitlementStateChange]) -> None:
    EntitlementStateChange.objects.bulk_create(history, batch_size=500)
    history.clear()


def evaluate_pool(pool: TokenPool, *, now: datetime, trigger: str) -> list[tuple[Any, str, str]]:
    """One write's evaluation of a locked pool, written at once; returns ``(entitlement, from, to)`` per change."""
    binding = PoolBinding(pool, now)
    binding.evaluate(trigger)
    binding.flush()
    write_history(binding.history)
    return binding.changes
