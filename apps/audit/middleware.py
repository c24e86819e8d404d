"""Each HTTP request's changes are attributed to its user, through ``admin`` (Django's admin), ``api`` (the REST
API under /api/) or ``ui`` (the pages)."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponseBase
from django.urls import NoReverseMatch, reverse

from apps.audit.context import acting


class AuditMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    @staticmethod
    def admin_prefix() -> str | None:
        """Where Django's admin is mounted in the URLs in use (None: a URL configuration without it, as some
        tests route only what they test)."""
        try:
            return reverse("admin:index")
        except NoReverseMatch:
            return None

    def channel(self, request: HttpRequest) -> str:
        admin = self.admin_prefix()
        if admin is not None and request.path_info.startswith(admin):
            return "admin"
        return "api" if request.path_info.startswith("/api/") else "ui"

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        # The request, not its user: a token is authenticated by DRF inside the view (which then sets
        # request.user on this same Django request), so the actor is read when an entry is written.
        with acting(channel=self.channel(request), request=request):
            return self.get_response(request)
