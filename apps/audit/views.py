"""The audit page: the log with the REST list's filters, 50 entries a page (login required; what each user
sees is what ``GET /api/v1/audit/`` answers them)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from apps.audit.selectors import AuditEntryFilter, audit_entry_list

PAGE_SIZE = 50


@login_required
@require_GET
def audit_page(request: HttpRequest) -> HttpResponse:
    filters = AuditEntryFilter(request.GET, queryset=audit_entry_list(user=request.user))
    entries = filters.qs if filters.is_valid() else audit_entry_list(user=request.user).none()
    page = Paginator(entries, PAGE_SIZE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(request, "audit/list.html", {
        "section": "audit", "filters": filters, "page": page, "query": query.urlencode(),
    })
