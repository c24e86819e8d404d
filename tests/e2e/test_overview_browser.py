"""The operator's overview and the pool's live page in headless Chromium (issue 28), on the real site
(`manage.py serve`) in front of the virtual vLLM, traffic through `/v1/chat/completions`:

- the overview renders its figures and tables and updates over /ws/overview/ once the gateway has served
  requests (the SLO row of acme-chat appears, the pool's tokens/s moves);
- no legend covers an axis, on the overview and on the live page;
- the live page's four first-read charts are above the fold of a 1280x900 window.

The overview's screenshot lands in test-output/ (the README's picture: see `OVERVIEW_SHOT`)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from tests.e2e.conftest import screenshot_path
from tests.e2e.test_dashboard_live import PASSWORD, LiveSite, Traffic, live_site  # noqa: F401 - the fixture

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# Set to a path to keep a copy of the overview's screenshot there (the README's picture).
OVERVIEW_SHOT = os.environ.get("TOKENPOOLS_OVERVIEW_SHOT", "")

# For every Plotly chart in `selector`: whether its legend's box overlaps the plot area or the x axis' tick
# labels and title (the legend must sit wholly below them).
LEGEND_OVERLAPS = """(selector) => Array.from(document.querySelectorAll(selector)).flatMap((el) => {
  const legend = el.querySelector('g.legend');
  const plot = el.querySelector('rect.nsewdrag') || el.querySelector('g.plot');
  if (!legend || !plot || !legend.getBoundingClientRect().height) return [];
  const lg = legend.getBoundingClientRect();
  const ticks = Array.from(el.querySelectorAll('g.xtick text, g.g-xtitle text')).map((t) => t.getBoundingClientRect());
  const lowest = Math.max(plot.getBoundingClientRect().bottom, ...ticks.map((t) => t.bottom));
  return lg.top < lowest - 1 ? [el.id + ': legend top ' + lg.top + ' above ' + lowest] : [];
})"""


def _log_in(page: Any, site: LiveSite, path: str) -> None:
    page.goto(f"{site.url}{path}")
    page.get_by_label("Username", exact=True).fill("root")
    page.get_by_label("Password", exact=True).fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()


def _updates(page: Any, root: str) -> int:
    return int(page.get_attribute(f"#{root}", "data-updates") or 0)


def test_overview_renders_and_updates_as_the_gateway_serves(
    live_site: LiveSite, browser_page: Any, request: pytest.FixtureRequest  # noqa: F811 - the fixture
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    console: list[str] = []
    page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    page.on("pageerror", lambda error: console.append(f"pageerror: {error}"))
    traffic = Traffic(live_site.url, live_site.keys)
    try:
        _log_in(page, live_site, "/")
        expect(page.get_by_role("heading", name="Overview")).to_be_visible()
        expect(page.locator("#overview-status")).to_have_text("live", timeout=20_000)
        # Before any traffic: the pool is listed, nothing served yet.
        expect(page.locator('#ov-pools tr[data-pool="live-pool"]')).to_be_visible()
        expect(page.locator("#ov-slo")).to_contain_text("No request was served")
        page.wait_for_function("Number(document.getElementById('overview').dataset.updates) >= 1", timeout=20_000)
        first = _updates(page, "overview")

        traffic.start(per_key=6)  # acme-chat allows 3 at a time: some are refused or wait
        # The request log reaches the database within GATEWAY_USAGE_FLUSH_S and the next message shows it.
        expect(page.locator('#ov-slo tr[data-entitlement="acme-chat"]')).to_be_visible(timeout=30_000)
        page.wait_for_function(
            "() => !document.querySelector('#ov-pools [data-cell=tokens]').textContent.trim().startsWith('0 ')",
            timeout=30_000)
        assert _updates(page, "overview") > first
        assert page.locator("#ov-fig-load .main-svg").count() >= 1  # plotly drew the pool figure
        assert page.locator("#ov-fig-slo .main-svg").count() >= 1
        page.wait_for_timeout(4_000)  # a few more seconds of traffic for a fuller picture
        assert page.evaluate(LEGEND_OVERLAPS, "#overview .js-plotly-plot") == []
        shot = screenshot_path(request, "-overview")
        page.screenshot(path=str(shot), full_page=True)
        if OVERVIEW_SHOT:
            shutil.copyfile(shot, OVERVIEW_SHOT)

        # The pool's live page: the four first-read charts above the fold, no legend over an axis.
        page.goto(f"{live_site.url}/pools/live-pool/live/")
        expect(page.locator("#live-status")).to_have_text("live", timeout=20_000)
        page.wait_for_function("Number(document.getElementById('live').dataset.updates) >= 3", timeout=30_000)
        height = page.viewport_size["height"]
        for fid in ("admissions", "queue", "ttft", "tokens"):
            box = page.locator(f"#fig-{fid}").bounding_box()
            assert box is not None and box["y"] + box["height"] <= height, (fid, box, height)
        assert page.locator("#fig-kv").bounding_box()["y"] >= height  # the rest is below the fold
        assert page.evaluate(LEGEND_OVERLAPS, "#live .js-plotly-plot") == []
    finally:
        traffic.stop()
        print("browser console:", *console, sep="\n  ")
    assert traffic.statuses[200] > 0, dict(traffic.statuses)
