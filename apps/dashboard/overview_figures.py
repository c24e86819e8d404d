"""The overview's Plotly figures and its websocket payload: pure functions of an `Overview`.

Pictures where they read better than numbers: refusals per minute by reason (stacked bars), each pool's
use of its three capacities (bars against 100 %), p99 TTFT against target per entitlement. The numbers
(the tenants refused, quota burn, fairness, healthy replicas) are tables, rendered by the same template
on the page and in every message, so a reload and a live update show the same thing.
"""

from __future__ import annotations

import datetime as dt
import zlib
from typing import Any

from django.template.loader import render_to_string

from apps.dashboard.colors import entitlement_color
from apps.dashboard.figures import Figure, legend_below
from apps.dashboard.overview_selectors import Overview

# Refusal reasons get colours of their own (not the entitlements'): warm tones, stable by name.
REASON_PALETTE = ("#d62728", "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22", "#9467bd", "#7f7f7f", "#17becf")
DIMENSION_COLORS = {"slots": "#1f77b4", "tokens/s": "#2ca02c", "KV bytes": "#9467bd"}
FIGURE_HEIGHT_PX = 300


def reason_color(reason: str) -> str:
    return REASON_PALETTE[zlib.crc32(reason.encode()) % len(REASON_PALETTE)]


def _layout(title: str, **extra: Any) -> dict[str, Any]:
    layout: dict[str, Any] = {"title": {"text": title}, "height": FIGURE_HEIGHT_PX, "legend": legend_below(),
                              "margin": {"l": 60, "r": 20, "t": 40, "b": 40}}
    layout.update(extra)
    # The tick labels get room of their own above the legend's reserved margin.
    layout["xaxis"] = {**layout.get("xaxis", {}), "automargin": True}
    return layout


def _ms(moment: dt.datetime) -> float:
    return round(moment.timestamp() * 1000.0, 3)


def figure_refusals(data: Overview) -> Figure:
    """Refusals per minute by reason over the last 15 minutes, stacked."""
    xs = [_ms(m) for m in data.refusals.minutes]
    traces = [{"type": "bar", "name": reason, "uid": f"refused-{reason}", "x": xs, "y": counts,
               "marker": {"color": reason_color(reason)}}
              for reason, counts in data.refusals.by_reason.items()]
    return {"data": traces, "layout": _layout(
        "Refusals per minute by reason (UTC)", barmode="stack", xaxis={"type": "date"},
        yaxis={"title": {"text": "refusals / minute"}, "rangemode": "tozero"})}


def figure_pool_load(data: Overview) -> Figure:
    """Each pool's slots, tokens/s and KV bytes in use, in % of its capacity (what the viewer may see)."""
    pools = [load.pool for load in data.pools]
    traces = []
    for label, read in (("slots", "slots_percent"), ("tokens/s", "tokens_percent"), ("KV bytes", "kv_percent")):
        traces.append({"type": "bar", "orientation": "h", "name": label, "uid": f"load-{label}",
                       "y": pools, "x": [getattr(load, read) or 0.0 for load in data.pools],
                       "marker": {"color": DIMENSION_COLORS[label]}})
    return {"data": traces, "layout": _layout(
        "Pool utilisation (% of capacity)", barmode="group",
        xaxis={"range": [0, 100], "ticksuffix": " %"},
        yaxis={"automargin": True, "autorange": "reversed"},
        height=max(FIGURE_HEIGHT_PX, 140 + 60 * len(pools)))}


def figure_slo(data: Overview) -> Figure:
    """p99 TTFT of the last 15 minutes per entitlement (its colour) against its target (a black mark)."""
    rows = [row for row in data.slo if row.p99_ms is not None]
    names = [row.entitlement for row in rows]
    return {"data": [
        {"type": "bar", "name": "p99 TTFT", "uid": "slo-p99", "x": names, "y": [row.p99_ms for row in rows],
         "marker": {"color": [entitlement_color(n) for n in names]}},
        {"type": "scatter", "mode": "markers", "name": "target", "uid": "slo-target", "x": names,
         "y": [row.target_ms for row in rows], "marker": {"color": "#000000", "symbol": "line-ew-open",
                                                          "size": 28, "line": {"width": 3}}},
    ], "layout": _layout("p99 TTFT against target, last 15 minutes",
                         yaxis={"title": {"text": "ms"}, "rangemode": "tozero"})}


OVERVIEW_FIGURES = (("refusals", figure_refusals), ("load", figure_pool_load), ("slo", figure_slo))


def overview_figures(data: Overview) -> dict[str, Figure]:
    return {fid: build(data) for fid, build in OVERVIEW_FIGURES}


def overview_tables_html(data: Overview) -> str:
    return render_to_string("dashboard/_overview_tables.html", {"overview": data})


def overview_payload(data: Overview, now: dt.datetime) -> dict[str, Any]:
    """One websocket message: every figure and the tables' HTML (autoescaped by the template)."""
    return {"type": "overview", "time": _ms(now), "figures": overview_figures(data),
            "tables": overview_tables_html(data)}
