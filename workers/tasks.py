"""Celery tasks: thin wrappers that run a tick from the registry (`workers.ticks`)."""

from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from workers.ticks import Outcome, run_tick, tick_specs

logger = logging.getLogger(__name__)


@shared_task(name="workers.tasks.run_tick", ignore_result=True)
def run_tick_task(name: str) -> str:
    """Run one tick. With several workers, a Redis lock keeps two runs of one tick from overlapping;
    a failure is logged by `run_tick` and the next beat firing is the retry."""
    url = getattr(settings, "REDIS_URL", "")
    if not url:
        return run_tick(name).value
    import redis

    period = tick_specs([name])[name].period_s
    client = redis.Redis.from_url(url)
    # The lock's timeout only frees it if a worker died holding it; a live run keeps it.
    lock = client.lock(f"tokenpools:tick-lock:{name}", timeout=max(60.0, 10 * period), blocking=False)
    try:
        if not lock.acquire():
            logger.info("tick %s skipped: running in another worker", name)
            return Outcome.SKIPPED.value
        try:
            return run_tick(name).value
        finally:
            lock.release()
    finally:
        client.close()
