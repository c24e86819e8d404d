"""The usage page: tokens and spend per tenant, entitlement and month, and a chart of daily spend (or
tokens, where a pool has no prices) per entitlement. Every user sees their own tenants' usage only."""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from apps.dashboard.colors import entitlement_color
from apps.dashboard.figures import legend_below
from apps.gateway.selectors import usage_record_list, usage_spend_summary

DAYS = 31


def daily_figure(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A Plotly stacked bar figure: per entitlement and served tier (`tenant/entitlement (tier)`: spillover
    and demoted tokens are bars of their own), spend per day where priced, else tokens per day."""
    priced = any(row["spend"] for row in rows)
    by_entitlement: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    entitlement_of: dict[str, str] = {}
    for row in rows:
        value = float(row["spend"]["amount"]) if priced and row["spend"] else float(
            row["prompt_tokens"] + row["completion_tokens"])
        tier = row.get("service_tier") or ""
        name = f"{row['tenant']}/{row['entitlement']}" + (f" ({tier})" if tier else "")
        by_entitlement[name][row["period"]] += value
        entitlement_of[name] = row["entitlement"]
    currencies = sorted({row["spend"]["currency"] for row in rows if row["spend"]})
    unit = "/".join(currencies) if priced else "tokens"
    return {
        # The entitlement's colour on every page (its bars of each served tier stack in that colour).
        "data": [{"type": "bar", "name": name, "x": sorted(days), "y": [days[d] for d in sorted(days)],
                  "marker": {"color": entitlement_color(entitlement_of[name]), "line": {"color": "#ffffff", "width": 1}}}
                 for name, days in sorted(by_entitlement.items())],
        "layout": {"barmode": "stack", "title": {"text": f"Daily {'spend' if priced else 'tokens'} ({unit})"},
                   "xaxis": {"type": "date"}, "yaxis": {"title": {"text": unit}}, "height": 360,
                   "margin": {"t": 40, "l": 60, "r": 20, "b": 40}, "legend": legend_below()},
    }


@login_required
@require_GET
def usage_page(request: HttpRequest) -> HttpResponse:
    since = dt.datetime.now(dt.UTC) - dt.timedelta(days=DAYS)
    recent = usage_record_list(user=request.user).filter(minute__gte=since)
    months = usage_spend_summary(user=request.user, period="month")
    days = usage_spend_summary(user=request.user, period="day", filters=recent)
    return render(request, "dashboard/usage.html", {
        "section": "usage", "months": months, "days": DAYS,
        "figure_json": json.dumps(daily_figure(days)) if days else "",
    })
