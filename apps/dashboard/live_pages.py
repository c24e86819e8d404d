"""The live dashboards of a pool and of an entitlement (charts pushed over a websocket), and the plotly.js
they draw with, served from the installed package."""

from __future__ import annotations

import functools
from pathlib import Path

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET

from apps.dashboard import selectors as page_selectors
from apps.dashboard.figures import PRIMARY_FIGURES
from apps.dashboard.page_flow import AuthenticatedRequest


def _live_page(request: AuthenticatedRequest, access: page_selectors.LiveAccess, ws_path: str,
               back_url: str) -> HttpResponse:
    # The four charts an operator reads first go above the fold, the rest under them (issue 28).
    primary = [fid for fid in access.figure_ids if fid in PRIMARY_FIGURES]
    return render(
        request,
        "dashboard/live.html",
        {"access": access, "ws_path": ws_path, "figure_ids": access.figure_ids, "back_url": back_url,
         "primary_ids": primary, "more_ids": [fid for fid in access.figure_ids if fid not in primary],
         "pool_totals": access.visibility.pool_totals},
    )


@login_required
@require_GET
def pool_live(request: AuthenticatedRequest, name: str) -> HttpResponse:
    access = page_selectors.live_pool_access(user=request.user, name=name)
    return _live_page(request, access, f"/ws/pools/{access.pool}/", reverse("ui:pool-detail", args=[access.pool]))


@login_required
@require_GET
def entitlement_live(request: AuthenticatedRequest, name: str) -> HttpResponse:
    access = page_selectors.live_entitlement_access(user=request.user, name=name)
    return _live_page(request, access, f"/ws/entitlements/{name}/", reverse("ui:entitlement-detail", args=[name]))


@functools.cache
def _plotly_js() -> tuple[bytes, str]:
    """plotly.js as shipped inside the installed plotly package (no CDN), read once per process."""
    import plotly

    body = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    return body, f'"plotly-{plotly.__version__}-{len(body)}"'


@require_GET
def plotly_js(request: HttpRequest) -> HttpResponse:
    """No login (a script, like the CSS); cacheable for a day and revalidated by ETag (the package version)."""
    body, etag = _plotly_js()
    if etag in request.headers.get("If-None-Match", ""):
        response = HttpResponse(status=304)
    else:
        response = HttpResponse(body, content_type="text/javascript; charset=utf-8")
    response["ETag"] = etag
    response["Cache-Control"] = "public, max-age=86400"
    return response
