"""Usage accounting off the request path, flushed to `UsageRecord` in batches.

With the in-process store, the request path adds to a dict keyed by (tenant, entitlement, minute, served tier:
the class that served the request, its entitlement's or a lower one it spilled over or was demoted to); the
flusher swaps the dict out and upserts it in a worker thread (one transaction, increments, so several
gateway processes add up rather than overwrite). A process killed outright loses at most what it counted
since its last flush (`GATEWAY_USAGE_FLUSH_S`).

With Redis, a request's usage is counted in Redis by its release (the same script), and the flush claims
the pool's counts there and applies each claim once (`usage_batch_apply`): a process that dies loses none of
what Redis acknowledged. Rejections are counted in the process, as with the in-process store.

The keys the gateway accepted are noted the same way (`key_used`: a dict assignment) and their
`last_used_at` written by the flush, each key at most once per `KEY_USED_EVERY_S` per process: at most a
minute behind, and a key used a thousand times a second costs one UPDATE a minute.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import dataclass

_Key = tuple[int, str, int, str]
# How often one process writes one key's last_used_at at most (seconds).
KEY_USED_EVERY_S = 60.0


def current_minute() -> int:
    """The minute a usage count belongs to (wall clock: records are calendar minutes)."""
    return int(time.time() // 60)


@dataclass(slots=True)
class _Counts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejected: int = 0


class UsageAccumulator:
    def __init__(self) -> None:
        self._pending: dict[_Key, _Counts] = {}
        # Key id -> when it was last accepted, not written yet; and when each key was last written.
        self._keys_used: dict[int, float] = {}
        self._keys_written: dict[int, float] = {}

    def key_used(self, key_id: int, now: float) -> None:
        """The gateway accepted this key at `now` (epoch seconds)."""
        if now - self._keys_written.get(key_id, -KEY_USED_EVERY_S) >= KEY_USED_EVERY_S:
            self._keys_used[key_id] = now

    def _counts(self, tenant_id: int, entitlement: str, service_tier: str) -> _Counts:
        key = (tenant_id, entitlement, current_minute(), service_tier)
        counts = self._pending.get(key)
        if counts is None:
            counts = self._pending[key] = _Counts()
        return counts

    def add(self, *, tenant_id: int, entitlement: str, prompt_tokens: int, completion_tokens: int,
            service_tier: str = "") -> None:
        counts = self._counts(tenant_id, entitlement, service_tier)
        counts.requests += 1
        counts.prompt_tokens += prompt_tokens
        counts.completion_tokens += completion_tokens

    def reject(self, *, tenant_id: int, entitlement: str, service_tier: str = "") -> None:
        """A refused request, counted under its entitlement's own class (nothing served it)."""
        if tenant_id:
            self._counts(tenant_id, entitlement, service_tier).rejected += 1

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> int:
        """Write what accumulated since the last flush; returns the number of rows touched."""
        if self._keys_used:
            await self._flush_keys()
        if not self._pending:
            return 0
        batch, self._pending = self._pending, {}
        try:
            return await asyncio.get_running_loop().run_in_executor(None, usage_records_upsert_batch, batch)
        except Exception:
            # Keep the counts for the next flush rather than lose them (the database may be back).
            for key, counts in batch.items():
                merged = self._pending.setdefault(key, _Counts())
                merged.requests += counts.requests
                merged.prompt_tokens += counts.prompt_tokens
                merged.completion_tokens += counts.completion_tokens
                merged.rejected += counts.rejected
            raise


    async def _flush_keys(self) -> None:
        used, self._keys_used = self._keys_used, {}
        try:
            await asyncio.get_running_loop().run_in_executor(None, _keys_mark_used, used)
        except Exception:
            for key_id, when in used.items():  # the database may be back at the next flush
                self._keys_used[key_id] = max(when, self._keys_used.get(key_id, 0.0))
            raise
        self._keys_written.update(used)
        if len(self._keys_written) > 100_000:  # keys revoked long ago: forget when they were written
            horizon = time.time() - KEY_USED_EVERY_S
            self._keys_written = {k: t for k, t in self._keys_written.items() if t >= horizon}


def _keys_mark_used(used: dict[int, float]) -> int:
    from django.db import close_old_connections

    from apps.tenancy.services import apikeys_mark_used

    close_old_connections()
    return apikeys_mark_used(used_at={key_id: dt.datetime.fromtimestamp(when, tz=dt.UTC)
                                      for key_id, when in used.items()})


def usage_counts_parse(flat: Mapping[str, str]) -> dict[_Key, _Counts]:
    """The store's counts (`tenant|entitlement|minute|tier|kind` fields, kind r, p or c; counts from before
    tiers were recorded lack the tier) as a batch. An entitlement's lower tier, should the store name it
    `<entitlement>@<class>`, counts as that entitlement served at that class."""
    batch: dict[_Key, _Counts] = {}
    for field, raw in flat.items():
        parts = field.split("|")
        tenant, entitlement, minute, kind = parts[0], parts[1], parts[2], parts[-1]
        entitlement, _, tier = entitlement.partition("@")
        if len(parts) == 5:
            tier = parts[3]
        counts = batch.setdefault((int(tenant), entitlement, int(minute), tier), _Counts())
        value = int(raw)
        if kind == "r":
            counts.requests += value
        elif kind == "p":
            counts.prompt_tokens += value
        elif kind == "c":
            counts.completion_tokens += value
    return batch


def usage_batch_apply(token: str, batch: dict[_Key, _Counts]) -> bool:
    """Write a batch claimed from the shared store, once: False when its token was applied already."""
    from django.db import IntegrityError, close_old_connections, transaction

    from apps.gateway.models import UsageBatch

    close_old_connections()
    try:
        with transaction.atomic():
            UsageBatch.objects.create(token=token)
            _upsert(batch)
    except IntegrityError:
        if UsageBatch.objects.filter(token=token).exists():
            return False
        raise
    return True


def _upsert(batch: dict[_Key, _Counts]) -> None:
    from apps.gateway.services import usage_record_add

    for (tenant_id, entitlement, minute, tier), counts in batch.items():
        usage_record_add(
            tenant_id=tenant_id,
            entitlement=entitlement,
            service_tier=tier,
            minute=dt.datetime.fromtimestamp(minute * 60, tz=dt.UTC),
            requests=counts.requests,
            prompt_tokens=counts.prompt_tokens,
            completion_tokens=counts.completion_tokens,
            rejected=counts.rejected,
        )


def usage_records_upsert_batch(batch: dict[_Key, _Counts]) -> int:
    from django.db import close_old_connections, transaction

    close_old_connections()
    with transaction.atomic():
        _upsert(batch)
    return len(batch)
