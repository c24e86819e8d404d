"""A thread for the gateway's background database work that yields the CPU to the event loop.

The request log's flush (one INSERT of a few thousand rows) runs in a thread of the gateway's own process. Where
that thread and the event loop share a core (a process pinned to one, or a container limited to one), the
kernel's scheduler may let the thread finish its time slice before the loop runs again (milliseconds under
EEVDF), and every request that comes in meanwhile waits: the request log put about 1.5 ms on the in-process
store's p99 at 500 requests/s (bench/RESULTS.md). At a lower priority (nice +10 over the process's own) the
thread gives the core up as soon as the loop wants it, and runs when the loop waits: it still gets about a tenth
of a busy core, more than a flush needs at the most requests/s a process serves.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

logger = logging.getLogger(__name__)

# How much nicer than the process the thread runs (19 is the lowest priority there is).
NICER_BY = 10
LOWEST = 19


def background_executor(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """One thread, started on first use, at a lower scheduling priority than the rest of the process."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=lower_priority)


def lower_priority() -> None:
    """Lower the calling thread's scheduling priority (Linux: a thread's nice value is its own)."""
    try:
        thread = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(LOWEST, now + NICER_BY))
    except (AttributeError, OSError) as exc:  # no such call on this platform: the thread runs as the others
        logger.debug("background thread keeps its priority: %s", exc)
