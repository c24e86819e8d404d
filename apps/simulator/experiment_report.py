"""An experiment's report: a JSON of every figure, a Markdown table (live beside simulated beside the seed's
figure) and an HTML page of Plotly figures (requests in flight per entitlement over time, p99 TTFT per 5 s
window against each SLO, live and simulated overlaid)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from apps.simulator.experiment import WINDOW_S

# Seed 000's reported figures (sections 5.2 and 5.3), for the tables: what the paper measured on its vLLM
# cluster.
SEED_EXP1 = {"guaranteed p99 TTFT, token pools": "< 1.2 s", "guaranteed p99 TTFT, no admission": "19+ s",
             "spot throttle rate during overload": "47%"}
SEED_EXP2 = {"low-priority denials copilot / synth / reports": "0 / 317 / 22",
             "peak debt copilot / synth / reports": "0.607 / 0.775 / 0.414",
             "debt after recovery": "decays to near zero"}


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "–"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    arms = report["arms"]
    phases = [name for name, _start, _end in report["phases"]]
    lines = [
        f"Scenario `{report['scenario']}`; time scale {report['time_scale']:g}, capacity scale "
        f"{report['capacity_scale']:g}; backend {report['backend']}"
        + (f" ({report['decode_ms_measured']:.1f} ms per output token measured: whole requests, full batches)"
           if report.get("decode_ms_measured") else "") + "; phases " + ", ".join(
            f"{name} {start:g}-{end:g} s" for name, start, end in report["phases"]) + ".",
        "",
        "| entitlement | phase | arm | admitted | 429s (by reason) | throttle | p50 TTFT s | p99 TTFT s | "
        "p50 e2e s | p99 e2e s |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    tenants = sorted(next(iter(arms.values()))["figures"])
    for tenant in tenants:
        for phase in [*phases, "all"]:
            for arm, result in arms.items():
                f = result["figures"][tenant][phase]
                if not f["offered"]:
                    continue
                lines.append(f"| {tenant} | {phase} | {arm} | {f['admitted']} | {f['rejected']} "
                             f"({_cell(f['denials'])}) | {_cell(f['throttle_rate'])} | {_cell(f['ttft_p50_s'])} | "
                             f"{_cell(f['ttft_p99_s'])} | {_cell(f['e2e_p50_s'])} | {_cell(f['e2e_p99_s'])} |")
    if report.get("shape"):
        lines += ["", "| arm | the seed's claim | value | holds |", "|---|---|---:|---|"]
        for check in report["shape"]:
            lines.append(f"| {check['arm']} | {check['check']} | {_cell(check['value'])} | "
                         f"{'yes' if check['holds'] else 'NO'} |")
    seed = SEED_EXP2 if report.get("outage_s") else SEED_EXP1
    lines += ["", "Seed 000 (its vLLM cluster): " + "; ".join(f"{k}: {v}" for k, v in seed.items()) + "."]
    return "\n".join(lines) + "\n"


ARM_COLORS = {"token-pools": "#1f77b4", "redis": "#2ca02c", "no-admission": "#d62728"}


def _trace(arm: str, x: list[float], y: list[Any], mode: str = "lines") -> dict[str, Any]:
    side, _, name = arm.partition(" ")
    return {"type": "scatter", "mode": mode, "name": arm, "x": x, "y": y,
            "line": {"dash": "dot" if side == "sim" else "solid", "color": ARM_COLORS.get(name, "#7f7f7f")}}


def figures_json(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per entitlement: requests in flight over time and p99 TTFT per window against its SLO, every arm
    overlaid (simulated dotted, live solid; one colour per arm)."""
    arms = report["arms"]
    horizon = report["horizon_s"]
    out: list[dict[str, Any]] = []
    tenants = sorted(next(iter(arms.values()))["in_flight"])
    for tenant in tenants:
        flight = [_trace(arm, list(range(len(r["in_flight"][tenant]))), r["in_flight"][tenant])
                  for arm, r in arms.items()]
        out.append({"id": f"in-flight-{tenant}", "data": flight, "layout": {
            "title": {"text": f"{tenant}: requests in flight (simulated dotted, live solid)"},
            "xaxis": {"title": {"text": "s"}}, "yaxis": {"title": {"text": "requests"}}, "height": 360}})
        windows = [_trace(arm, [WINDOW_S * (i + 0.5) for i in range(len(r["ttft_windows"][tenant]))],
                          r["ttft_windows"][tenant], "lines+markers") for arm, r in arms.items()]
        slo = report["slo_ms"][tenant] / 1000.0
        windows.append({"type": "scatter", "mode": "lines", "name": "SLO", "x": [0, horizon], "y": [slo, slo],
                        "line": {"color": "grey", "dash": "dash", "width": 1}})
        out.append({"id": f"ttft-{tenant}", "data": windows, "layout": {
            "title": {"text": f"{tenant}: p99 TTFT per {WINDOW_S:g} s window, against its SLO"},
            "xaxis": {"title": {"text": "s"}}, "yaxis": {"title": {"text": "s"}, "type": "log"}, "height": 360}})
    debt = [{**_trace(arm, [t for t, _v in points], [v for _t, v in points]), "name": f"{tenant} ({arm})"}
            for arm, r in arms.items() for tenant, points in sorted((r.get("debt") or {}).items())]
    if debt:
        out.append({"id": "debt", "data": debt, "layout": {
            "title": {"text": "Service debt per entitlement (simulated dotted, live solid)"},
            "xaxis": {"title": {"text": "s"}}, "yaxis": {"title": {"text": "debt"}}, "height": 400}})
    return out


def html(report: dict[str, Any], plotly_js: str) -> str:
    figures = figures_json(report)
    divs = "\n".join(f'<div id="{f["id"]}"></div>' for f in figures)
    table = markdown(report).replace("&", "&amp;").replace("<", "&lt;")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{report['scenario']}</title>
<script>{plotly_js}</script></head>
<body style="font-family: sans-serif; max-width: 1200px; margin: auto">
<h1>{report['scenario']}: live and simulated</h1>
{divs}
<pre style="white-space: pre-wrap">{table}</pre>
<script>
const figures = {json.dumps(figures)};
for (const f of figures) Plotly.newPlot(f.id, f.data, f.layout, {{displaylogo: false}});
</script>
</body></html>
"""


def write_report(report: dict[str, Any], out: Path) -> dict[str, Path]:
    from plotly.offline import get_plotlyjs

    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md", "html": out / "report.html"}
    paths["json"].write_text(json.dumps(report, indent=1, default=str))
    paths["markdown"].write_text(markdown(report))
    paths["html"].write_text(html(report, get_plotlyjs()))
    return paths


def screenshot(html_path: Path, png_path: Path, chromium: str) -> Path:
    """A PNG of the report's figures (the page as the browser draws it), for the README."""
    from playwright.sync_api import sync_playwright

    from apps.simulator.management.commands.demo_screenshot import CHROMIUM_ARGS

    png_path.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(html_path.resolve().as_uri())
            page.wait_for_selector(".main-svg", timeout=30_000)
            page.locator("div[id^=ttft-]").first.screenshot(path=str(png_path))
        finally:
            browser.close()
    return png_path
