"""URL map: admin UI pages, the REST API under /api/v1/, the schema, and Django's admin."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from django.views.defaults import page_not_found, server_error
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.tenancy.signin import LockoutAdminAuthenticationForm, LockoutAuthenticationForm

# Both login pages count failed passwords and lock out (apps/tenancy/lockout.py).
admin.site.login_form = LockoutAdminAuthenticationForm

urlpatterns = [
    path("accounts/login/", auth_views.LoginView.as_view(authentication_form=LockoutAuthenticationForm),
         name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("django-admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/schema/ui/", SpectacularSwaggerView.as_view(url_name="schema"), name="schema-ui"),
    path("api/v1/", include("tokenpools_site.api_urls")),
    path("", include("apps.dashboard.urls")),
]


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """404 for a URL no route matches: the REST API's JSON shape under /api/ (an id that is not a number, a
    mistyped path), the HTML page elsewhere. (Under /api/, ApiTrailingSlashMiddleware answers such a path
    first, with the same JSON, so that DEBUG on changes nothing there.)"""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found."}, status=404)
    return page_not_found(request, exception)


handler404 = not_found


def server_failed(request: HttpRequest) -> HttpResponse:
    """500 (with DEBUG off; with DEBUG on Django shows its debug page): JSON under /api/, else Django's page.
    Neither shows anything of the request or the settings."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Server error."}, status=500)
    return server_error(request)


handler500 = server_failed
