"""The Celery app: Redis as broker, the beat schedule built in code from the tick registry.

Run both with `celery -A workers.celery worker -B` (or a separate `celery -A workers.celery beat`).
Without a broker the same ticks run in-process (`workers.ticks.start_in_process_ticker`) or as a
standalone loop (`python manage.py run_ticks`).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokenpools_site.settings")

app = Celery("tokenpools")
# CELERY_BROKER_URL, CELERY_TASK_IGNORE_RESULT, ... from Django's settings.
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])


def beat_schedule() -> dict[str, dict[str, Any]]:
    """One entry per tick. A firing that waited longer than its period is dropped (`expires`), so a
    stalled worker does not come back to a pile of stale ticks; the task itself skips a firing while
    the previous run of the same tick is still going."""
    from workers.ticks import SERVER_ONLY_TICKS, tick_specs

    return {
        f"tick-{spec.name}": {
            "task": "workers.tasks.run_tick",
            "schedule": spec.period_s,
            "args": (spec.name,),
            "options": {"expires": spec.period_s},
        }
        for spec in tick_specs().values()
        if spec.name not in SERVER_ONLY_TICKS
    }


app.conf.beat_schedule = beat_schedule()
