"""The live figures are pure functions of samples: checked here without a browser, and validated by
plotly's own figure schema (`go.Figure` refuses an unknown property)."""

from __future__ import annotations

import json
import re

import plotly.graph_objects as go
import pytest

from apps.dashboard import colors, figures
from apps.dashboard.samples import EntitlementPoint, PoolSample, Visibility, sample_visible, samples_visible
from apps.dashboard.usage import daily_figure

T0 = 1_800_000_000.0


def point(name: str, **fields: object) -> EntitlementPoint:
    base: dict[str, object] = {"tenant": name.split("-")[0], "service_class": "guaranteed", "slo_ms": 500.0,
                               "baseline_tokens_per_s": 100.0}
    base.update(fields)
    return EntitlementPoint(name=name, **base)  # type: ignore[arg-type]


def sample(i: int, *points: EntitlementPoint, **fields: object) -> PoolSample:
    base: dict[str, object] = {"slots": 16, "budget": 16, "running": sum(p.in_flight for p in points),
                               "queued": sum(p.queued for p in points), "kv_usage": {"http://r1": 0.25}}
    base.update(fields)
    return PoolSample(time=T0 + i, pool="qwen", entitlements=tuple(points), **base)  # type: ignore[arg-type]


@pytest.fixture
def history() -> list[PoolSample]:
    return [
        sample(0, point("acme-a", in_flight=6, debt=0.1, priority=90.0, admitted=5),
               point("globex-b", in_flight=10, queued=2, denied={"pool_contended": 3}), budget=16),
        sample(1, point("acme-a", in_flight=5, p99_ttft_s=0.4, tokens_per_s=80.0),
               point("globex-b", in_flight=11, denied={"concurrency_limit_exceeded": 1}), budget=17, aimd_action=1),
        sample(2, point("acme-a", in_flight=6), point("globex-b", in_flight=9), budget=8, aimd_action=-1),
    ]


def traces(figure: figures.Figure) -> dict[str, dict]:
    return {t["meta"]: t for t in figure["data"]}


@pytest.mark.parametrize(("fid", "build"), figures.FIGURES)
def test_every_figure_is_valid_plotly_and_json(fid: str, build: figures.Builder, history: list[PoolSample]) -> None:
    figure = build(history, visible_entitlements=None)
    go.Figure(figure)  # raises on any property plotly does not know
    json.dumps(figure)  # what the websocket sends
    uids = [t["uid"] for t in figure["data"]]
    assert len(uids) == len(set(uids)), f"{fid}: duplicate trace uids"
    # plotly.js builds CSS selectors from uids: nothing but letters, digits, - and _.
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", uid) for uid in uids), uids
    assert figure["layout"]["xaxis"]["type"] == "date"


def test_inflight_is_stacked_by_entitlement_against_slots(history: list[PoolSample]) -> None:
    fig = traces(figures.figure_inflight_stacked(history, visible_entitlements=None))
    assert fig["inflight:acme-a"]["y"] == [6, 5, 6]
    assert fig["inflight:globex-b"]["y"] == [10, 11, 9]
    assert fig["inflight:acme-a"]["stackgroup"] == fig["inflight:globex-b"]["stackgroup"]
    assert fig["inflight:slots"]["y"] == [16, 16, 16]
    assert fig["inflight:acme-a"]["x"] == [T0 * 1000, (T0 + 1) * 1000, (T0 + 2) * 1000]


def test_visible_entitlements_leave_out_other_tenants_series(history: list[PoolSample]) -> None:
    for _fid, build in figures.FIGURES:
        figure = build(history, visible_entitlements=["acme-a"])
        assert not any("globex" in json.dumps(t) for t in figure["data"]), _fid


def test_ttft_draws_each_slo_as_a_line_in_seconds(history: list[PoolSample]) -> None:
    fig = traces(figures.figure_ttft_vs_slo(history, visible_entitlements=None))
    assert fig["slo:acme-a"]["y"] == [0.5, 0.5, 0.5]
    assert fig["slo:acme-a"]["line"]["dash"] == "dash"
    # Only the samples that had a p99 get a point (no zeros invented for "no requests").
    assert fig["ttft:acme-a"]["y"] == [0.4]
    assert fig["ttft:acme-a"]["x"] == [(T0 + 1) * 1000]


def test_admissions_go_up_and_denials_by_reason_go_down(history: list[PoolSample]) -> None:
    figure = figures.figure_admissions_by_reason(history, visible_entitlements=None)
    fig = traces(figure)
    assert figure["layout"]["barmode"] == "relative"
    assert fig["admitted:acme-a"]["y"] == [5, 0, 0]
    assert fig["denied:globex-b:pool_contended"]["y"] == [-3]
    assert fig["denied:globex-b:concurrency_limit_exceeded"]["y"] == [-1]
    assert fig["denied:globex-b:concurrency_limit_exceeded"]["x"] == [(T0 + 1) * 1000]


def test_aimd_marks_increases_and_decreases_at_the_budget(history: list[PoolSample]) -> None:
    fig = traces(figures.figure_aimd_budget(history, visible_entitlements=None))
    assert fig["aimd:budget"]["y"] == [16, 17, 8]
    assert fig["aimd:increase"]["y"] == [17] and fig["aimd:increase"]["x"] == [(T0 + 1) * 1000]
    assert fig["aimd:decrease"]["y"] == [8] and fig["aimd:decrease"]["x"] == [(T0 + 2) * 1000]


def test_debt_on_the_left_axis_priority_on_the_right(history: list[PoolSample]) -> None:
    figure = figures.figure_debt_priority(history, visible_entitlements=None)
    fig = traces(figure)
    assert fig["debt:acme-a"]["y"][0] == 0.1
    assert fig["priority:acme-a"]["yaxis"] == "y2"
    assert fig["priority:acme-a"]["y"] == [90.0]  # None priorities draw no point
    assert figure["layout"]["yaxis2"]["overlaying"] == "y"


def test_kv_per_replica_in_percent_and_tokens_against_baseline(history: list[PoolSample]) -> None:
    kv = traces(figures.figure_kv_usage(history, visible_entitlements=None))
    assert kv["kv:http://r1"]["y"] == [25.0, 25.0, 25.0]
    tokens = traces(figures.figure_tokens_vs_baseline(history, visible_entitlements=None))
    assert tokens["tokens:acme-a"]["y"] == [0.0, 80.0, 0.0]
    assert tokens["baseline:acme-a"]["y"] == [100.0, 100.0, 100.0]


def test_update_holds_exactly_the_points_a_redraw_adds(history: list[PoolSample]) -> None:
    before = figures.figures_all(history[:2], visible_entitlements=None)
    after = figures.figures_all(history, visible_entitlements=None)
    update = figures.figure_update(history[2], None)
    for fid, figure in after.items():
        old = traces(before[fid])
        new = {t["meta"]: t for t in update[fid]}
        for uid, trace in traces(figure).items():
            appended = new.get(uid, {"x": [], "y": []})
            previous = old.get(uid, {"x": [], "y": []})
            assert previous["x"] + appended["x"] == trace["x"], (fid, uid)
            assert previous["y"] + appended["y"] == trace["y"], (fid, uid)


def test_update_carries_the_template_of_a_trace_the_browser_lacks() -> None:
    newcomer = sample(5, point("acme-new", in_flight=2))
    update = figures.figure_update(newcomer, None)
    trace = next(t for t in update["inflight"] if t["meta"] == "inflight:acme-new")
    assert trace["stackgroup"] == "inflight" and trace["name"] == "acme-new" and trace["y"] == [2]
    assert all(t["x"] for t in update["aimd"])  # traces without a point this second are left out
    assert "aimd:increase" not in {t["meta"] for t in update["aimd"]}


def test_colours_follow_the_name_not_the_position() -> None:
    # Names before and after acme-a whose checksums pick other palette slots than acme-a's.
    alone = traces(figures.figure_inflight_stacked([sample(0, point("acme-a"))], visible_entitlements=None))
    crowd = traces(figures.figure_inflight_stacked(
        [sample(0, point("aab"), point("acme-a"), point("zzz"))], visible_entitlements=None))
    assert alone["inflight:acme-a"]["line"]["color"] == crowd["inflight:acme-a"]["line"]["color"]


def test_an_entitlement_has_one_colour_on_every_page() -> None:
    """Issue 28: the pool page, the entitlement page (the name alone) and the usage page draw it alike."""
    crowd = [sample(0, point("globex-spot"), point("acme-preemptible"))]
    alone = [sample(0, point("acme-preemptible"))]
    expected = colors.entitlement_color("acme-preemptible")
    for build in (figures.figure_inflight_stacked, figures.figure_tokens_vs_baseline, figures.figure_ttft_vs_slo):
        for samples, visible in ((crowd, None), (alone, None), (crowd, ["acme-preemptible"])):
            fig = traces(build(samples, visible_entitlements=visible))
            drawn = {t["line"]["color"] for meta, t in fig.items() if meta.endswith(":acme-preemptible")}
            assert drawn == {expected}, build.__name__
    usage = daily_figure([{"tenant": "acme", "entitlement": "acme-preemptible", "period": "2026-01-01",
                           "spend": None, "prompt_tokens": 1, "completion_tokens": 2}])
    assert usage["data"][0]["marker"]["color"] == expected


def test_colour_assignment_is_stable() -> None:
    # Pinned values: a change of palette or checksum recolours every chart people have learnt to read.
    assert colors.entitlement_color("acme-guaranteed") == "#1CA71C"
    assert colors.entitlement_color("globex-spot") == "#B68100"
    # The demo pool's five entitlements are told apart.
    demo = ["acme-guaranteed", "acme-elastic", "acme-preemptible", "globex-elastic", "globex-spot"]
    assert len(set(colors.entitlement_colors(demo).values())) == len(demo)


def test_filtering_a_sample_for_a_tenant_user_drops_pool_totals(history: list[PoolSample]) -> None:
    tenant = Visibility(entitlements=frozenset({"acme-a"}), pool_totals=False)
    cut = sample_visible(history[0], tenant)
    assert [e.name for e in cut.entitlements] == ["acme-a"]
    assert cut.running is None and cut.queued is None and cut.kv_usage == {} and cut.kv_admitted is None
    assert cut.slots == 16 and cut.budget == 16  # capacity is public, like the pool page
    payload = figures.live_payload_history(samples_visible(history, tenant), tenant.entitlements,
                                           ids=figures.figure_ids(pool_totals=False))
    text = json.dumps(payload)
    assert "globex" not in text
    assert "kv" not in payload["figures"]
    queue = traces(payload["figures"]["queue"])
    assert queue["queue:running"]["y"] == [] and queue["queue:waiting"]["y"] == []


def test_empty_history_builds_empty_figures() -> None:
    payload = figures.live_payload_history([], None)
    assert payload["last"] is None
    assert set(payload["figures"]) == {fid for fid, _ in figures.FIGURES}
    assert traces(payload["figures"]["aimd"])["aimd:budget"]["y"] == []


def test_uids_keep_keys_apart_that_differ_only_in_unsafe_characters() -> None:
    assert figures.trace_uid("kv:http://r1") != figures.trace_uid("kv:http_//r1")
    assert figures.trace_uid("denied:a:pool_contended") == figures.trace_uid("denied:a:pool_contended")


def test_quota_rejections_are_their_own_denial_reason(history: list[PoolSample]) -> None:
    history = [*history, sample(3, point("acme-a", in_flight=2, denied={"quota_exceeded": 4, "pool_contended": 1}))]
    fig = traces(figures.figure_admissions_by_reason(history, visible_entitlements=None))
    assert fig["denied:acme-a:quota_exceeded"]["y"] == [-4]
    assert fig["denied:acme-a:quota_exceeded"]["name"] == "acme-a denied: quota_exceeded"
    assert fig["denied:acme-a:pool_contended"]["y"] == [-1]


def test_tokens_served_below_the_class_are_a_series_of_their_own() -> None:
    """Issue 24: spilled-over or demoted tokens get a dotted line per class, in the entitlement's colour, added
    live the first time they appear (the update carries the new trace's template)."""
    history = [sample(0, point("acme-a", tokens_per_s=100.0)),
               sample(1, point("acme-a", tokens_per_s=120.0, tier_tokens_per_s={"spot": 20.0}))]
    figure = figures.figure_tokens_vs_baseline(history, visible_entitlements=None)
    go.Figure(figure)
    spot = traces(figure)["tokens:acme-a@spot"]
    assert spot["name"] == "acme-a as spot" and spot["line"]["dash"] == "dot"
    assert spot["line"]["color"] == traces(figure)["tokens:acme-a"]["line"]["color"]
    assert spot["y"] == [20.0] and spot["x"] == [figures.ms(history[1])]
    update = figures.figure_update(history[1], None, ids=["tokens"])
    assert "tokens:acme-a@spot" in {t["meta"] for t in update["tokens"]}
    assert "tokens:acme-a@spot" not in traces(figures.figure_tokens_vs_baseline(history[:1], visible_entitlements=None))
    assert EntitlementPoint.from_dict(history[1].entitlements[0].to_dict()) == history[1].entitlements[0]
