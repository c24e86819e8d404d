"""The measuring client's heap set aside for a live run, and its collections during the run counted."""

from __future__ import annotations

import gc

import pytest

from apps.simulator import collector_pauses
from apps.simulator.collector_pauses import heap_set_aside


@pytest.fixture(autouse=True)
def nothing_frozen() -> None:
    gc.unfreeze()


def test_the_heap_alive_at_the_start_is_frozen_for_the_block_and_handed_back_after() -> None:
    kept = [object() for _ in range(1000)]
    with heap_set_aside() as report:
        assert report.frozen >= len(kept)
        assert gc.get_freeze_count() > 0
        assert report.full_collect_s > 0
    assert gc.get_freeze_count() == 0


def test_collections_in_the_block_are_counted_and_the_long_ones_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collector_pauses, "REPORTED_PAUSE_S", 0.0)  # every collection is "long": no timing assumed
    with heap_set_aside() as report:
        gc.collect(2)
        gc.collect(0)
    assert report.collections == 2
    assert [generation for generation, _seconds in report.pauses] == [2, 0]
    assert "2 collections during the run, 2 of 0 ms or more" in report.summary()
    # After the block, collections are not counted any more.
    gc.collect()
    assert report.collections == 2


def test_a_freeze_made_before_stays_after_the_block() -> None:
    gc.freeze()
    assert gc.get_freeze_count() > 0
    with heap_set_aside():
        pass
    # Still frozen (handed back, the count would be 0; frozen objects freed meanwhile lower it a little).
    assert gc.get_freeze_count() > 0
    gc.unfreeze()


def test_the_block_hands_the_heap_back_when_the_run_fails() -> None:
    with pytest.raises(RuntimeError), heap_set_aside():
        raise RuntimeError("the run failed")
    assert gc.get_freeze_count() == 0
    assert all(getattr(callback, "__name__", "") != "watch" for callback in gc.callbacks)
