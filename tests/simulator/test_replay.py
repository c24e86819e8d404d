"""What if (issue 26): `manage.py replay` turns a recorded window of the request log into a workload and
replays it in the simulator under the current entitlements and a proposed manifest (never persisted).

The window is written through the real request-log path (`request_log_write`) from a known workload: one
entitlement with concurrency 2 and no queue, a request every 0.4 s lasting 1.0 s (100 prompt tokens, 10 ms to
the first token, 46 completion tokens), so that every third request finds two in flight and is refused."""

from __future__ import annotations

import datetime as dt
import json
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from apps.gateway.models import RequestLogRecord
from apps.gateway.request_log import Entry, request_log_write
from apps.pools.models import TokenEntitlement
from apps.simulator.replay import Recorded, fit_latency
from apps.simulator.replay_site import ReplayInputError, parse_window
from tests.pools.factories import acme, admin, make_entitlement, make_pool  # noqa: F401
from tests.support.manifests import entitlement

pytestmark = pytest.mark.django_db

START = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)
SINCE, UNTIL = "2026-11-26T12:00:00Z", "2026-11-26T12:01:00Z"
GAP_S, DURATION_S, COUNT = 0.4, 1.0, 60
# 10 ms to the first token of 100 prompt tokens: a prefill that stalls the requests in flight by only that much.
TTFT_MS = 10.0


def _known_workload(tenant_id: int, *, concurrency: int = 2) -> list[Entry]:
    """What the gateway records for the workload under `concurrency` (an independent reckoning of it)."""
    ends: list[float] = []
    entries = []
    for index in range(COUNT):
        at = index * GAP_S
        ends = [end for end in ends if end > at]
        served = len(ends) < concurrency
        if served:
            ends.append(at + DURATION_S)
        entries.append(Entry(
            f"req_{index}", START.timestamp() + at, tenant_id, "qwen3-8b", "acme-chat", "guaranteed",
            "guaranteed" if served else "", True, 100, 64, 46 if served else 0,
            "served" if served else "rejected", "" if served else "concurrency_limit_exceeded", 0.0,
            TTFT_MS if served else None, DURATION_S * 1000 if served else 1.0))
    return entries


def record_two_tenants(acme_id: int, globex_id: int) -> None:
    """The known workload recorded for acme-chat, and again for globex-chat 0.2 s later (the What if tests'
    pool of two tenants)."""
    request_log_write(_known_workload(acme_id))
    request_log_write([e._replace(request_id=f"g{e.request_id}", tenant_id=globex_id, entitlement="globex-chat",
                                  arrived=e.arrived + 0.2) for e in _known_workload(globex_id)])


# The What if tests' proposal: acme-chat down to one slot, no queue.
def acme_entitlement(name: str, concurrency: int, queue_max: int | None = 0) -> str:
    """A guaranteed acme entitlement on qwen3-8b as the proposals of these tests write it."""
    return entitlement(name, tenant="acme", pool="qwen3-8b", service_class="guaranteed", concurrency=concurrency,
                       tokens_per_second=100, kv_cache_gib=2, slo_target_ms=2000, queue_max=queue_max)


PROPOSED_ACME_CHAT = acme_entitlement("acme-chat", 1)


@pytest.fixture
def window(admin: Any, acme: Any) -> TokenEntitlement:  # noqa: F811  (the imported fixtures)
    pool = make_pool(admin)
    entitlement = make_entitlement(admin, acme, pool, "acme-chat", concurrency=2, queue_max=0, slo_target_ms=2000)
    request_log_write(_known_workload(acme.pk))
    return entitlement


def _proposed(tmp_path: Path, *, concurrency: int, extra: str = "") -> str:
    path = tmp_path / "proposed.yaml"
    path.write_text(acme_entitlement("acme-chat", concurrency) + extra)
    return str(path)


def _replay(*args: str) -> dict[str, Any]:
    out = StringIO()
    call_command("replay", "--since", SINCE, "--until", UNTIL, "--format", "json", *args, stdout=out)
    return json.loads(out.getvalue())


def test_replay_under_current_matches_what_was_recorded(window: TokenEntitlement) -> None:
    report = _replay()
    assert set(report) == {"window", "entitlements", "pools", "caveats"}
    row = report["entitlements"]["acme-chat"]
    recorded, current = row["recorded"], row["current"]
    assert set(recorded) == set(current) >= {"admitted", "rejected", "rejected_by_reason", "p99_ttft_s", "waited"}
    assert recorded["peak_debt"] is None and current["peak_debt"] is not None
    assert recorded["admitted"] == 40 and recorded["rejected"] == 20  # every third refused
    assert current["admitted"] == recorded["admitted"]
    assert current["rejected_by_reason"] == recorded["rejected_by_reason"] == {"concurrency_limit_exceeded": 20}
    # The fitted model gives the recorded times back: 10 ms to the first token, plus at most the steps of the batch
    # it joins (the step that prefills it also decodes the requests in flight: 22 ms; and the step it waits for).
    assert 0.01 <= current["p50_ttft_s"] <= current["p99_ttft_s"] <= 0.01 + 2 * 0.022 + 0.01
    times = report["window"]["service_times"]["qwen3-8b"]
    # Decode: 22 ms less the share of the time the others' prefills took (40 served in ~24 s, 10 ms each: 1.7%),
    # which the replayed steps add back.
    assert times["prefill_ms_per_token"] == pytest.approx(0.1)
    assert times["decode_ms_per_token"] == pytest.approx(22.0 * (1 - 40 / 23.6 * 100 * 0.1 / 1000), rel=0.002)
    assert "proposed" not in row and report["window"]["records"] == COUNT
    # Without a proposed manifest there is no proposed column to be missing from.
    assert not any("under proposed" in c for c in report["caveats"]), report["caveats"]
    # The entitlement was made (now) after the recorded window began: its limits held from the start in the replay.
    assert any("'acme-chat' was created at" in c for c in report["caveats"]), report["caveats"]


def test_halving_concurrency_refuses_more_and_is_never_persisted(window: TokenEntitlement, tmp_path: Path) -> None:
    report = _replay("-f", _proposed(tmp_path, concurrency=1))
    row = report["entitlements"]["acme-chat"]
    assert row["proposed"]["rejected"] > row["current"]["rejected"] + 10
    assert row["proposed"]["admitted"] == COUNT - row["proposed"]["rejected"]
    assert set(row["proposed"]) >= {"admitted", "rejected", "rejected_by_reason", "p99_ttft_s", "peak_debt"}
    assert report["pools"]["qwen3-8b"]["proposed"]["rejected"] == row["proposed"]["rejected"]
    window.refresh_from_db()
    assert window.concurrency == 2  # the proposal was applied inside a rolled-back transaction only


def test_a_proposed_entitlement_without_traffic_is_a_caveat(window: TokenEntitlement, tmp_path: Path) -> None:
    extra = "---" + acme_entitlement("acme-new", 4, queue_max=None)
    report = _replay("-f", _proposed(tmp_path, concurrency=2, extra=extra))
    assert report["entitlements"]["acme-new"]["current"] is None
    assert report["entitlements"]["acme-new"]["proposed"]["offered"] == 0
    assert any("'acme-new' has no recorded traffic" in c for c in report["caveats"])
    assert any("Open loop" in c for c in report["caveats"])
    assert not TokenEntitlement.objects.filter(name="acme-new").exists()


def test_table_shows_every_column_and_the_caveats(window: TokenEntitlement, tmp_path: Path) -> None:
    out = StringIO()
    call_command("replay", "--since", SINCE, "--until", UNTIL, "-f", _proposed(tmp_path, concurrency=1), stdout=out)
    text = out.getvalue()
    assert "acme-chat" in text and "recorded" in text and "current" in text and "proposed" in text
    assert "concurrency_limit_exceeded=20" in text and "caveats:" in text and "fitted from 40 served" in text


def test_a_wrong_manifest_gets_applys_errors_and_exit_code_2(window: TokenEntitlement, tmp_path: Path) -> None:
    path = Path(_proposed(tmp_path, concurrency=1))
    path.write_text(path.read_text().replace("concurrency: 1", "concurrency: -3"))
    with pytest.raises(CommandError) as caught:
        _replay("-f", str(path))
    assert caught.value.returncode == 2
    message = str(caught.value)
    assert "proposed.yaml" in message and "TokenEntitlement" in message and "acme-chat" in message
    assert "concurrency" in message


def test_an_empty_window_says_so_with_the_oldest_record(window: TokenEntitlement) -> None:
    out = StringIO()
    with pytest.raises(CommandError) as caught:
        call_command("replay", "--since", "2026-11-20T00:00:00", "--until", "2026-11-21T00:00:00", stdout=out)
    assert caught.value.returncode == 1
    assert "no requests recorded" in str(caught.value) and "oldest record is from 2026-11-26T12:00:00" in str(
        caught.value)
    with pytest.raises(CommandError, match="in pool 'other'"):
        call_command("replay", "--since", SINCE, "--until", UNTIL, "--pool", "other", stdout=out)


def test_a_window_past_the_retention_says_what_it_has(window: TokenEntitlement, settings: Any) -> None:
    settings.GATEWAY_REQUEST_LOG_DAYS = 1
    report = _replay_from("2026-11-01T00:00:00Z")
    assert any("GATEWAY_REQUEST_LOG_DAYS=1" in c and "2026-11-26T12:00:00" in c for c in report["caveats"])


def _replay_from(since: str) -> dict[str, Any]:
    out = StringIO()
    call_command("replay", "--since", since, "--until", UNTIL, "--format", "json", stdout=out)
    return json.loads(out.getvalue())


@pytest.mark.parametrize("since, until, message", [
    ("yesterday", None, "--since: expected a duration"),
    ("1h", "soon", "--until: expected a duration"),
    ("2026-11-26T12:00:00Z", "2026-11-26T11:00:00Z", "must be after --since"),
])
def test_bad_times_are_refused_clearly(db: Any, since: str, until: str | None, message: str) -> None:
    args = ["--since", since] + (["--until", until] if until else [])
    with pytest.raises(CommandError, match=message) as caught:
        call_command("replay", *args)
    assert caught.value.returncode == 2


def test_relative_windows_end_now() -> None:
    now = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)
    assert parse_window("90m", None, now=now) == (now - dt.timedelta(minutes=90), now)
    with pytest.raises(ReplayInputError):
        parse_window("-1h", None, now=now)


def test_latency_is_fitted_to_served_records_only() -> None:
    served = Recorded(0.0, 1, "p", "e", 200, None, 11, "served", "", 50.0, 250.0, 750.0)
    refused = Recorded(0.0, 1, "p", "e", 200, None, 0, "rejected", "x", 0.0, None, 1.0)
    latency = fit_latency([served, refused])
    # Prefill: what the first token took beyond its wait and the one decode step its step also ran, per token.
    assert (latency.prefill_ms_per_token, latency.decode_ms_per_token, latency.fitted_from) == (0.75, 50.0, 1)
    # A first token sooner than a decode step came out of a step that decoded nothing else: all prefill.
    quick = Recorded(0.0, 1, "p", "e", 200, None, 11, "served", "", 0.0, 20.0, 520.0)
    assert fit_latency([quick]).prefill_ms_per_token == pytest.approx(0.1)
    assert RequestLogRecord.__name__  # the model the records come from


def test_first_tokens_that_came_out_together_were_prefilled_together() -> None:
    """Six closed-loop requests sent at once, 100 prompt tokens each, on a 100 ms-step replica prefilling 0.5 ms a
    token: one step of 600 prompt tokens (300 ms) plus its decode step, so each first token took 400 ms. Charged
    to each request's own 100 tokens that would be 3 ms a token; it is the step's 600 tokens at 0.5 ms."""
    together = [Recorded(10.0, 1, "p", "e", 100, None, 11, "served", "", 0.0, 400.0, 1400.0) for _ in range(6)]
    latency = fit_latency(together)
    assert latency.prefill_ms_per_token == pytest.approx(0.5)
    assert latency.decode_ms_per_token == pytest.approx(100.0)

