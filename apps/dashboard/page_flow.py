"""What every page of the admin UI shares: the signed-in request, the superuser check, and the one flow of a
create or edit page (a form, one service call, a redirect with a message)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django import forms
from django.contrib import messages
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from apps.dashboard.forms import add_service_errors

T = TypeVar("T")
GET_OR_POST = ["GET", "POST"]


class AuthenticatedRequest(HttpRequest):
    """What every view here receives: ``login_required`` guarantees a signed-in user (the default User model)."""

    user: User


def require_superuser(request: AuthenticatedRequest) -> None:
    # Pools and tenants are platform resources; a page to change them is not even shown to tenant users.
    if not request.user.is_superuser:
        raise PermissionDenied("only platform operators (superusers) manage this")


def call_service(form: Any, call: Callable[[], T]) -> T | None:
    """Run the service; on ValidationError put its messages on the form and return None."""
    try:
        return call()
    except ValidationError as exc:
        add_service_errors(form, exc)
        return None


def service_form_page(
    request: AuthenticatedRequest,
    template: str,
    *,
    make_form: Callable[..., forms.Form],
    save: Callable[[dict[str, Any]], T],
    on_saved: Callable[[T], HttpResponse],
    initial: Callable[[], dict[str, Any]] | None = None,
    **context: Any,
) -> HttpResponse:
    """The one flow of every create and edit page: a GET shows ``make_form(initial=...)``; a POST binds
    ``make_form(request.POST)``, hands the cleaned data to ``save`` (one service call) and answers with
    ``on_saved(result)``. An invalid form, or a service's ValidationError, shows the page again with the
    errors. ``initial`` is a callable so that its queries run only for the GET that shows it."""
    if request.method == "POST":
        form = make_form(request.POST)
        if form.is_valid():
            saved = call_service(form, lambda: save(form.cleaned_data))
            if saved is not None:
                return on_saved(saved)
    else:
        form = make_form(initial=initial() if initial is not None else None)
    return render(request, template, {"form": form, **context})


def redirect_with_success(request: AuthenticatedRequest, message: str, to: str, **url_kwargs: Any) -> HttpResponse:
    messages.success(request, message)
    return redirect(to, **url_kwargs)
