"""An entitlement's lifetime over a replayed window, from the audit log (`apps.simulator.lifetimes`): the rows
now with every later change undone, newest first, then the window's changes as timed events."""

from __future__ import annotations

from typing import Any

from apps.simulator.lifetimes import AuditChange, Lifetime, cover_records, entitlement_history

START = 1000.0
C6 = {"name": "guaranteed-c", "pool_id": 1, "concurrency": 6, "service_class": "guaranteed"}


def _change(at: float, seq: int, action: str, oid: str, before: Any = None, after: Any = None) -> AuditChange:
    name = str((after or before or {}).get("name", "guaranteed-c"))
    return AuditChange(START + at, seq, action, oid, name, before, after)


def test_created_and_deleted_in_the_window() -> None:
    """Experiment 1's guaranteed-c: created at 20 s, deleted at 40 s, absent now."""
    history = entitlement_history({}, [_change(40, 2, "delete", "7", before=C6), _change(20, 1, "create", "7", after=C6)],
                                  start=START)
    assert history.gaps == []
    lifetime = history.lifetimes["guaranteed-c"]
    assert lifetime.initial is None
    assert lifetime.changes == ((START + 20, C6), (START + 40, None))
    assert lifetime.at(START + 10) is None and lifetime.at(START + 20) == C6 and lifetime.at(START + 40) is None
    assert lifetime.intervals(START + 60) == [(START + 20, START + 40)]


def test_an_update_restores_only_its_changed_fields_before_it() -> None:
    now = {**C6, "concurrency": 4, "slo_target_ms": 1000}
    history = entitlement_history({"7": now}, [_change(30, 5, "update", "7", before={"concurrency": 6},
                                                       after={"concurrency": 4})], start=START)
    lifetime = history.lifetimes["guaranteed-c"]
    assert lifetime.initial == {**now, "concurrency": 6}  # the unchanged fields are the row's now
    assert lifetime.changes == ((START + 30, now),)


def test_a_change_after_the_window_is_undone_and_one_before_it_is_not_followed() -> None:
    now = {**C6, "concurrency": 2}
    changes = [_change(-50, 1, "update", "7", before={"concurrency": 9}, after={"concurrency": 6}),
               _change(500, 2, "update", "7", before={"concurrency": 6}, after={"concurrency": 2})]
    lifetime = entitlement_history({"7": now}, changes, start=START).lifetimes["guaranteed-c"]
    assert lifetime.initial == C6  # as it was during the window, not now, and not before it
    assert lifetime.changes_within(START, START + 60) == ()


def test_a_recreated_entitlement_is_two_objects_of_one_name() -> None:
    """Deleted at 10 s (concurrency 6), created again at 30 s as a new row (concurrency 3)."""
    c3 = {**C6, "concurrency": 3}
    changes = [_change(30, 2, "create", "8", after=c3), _change(10, 1, "delete", "7", before=C6)]
    history = entitlement_history({"8": c3}, changes, start=START)
    lifetime = history.lifetimes["guaranteed-c"]
    assert lifetime.initial == C6
    assert lifetime.changes == ((START + 10, None), (START + 30, c3))
    assert lifetime.intervals(START + 60) == [(-float("inf"), START + 10), (START + 30, START + 60)]
    assert history.gaps == []


def test_a_rename_leaves_the_old_name_and_joins_under_the_new() -> None:
    renamed = {**C6, "name": "gold-c"}
    rename = AuditChange(START + 15, 1, "update", "7", "guaranteed-c", {"name": "guaranteed-c"}, {"name": "gold-c"})
    history = entitlement_history({"7": renamed}, [rename], start=START)
    assert history.lifetimes["guaranteed-c"] == Lifetime("guaranteed-c", C6, ((START + 15, None),))
    assert history.lifetimes["gold-c"] == Lifetime("gold-c", None, ((START + 15, renamed),))


def test_an_entitlement_absent_from_the_history_keeps_its_definition_now() -> None:
    history = entitlement_history({"3": {**C6, "name": "guaranteed-a"}}, [], start=START)
    assert history.lifetimes["guaranteed-a"] == Lifetime("guaranteed-a", {**C6, "name": "guaranteed-a"}, ())


def test_entries_that_contradict_the_later_ones_are_gaps() -> None:
    """A change to a row that, by the rows now, no longer exists: its deletion is missing from the log."""
    history = entitlement_history({}, [_change(30, 1, "update", "7", before={"concurrency": 6},
                                               after={"concurrency": 4})], start=START)
    assert len(history.gaps) == 1 and "'guaranteed-c'" in history.gaps[0] and "deletion" in history.gaps[0]


def test_requests_before_the_recorded_creation_move_it_back_to_the_first_of_them() -> None:
    lifetime = Lifetime("guaranteed-c", None, ((START + 20, C6),))
    covered = cover_records(lifetime, [START + 5, START + 6, START + 25], end=START + 60)
    assert covered.lifetime.changes == ((START + 5, C6),)
    assert covered.before_creation == (2, START + 5, START + 20) and covered.after_deletion is None


def test_requests_after_the_recorded_deletion_move_it_past_the_last_of_them() -> None:
    lifetime = Lifetime("guaranteed-c", C6, ((START + 20, None),))
    covered = cover_records(lifetime, [START + 10, START + 30, START + 35], end=START + 60)
    assert covered.lifetime.intervals(START + 60) == [(-float("inf"), START + 35 + 1e-6)]
    assert covered.after_deletion == (2, START + 35, START + 20) and covered.before_creation is None


def test_requests_within_the_snapshots_reload_lag_are_not_a_gap() -> None:
    lifetime = Lifetime("guaranteed-c", None, ((START + 20, C6), (START + 40, None)))
    covered = cover_records(lifetime, [START + 20.5, START + 39.9, START + 41.0], end=START + 60)
    assert covered == cover_records(lifetime, [], end=START + 60)
    assert covered.lifetime == lifetime


def test_a_name_that_never_existed_stays_absent() -> None:
    covered = cover_records(Lifetime("ghost", None, ()), [START + 1], end=START + 60)
    assert covered.lifetime == Lifetime("ghost", None, ()) and covered.before_creation is None
