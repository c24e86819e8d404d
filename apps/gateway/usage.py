"""Usage accounting off the request path, flushed to `UsageRecord` in batches.

With the in-process store, the request path adds to a dict keyed by (tenant, entitlement, minute); the
flusher swaps the dict out and upserts it in a worker thread (one transaction, increments, so several
gateway processes add up rather than overwrite). A process killed outright loses at most what it counted
since its last flush (`GATEWAY_USAGE_FLUSH_S`).

With Redis, a request's usage is counted in Redis by its release (the same script), and the flush claims
the pool's counts there and applies each claim once (`usage_batch_apply`): a process that dies loses none of
what Redis acknowledged. Rejections are counted in the process, as with the in-process store.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import dataclass

_Key = tuple[int, str, int]


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

    def _counts(self, tenant_id: int, entitlement: str) -> _Counts:
        key = (tenant_id, entitlement, current_minute())
        counts = self._pending.get(key)
        if counts is None:
            counts = self._pending[key] = _Counts()
        return counts

    def add(self, *, tenant_id: int, entitlement: str, prompt_tokens: int, completion_tokens: int) -> None:
        counts = self._counts(tenant_id, entitlement)
        counts.requests += 1
        counts.prompt_tokens += prompt_tokens
        counts.completion_tokens += completion_tokens

    def reject(self, *, tenant_id: int, entitlement: str) -> None:
        if tenant_id:
            self._counts(tenant_id, entitlement).rejected += 1

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> int:
        """Write what accumulated since the last flush; returns the number of rows touched."""
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


def usage_counts_parse(flat: Mapping[str, str]) -> dict[_Key, _Counts]:
    """The store's counts (`tenant|entitlement|minute|r|p|c` fields) as a batch."""
    batch: dict[_Key, _Counts] = {}
    for field, raw in flat.items():
        tenant, entitlement, minute, kind = field.rsplit("|", 3)
        counts = batch.setdefault((int(tenant), entitlement, int(minute)), _Counts())
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

    for (tenant_id, entitlement, minute), counts in batch.items():
        usage_record_add(
            tenant_id=tenant_id,
            entitlement=entitlement,
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
