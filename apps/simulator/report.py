"""Plotly figures of a finished simulation (pure functions of its records) and writers for HTML and PNG.

HTML files load Plotly's JS from a `plotly.min.js` copied next to them from the installed package (never a
CDN). PNG goes through kaleido 0.2.1's bundled Chromium when that package is installed; otherwise HTML only.
"""

from __future__ import annotations

import os
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from apps.simulator.simulation import Simulation

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _colors(names: list[str]) -> dict[str, str]:
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(sorted(names))}


def timeline_figure(simulation: Simulation, title: str = "") -> go.Figure:
    """Queue and slots, running per tenant, TTFT per finished request, rejections per second."""
    samples = simulation.samples
    times = [s.time for s in samples]
    tenants = sorted(
        {name for s in samples for name in s.tenant_running} | {t.name for t in simulation.config.tenants}
    )
    colors = _colors(tenants)
    figure = make_subplots(
        rows=4,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.05,
        subplot_titles=(
            "running and waiting requests (instance + gateway queue)",
            "running requests by tenant",
            "TTFT of finished requests (s)",
            "rejections per second by tenant",
        ),
    )
    figure.add_trace(go.Scatter(x=times, y=[sum(s.running) for s in samples], name="running", line={"color": "#333"}),
                     row=1, col=1)  # fmt: skip
    figure.add_trace(
        go.Scatter(
            x=times,
            y=[sum(s.waiting) + s.gateway_queue for s in samples],
            name="waiting",
            line={"color": "#d62728"},
        ),  # fmt: skip
        row=1,
        col=1,
    )
    figure.add_trace(
        go.Scatter(
            x=times, y=[s.slots for s in samples], name="slots", line={"color": "#999", "dash": "dash"}
        ),
        row=1,
        col=1,
    )
    for name in tenants:
        figure.add_trace(
            go.Scatter(
                x=times,
                y=[s.tenant_running.get(name, 0) for s in samples],
                name=name,
                stackgroup="running",
                line={"color": colors[name]},
                legendgroup=name,
            ),  # fmt: skip
            row=2,
            col=1,
        )
    by_tenant: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for finished_at, tenant, ttft, _ in simulation.finished:
        by_tenant[tenant].append((finished_at, ttft))
    for name in tenants:
        points = by_tenant.get(name, [])
        figure.add_trace(
            go.Scattergl(
                x=[p[0] for p in points],
                y=[p[1] for p in points],
                mode="markers",
                name=f"{name} TTFT",
                marker={"color": colors[name], "size": 4},
                legendgroup=name,
                showlegend=False,
            ),  # fmt: skip
            row=3,
            col=1,
        )
    interval = simulation.config.sample_interval_s or 1.0
    horizon = times[-1] if times else 0.0
    bins = int(horizon / interval) + 1
    rejected: dict[str, list[float]] = {name: [0.0] * bins for name in tenants}
    for when, tenant, _ in simulation.rejections:
        index = min(int(when / interval), bins - 1)
        rejected.setdefault(tenant, [0.0] * bins)[index] += 1 / interval
    for name in tenants:
        figure.add_trace(
            go.Scatter(
                x=[i * interval for i in range(bins)],
                y=rejected[name],
                name=f"{name} rejected",
                line={"color": colors[name], "shape": "hv"},
                legendgroup=name,
                showlegend=False,
            ),  # fmt: skip
            row=4,
            col=1,
        )
    figure.update_xaxes(title_text="virtual time (s)", row=4, col=1)
    figure.update_layout(title=title, height=1000, template="plotly_white")
    return figure


def dynamics_figure(debt_samples: list[Any], title: str = "") -> go.Figure:
    """Token pools: service debt (2) and priority weight (1) per entitlement over time."""
    tenants = sorted({name for s in debt_samples for name in s.debt})
    colors = _colors(tenants)
    figure = make_subplots(
        rows=2, cols=1, shared_xaxes=True, subplot_titles=("service debt d_e", "priority w_e")
    )
    for name in tenants:
        points = [s for s in debt_samples if name in s.debt]
        figure.add_trace(go.Scatter(x=[s.time for s in points], y=[s.debt[name] for s in points], name=name,
                                    line={"color": colors[name]}, legendgroup=name), row=1, col=1)  # fmt: skip
        figure.add_trace(go.Scatter(x=[s.time for s in points], y=[s.priority[name] for s in points], name=name,
                                    line={"color": colors[name]}, legendgroup=name, showlegend=False),
                         row=2, col=1)  # fmt: skip
    figure.update_xaxes(title_text="virtual time (s)", row=2, col=1)
    figure.update_layout(title=title, height=600, template="plotly_white")
    return figure


def aimd_figure(samples: list[Any], target_s: float, title: str = "") -> go.Figure:
    figure = make_subplots(
        rows=2, cols=1, shared_xaxes=True, subplot_titles=("budget cap", "gateway p99 TTFT (s)")
    )
    figure.add_trace(go.Scatter(x=[s.time for s in samples], y=[s.cap for s in samples], name="cap",
                                line={"shape": "hv"}), row=1, col=1)  # fmt: skip
    figure.add_trace(go.Scatter(x=[s.time for s in samples], y=[s.p99_s for s in samples], name="p99 TTFT"),
                     row=2, col=1)  # fmt: skip
    figure.add_hline(y=target_s, line={"dash": "dash", "color": "#999"}, row=2, col=1)
    figure.update_layout(title=title, height=600, template="plotly_white")
    return figure


def png_available() -> bool:
    try:
        from kaleido.scopes.plotly import PlotlyScope  # noqa: F401
    except ImportError:
        return False
    return True


_SCOPE: Any = None


def write_png(figure: go.Figure, path: Path, width: int = 1100, height: int | None = None) -> bool:
    """Render through kaleido 0.2.1 with the installed plotly.js; False when that is not possible."""
    global _SCOPE
    try:
        import plotly
        from kaleido.scopes.plotly import PlotlyScope
    except ImportError:
        return False
    try:
        if _SCOPE is None:
            # kaleido 0.2.1 calls the deprecated Thread.setDaemon; its warning is noise for our callers.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"kaleido\..*")
            _SCOPE = PlotlyScope(
                plotlyjs=os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
            )
        layout_height = figure.layout.height or 600
        path.write_bytes(
            _SCOPE.transform(figure.to_dict(), format="png", width=width, height=height or layout_height)
        )
    except Exception:  # noqa: BLE001 - a missing Chromium dependency must not fail the run; HTML still exists
        return False
    return True


def write_figure(figure: go.Figure, directory: str | Path, stem: str, png: bool = True) -> list[str]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    html = directory / f"{stem}.html"
    figure.write_html(html, include_plotlyjs="directory", full_html=True)
    written = [str(html)]
    if png and write_png(figure, directory / f"{stem}.png"):
        written.append(str(directory / f"{stem}.png"))
    return written


def write_plots(
    simulation: Simulation, directory: str | Path, title: str = "", png: bool = True
) -> list[str]:
    written = write_figure(timeline_figure(simulation, title), directory, "timeline", png)
    admission = simulation.cluster.admission
    debt_samples = getattr(admission, "debt_samples", None)
    if debt_samples:
        written += write_figure(
            dynamics_figure(debt_samples, f"{title}: debt and priority"), directory, "dynamics", png
        )
    aimd = getattr(admission, "aimd", None)
    trace = getattr(admission, "trace", None)
    if aimd is not None and trace is not None and trace.samples:
        written += write_figure(
            aimd_figure(trace.samples, aimd.target_p99_s, f"{title}: AIMD"), directory, "aimd", png
        )
    return written
