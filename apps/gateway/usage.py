"""Usage accounting off the request path: counters in memory, flushed to `UsageRecord` in batches.

The request path adds to a dict keyed by (tenant, entitlement, minute); the flusher swaps the dict
out and upserts it in a worker thread (one transaction, increments, so several gateway processes
add up rather than overwrite).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass

_Key = tuple[int, str, int]


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
        key = (tenant_id, entitlement, int(time.time() // 60))
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


def usage_records_upsert_batch(batch: dict[_Key, _Counts]) -> int:
    from django.db import close_old_connections, transaction

    from apps.gateway.services import usage_record_add

    close_old_connections()
    with transaction.atomic():
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
    return len(batch)
