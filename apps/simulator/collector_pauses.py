"""The measuring client's own pauses: a live run times first tokens in the process that sends the requests, so a
pause of that process (its garbage collector scanning a heap the run did not make, e.g. a test session's after
thousands of tests) is read as the gateway's latency. The heap alive when the clock starts is set aside (`gc.freeze`,
as the site does with its start-up heap), and what collections still run, and how long, is reported with the run.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# A collection at least this long is listed in the report (one decode step of the agreement scenarios is 133 ms; a
# pause of a few milliseconds is the machine's noise, not worth a line).
REPORTED_PAUSE_S = 0.01


@dataclass
class CollectorPauses:
    """What the collector did to the measuring process around one run."""

    frozen: int = 0  # objects alive when the clock started, set aside for the run
    full_collect_s: float = 0.0  # what one full collection took just before: a pause the run would have risked
    collections: int = 0  # collections during the run, every generation
    pauses: list[tuple[int, float]] = field(default_factory=list)  # (generation, seconds), the long ones

    def summary(self) -> str:
        longest = max((seconds for _generation, seconds in self.pauses), default=0.0)
        return (f"measuring process: {self.frozen:,} objects set aside (a full collection of them took "
                f"{self.full_collect_s * 1000:.0f} ms); {self.collections} collections during the run, "
                f"{len(self.pauses)} of {REPORTED_PAUSE_S * 1000:.0f} ms or more (longest {longest * 1000:.0f} ms)")


@contextlib.contextmanager
def heap_set_aside() -> Iterator[CollectorPauses]:
    """Collect once, freeze what is left for the block, and count the collections that run inside it. The
    objects are handed back to the collector at the end unless something froze objects before (the freeze is
    process-wide: theirs stay frozen)."""
    report = CollectorPauses()
    frozen_before = gc.get_freeze_count()
    started = time.perf_counter()
    gc.collect()
    report.full_collect_s = time.perf_counter() - started
    gc.freeze()
    report.frozen = gc.get_freeze_count() - frozen_before
    began: list[float] = []

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began.append(time.perf_counter())
            return
        report.collections += 1
        took = time.perf_counter() - began.pop() if began else 0.0
        if took >= REPORTED_PAUSE_S:
            report.pauses.append((int(info["generation"]), took))

    gc.callbacks.append(watch)
    try:
        yield report
    finally:
        gc.callbacks.remove(watch)
        if frozen_before == 0:
            gc.unfreeze()
