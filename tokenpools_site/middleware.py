"""The REST API answers a path with or without its trailing slash alike, for every method.

Django's ``APPEND_SLASH`` redirects a slashless GET (a 301) and cannot redirect a POST, PUT, PATCH or DELETE
without losing its body: with DEBUG on it raises (a 500), with DEBUG off it redirects and the client's retry
is a GET. Under ``/api/`` this middleware instead routes the request to the form of its path that has a
route: ``/api/v1/tenants/acme`` is served as ``/api/v1/tenants/acme/``, and ``/api/v1/apply/`` as
``/api/v1/apply``. A path that matches in neither form is the REST API's JSON 404 here, so that it is JSON
with DEBUG on too (where Django shows its own page instead of ``urls.not_found``).
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.urls import get_urlconf, is_valid_path

API_PREFIX = "/api/"


class ApiTrailingSlashMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        path = request.path_info
        if path.startswith(API_PREFIX) and path != API_PREFIX:
            urlconf = getattr(request, "urlconf", None) or get_urlconf()
            if not is_valid_path(path, urlconf):
                other = path[:-1] if path.endswith("/") else path + "/"
                if not is_valid_path(other, urlconf):
                    return JsonResponse({"detail": "Not found."}, status=404)
                # path_info is what the resolver reads; path is what views and handlers see.
                request.path = request.path[: len(request.path) - len(path)] + other
                request.path_info = other
        return self.get_response(request)
