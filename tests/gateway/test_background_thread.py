"""The background thread of the gateway's database work runs at a lower scheduling priority than the process."""

from __future__ import annotations

import os
import threading

from apps.gateway.background_thread import LOWEST, NICER_BY, background_executor


def _priority_of_this_thread() -> tuple[str, int]:
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_its_thread_is_nicer_than_the_process_and_the_rest_of_the_process_is_not() -> None:
    process = os.getpriority(os.PRIO_PROCESS, 0)
    executor = background_executor("test-background")
    try:
        name, priority = executor.submit(_priority_of_this_thread).result(timeout=10)
    finally:
        executor.shutdown(wait=True)
    assert name.startswith("test-background")
    assert priority == min(LOWEST, process + NICER_BY)  # nicer than the process, unless it is at 19 already
    # The caller's thread (here: the event loop's, in the gateway) keeps its priority.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == process


def test_a_thread_already_at_the_lowest_priority_stays_there() -> None:
    def at_lowest_then_lowered() -> int:
        from apps.gateway.background_thread import lower_priority

        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, LOWEST)
        lower_priority()  # no error, no change: 19 is as low as it goes
        return os.getpriority(os.PRIO_PROCESS, thread)

    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(at_lowest_then_lowered()))
    worker.start()
    worker.join(timeout=10)
    assert result == [LOWEST]
