"""The "What if" page of a pool (issue 26): paste or upload a proposed manifest, pick the window, and see the pool's
recorded traffic replayed under the current entitlements and the proposed ones (`apps.simulator.api.whatif_run`,
as ``POST /api/v1/pools/NAME/whatif/`` runs it, with the same rights): the table, and Plotly charts of admitted and
refused requests per entitlement side by side and of the TTFT distributions. Figures are pure functions."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from apps.pools.manifests import ManifestError
from apps.pools.manifests.limits import too_large
from apps.pools.selectors import pool_get
from apps.simulator.api import visible_tenants, whatif_run
from apps.simulator.replay_site import COLUMNS, ReplayInputError

COLORS = {"recorded": "#7f7f7f", "current": "#1f77b4", "proposed": "#ff7f0e"}


class WhatIfForm(forms.Form):
    since = forms.CharField(initial="1h", max_length=64, help_text="90s, 30m, 1h, 2d before now, or an ISO 8601 time")
    until = forms.CharField(required=False, max_length=64, help_text="as since; empty: now")
    manifest = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 12, "spellcheck": "false"}),
                               help_text="the proposed manifest (YAML, as apply takes it); empty: current only")
    file = forms.FileField(required=False, help_text="or upload it")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        upload = data.get("file")
        if upload is not None:
            problem = too_large(upload.size or 0)
            if problem:
                raise forms.ValidationError(problem)
            try:
                data["manifest"] = upload.read().decode("utf-8")
            except UnicodeDecodeError:
                raise forms.ValidationError({"file": "not UTF-8 text"}) from None
        text = data.get("manifest") or ""
        if "\x00" in text or any("\x00" in str(data.get(k) or "") for k in ("since", "until")):
            raise forms.ValidationError("text may not contain NUL characters (U+0000)")
        problem = too_large(len(text.encode())) if text else None
        if problem:
            raise forms.ValidationError({"manifest": problem})
        return data


def outcome_figure(report: dict[str, Any]) -> dict[str, Any]:
    """Grouped bars: per entitlement, admitted (solid) and refused (hatched) for recorded / current / proposed."""
    names = list(report["entitlements"])
    data = []
    for column in COLUMNS:
        rows = [report["entitlements"][n].get(column) for n in names]
        if not any(column in report["entitlements"][n] for n in names):
            continue
        for what, pattern in (("admitted", ""), ("rejected", "/")):
            data.append({"type": "bar", "name": f"{column}: {'refused' if what == 'rejected' else what}",
                         "x": names, "y": [None if row is None else row[what] for row in rows],
                         "offsetgroup": column, "marker": {"color": COLORS[column], "pattern": {"shape": pattern}},
                         "base": [None if row is None or what == "admitted" else row["admitted"] for row in rows]
                         if what == "rejected" else None})
    return {"data": data, "layout": {"title": {"text": "Admitted and refused per entitlement"}, "barmode": "group",
                                     "yaxis": {"title": {"text": "requests"}}, "height": 380,
                                     "margin": {"t": 40, "l": 60, "r": 20, "b": 60}}}


def ttft_figure(report: dict[str, Any]) -> dict[str, Any]:
    """Box plots of TTFT (seconds) per entitlement, one box per column."""
    data = []
    for column in COLUMNS:
        x: list[str] = []
        y: list[float] = []
        for name, columns in report.get("ttft_s", {}).items():
            values = columns.get(column, [])
            x += [name] * len(values)
            y += values
        if y:
            data.append({"type": "box", "name": column, "x": x, "y": y, "boxpoints": False,
                         "marker": {"color": COLORS[column]}})
    return {"data": data, "layout": {"title": {"text": "Time to first token"}, "boxmode": "group",
                                     "yaxis": {"title": {"text": "seconds"}}, "height": 380,
                                     "margin": {"t": 40, "l": 60, "r": 20, "b": 60}}}


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows: per entitlement, then per pool (its totals), each column that exists in the report."""
    rows = [(name, row.get("tenant", ""), row) for name, row in report["entitlements"].items()]
    rows += [(f"pool {name} (all tenants)", "", row) for name, row in report["pools"].items()]
    return [{"name": name, "tenant": tenant,
             "cells": [{"column": c, "figures": row[c],
                        "reasons": ", ".join(f"{k}={v}" for k, v in (row[c] or {}).get("rejected_by_reason", {}).items())}
                       for c in COLUMNS if c in row]}
            for name, tenant, row in rows]


@login_required
@require_http_methods(["GET", "POST"])
def pool_whatif(request: HttpRequest, name: str) -> HttpResponse:
    pool = pool_get(user=request.user, name=name)
    tenants = visible_tenants(request.user, pool)  # 403 for those who may not run it
    form = WhatIfForm(request.POST or None, request.FILES or None)
    context: dict[str, Any] = {"pool": pool, "form": form, "section": "pools", "errors": []}
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            report = whatif_run(user=request.user, pool=pool, tenants=tenants, since=data["since"],
                                until=data.get("until") or None, manifest=data.get("manifest") or None)
        except ReplayInputError as exc:
            form.add_error(None, str(exc))
        except ManifestError as exc:
            context["errors"] = [i.as_dict() for i in exc.issues]
        else:
            context.update(report=report, rows=table_rows(report),
                           outcome_json=json.dumps(outcome_figure(report)), ttft_json=json.dumps(ttft_figure(report)))
    status = 400 if request.method == "POST" and "report" not in context else 200
    return render(request, "dashboard/whatif.html", context, status=status)
