"""What if follows each entitlement's lifetime (issue 26): "under current" is the entitlements as they were at each
moment of the window, from the audit log, written here by the real services (`entitlement_create`, `_update`,
`_delete`) and moved to the recorded window's times (the log's times are the only thing the test sets).

The workload is `test_replay`'s (a request every 0.4 s lasting 1.0 s, no queue) under a concurrency that
changes partway, reckoned independently as the gateway would have decided it."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from apps.audit.models import AuditEntry
from apps.gateway.request_log import Entry, request_log_write
from apps.pools.models import TokenEntitlement
from apps.pools.services import entitlement_delete, entitlement_update
from tests.pools.factories import acme, admin, make_entitlement, make_pool  # noqa: F401
from tests.simulator.test_replay import (
    COUNT,
    DURATION_S,
    GAP_S,
    SINCE,
    START,
    TTFT_MS,
    UNTIL,
    acme_entitlement,
)

pytestmark = pytest.mark.django_db
CHANGED_AT_S = 12.0


def _workload(tenant_id: int, entitlement: str, concurrency: Callable[[float], int], *, first: int = 0,
              count: int = COUNT) -> list[Entry]:
    """What the gateway records when the limit in force at each arrival is `concurrency(at)`."""
    ends: list[float] = []
    entries = []
    for index in range(first, first + count):
        at = index * GAP_S
        ends = [end for end in ends if end > at]
        served = len(ends) < concurrency(at)
        if served:
            ends.append(at + DURATION_S)
        entries.append(Entry(
            f"{entitlement}_{index}", START.timestamp() + at, tenant_id, "qwen3-8b", entitlement, "guaranteed",
            "guaranteed" if served else "", True, 100, 64, 46 if served else 0, "served" if served else "rejected",
            "" if served else "concurrency_limit_exceeded", 0.0, TTFT_MS if served else None,
            DURATION_S * 1000 if served else 1.0))
    return entries


def _at(name: str, action: str, seconds: float) -> None:
    """The audit entry of `action` on `name` moved to `seconds` into the recorded window."""
    entry = AuditEntry.objects.filter(kind="TokenEntitlement", object_name=name, action=action).latest("id")
    entry.at = START + dt.timedelta(seconds=seconds)
    entry.save(update_fields=["at"])


def _replay(*args: str) -> dict[str, Any]:
    out = StringIO()
    call_command("replay", "--since", SINCE, "--until", UNTIL, "--format", "json", *args, stdout=out)
    return json.loads(out.getvalue())


def _rejected(entries: list[Entry]) -> int:
    return sum(1 for e in entries if e.outcome == "rejected")


def test_a_change_of_concurrency_partway_is_replayed_at_its_recorded_time(admin: Any, acme: Any) -> None:  # noqa: F811
    pool = make_pool(admin)
    entitlement = make_entitlement(admin, acme, pool, "acme-chat", concurrency=2, queue_max=0, slo_target_ms=2000)
    _at("acme-chat", "create", -3600)
    entitlement_update(actor=admin, entitlement=entitlement, concurrency=1)
    _at("acme-chat", "update", CHANGED_AT_S)
    entries = _workload(acme.pk, "acme-chat", lambda at: 2 if at < CHANGED_AT_S else 1)
    request_log_write(entries)
    # The test can fail: under the concurrency now (1) throughout, the window would have refused more.
    assert _rejected(_workload(acme.pk, "acme-chat", lambda at: 1)) > _rejected(entries) + 5

    report = _replay()
    row = report["entitlements"]["acme-chat"]
    assert row["recorded"]["rejected"] == _rejected(entries)
    assert (row["current"]["admitted"], row["current"]["rejected"]) == (row["recorded"]["admitted"],
                                                                         row["recorded"]["rejected"])
    assert any("'acme-chat' follows its audit history" in c and "changed 12.0 s" in c for c in report["caveats"])
    assert not any("incomplete" in c for c in report["caveats"]), report["caveats"]


def test_an_entitlement_created_and_deleted_in_the_window_is_replayed_while_it_existed(
        admin: Any, acme: Any, tmp_path: Path) -> None:  # noqa: F811
    """acme-burst: created 10 s in, deleted 20 s in (Experiment 1's guaranteed-c); gone now."""
    pool = make_pool(admin)
    make_entitlement(admin, acme, pool, "acme-chat", concurrency=2, queue_max=0, slo_target_ms=2000)
    _at("acme-chat", "create", -3600)
    burst = make_entitlement(admin, acme, pool, "acme-burst", concurrency=1, queue_max=0, slo_target_ms=2000)
    _at("acme-burst", "create", 10.0)
    entitlement_delete(actor=admin, entitlement=burst)
    _at("acme-burst", "delete", 20.0)
    bursts = _workload(acme.pk, "acme-burst", lambda at: 1, first=25, count=25)  # 10.0 s to 19.6 s
    request_log_write(_workload(acme.pk, "acme-chat", lambda at: 2) + bursts)

    report = _replay()
    row = report["entitlements"]["acme-burst"]
    assert row["current"] is not None and row["current"]["offered"] == len(bursts)
    assert row["current"]["rejected"] == row["recorded"]["rejected"] == _rejected(bursts) > 0
    caveats = report["caveats"]
    assert any("'acme-burst' follows its audit history" in c and "created 10.0 s, deleted 20.0 s" in c
               for c in caveats), caveats
    assert not any("does not exist under current" in c or "incomplete" in c for c in caveats), caveats

    # A proposal re-creating it holds its definition for the whole window; acme-chat, unchanged, as under current.
    path = tmp_path / "proposed.yaml"
    path.write_text(acme_entitlement("acme-burst", 2))
    report = _replay("-f", str(path))
    assert report["entitlements"]["acme-burst"]["proposed"]["rejected"] < _rejected(bursts)
    chat = report["entitlements"]["acme-chat"]
    assert chat["proposed"]["rejected_by_reason"] == chat["current"]["rejected_by_reason"] == {
        "concurrency_limit_exceeded": 20}
    assert any("changes ('acme-burst') take its definition for the whole window" in c for c in report["caveats"])
    assert not TokenEntitlement.objects.filter(name="acme-burst").exists()


def test_requests_the_audit_log_cannot_place_say_the_history_is_incomplete(admin: Any, acme: Any) -> None:  # noqa: F811
    """Requests recorded 10 s after the logged deletion: entries are missing; the replay covers them anyway."""
    pool = make_pool(admin)
    burst = make_entitlement(admin, acme, pool, "acme-burst", concurrency=1, queue_max=0, slo_target_ms=2000)
    _at("acme-burst", "create", -3600)
    entitlement_delete(actor=admin, entitlement=burst)
    _at("acme-burst", "delete", 5.0)
    bursts = _workload(acme.pk, "acme-burst", lambda at: 1, count=40)  # to 15.6 s
    request_log_write(bursts)

    report = _replay()
    assert report["entitlements"]["acme-burst"]["current"]["rejected"] == _rejected(bursts)
    assert any("'acme-burst' was deleted at" in c and "history is incomplete" in c for c in report["caveats"])


def test_a_row_created_in_the_window_without_its_audit_entry_is_a_gap(admin: Any, acme: Any) -> None:  # noqa: F811
    """The audit entry of acme-chat's creation is gone (deleted by hand), its row says 10 s into the window."""
    pool = make_pool(admin)
    make_entitlement(admin, acme, pool, "acme-chat", concurrency=2, queue_max=0, slo_target_ms=2000)
    AuditEntry.objects.filter(kind="TokenEntitlement", object_name="acme-chat").delete()
    TokenEntitlement.objects.filter(name="acme-chat").update(created_at=START + dt.timedelta(seconds=10))
    entries = _workload(acme.pk, "acme-chat", lambda at: 2)
    request_log_write(entries)

    report = _replay()
    caveats = report["caveats"]
    assert any("'acme-chat' was created at" in c and "by its row" in c and "incomplete" in c for c in caveats)
    # Its requests before that are still replayed (the history stretched over them), and said so.
    assert any("'acme-chat' was created at" in c and "after 25 of its recorded requests" in c for c in caveats), caveats
    assert report["entitlements"]["acme-chat"]["current"]["rejected"] == _rejected(entries)


def test_an_expiry_in_the_window_refuses_from_its_instant_on(admin: Any, acme: Any) -> None:  # noqa: F811
    """acme-chat's expires_at is 12 s into the window (Expired now): served before, refused after, as live."""
    pool = make_pool(admin)
    make_entitlement(admin, acme, pool, "acme-chat", concurrency=2, queue_max=0, slo_target_ms=2000,
                     expires_at=START + dt.timedelta(seconds=CHANGED_AT_S))
    _at("acme-chat", "create", -3600)
    before = _workload(acme.pk, "acme-chat", lambda at: 2, count=30)  # to 11.6 s
    request_log_write(before + _workload(acme.pk, "acme-chat", lambda at: 0, first=30, count=30))

    report = _replay()
    current = report["entitlements"]["acme-chat"]["current"]
    assert current["rejected_by_reason"] == {"concurrency_limit_exceeded": _rejected(before),
                                             "entitlement_not_bound": 30}
    assert any("'acme-chat' expired 12.0 s into the window" in c for c in report["caveats"]), report["caveats"]
