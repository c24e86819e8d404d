"""The three ways to sign in by password, each behind the failed-attempt lockout (apps/tenancy/lockout.py).

- the site's login page (`/accounts/login/`) and Django admin's (`/django-admin/login/`): the forms below; a
  locked user or address gets a form error;
- `POST /api/v1/auth/token`: `LockoutObtainAuthToken`; a locked one gets 429 with `Retry-After`.
"""

from __future__ import annotations

from typing import Any

from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError
from django.http import HttpRequest
from rest_framework import exceptions, status
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.request import Request
from rest_framework.response import Response

from apps.tenancy import lockout


def client_address(request: HttpRequest | Request | None) -> str:
    # REMOTE_ADDR as the ASGI server gives it (uvicorn trusts X-Forwarded-For only from its allowed proxies).
    return str(getattr(request, "META", {}).get("REMOTE_ADDR") or "unknown")


class LockoutFormMixin:
    """`AuthenticationForm.clean` behind the lockout: refused while locked, each bad password counted."""

    request: HttpRequest | None
    cleaned_data: dict[str, Any]
    locked_message = ""  # the page shows it instead of its "did not match"

    def _locked(self, seconds: int) -> ValidationError:
        self.locked_message = lockout.locked_message(seconds)
        return ValidationError(self.locked_message, code="locked")

    def clean(self) -> dict[str, Any]:
        username = self.cleaned_data.get("username")
        if username is None or not self.cleaned_data.get("password"):
            return super().clean()  # type: ignore[misc,no-any-return]
        address = client_address(self.request)
        seconds = lockout.seconds_locked(username=username, address=address)
        if seconds is not None:
            raise self._locked(seconds)
        try:
            cleaned: dict[str, Any] = super().clean()  # type: ignore[misc]
        except ValidationError as exc:
            if getattr(exc, "code", None) == "invalid_login":
                locked = lockout.record_failure(username=username, address=address)
                if locked is not None:
                    raise self._locked(locked) from exc
            raise
        lockout.record_success(username=username)
        return cleaned


class LockoutAuthenticationForm(LockoutFormMixin, AuthenticationForm):
    pass


class LockoutAdminAuthenticationForm(LockoutFormMixin, AdminAuthenticationForm):
    pass


class LockoutObtainAuthToken(ObtainAuthToken):
    """DRF's token view behind the lockout: 429 with Retry-After while locked."""

    signin_lockout = True  # apps.tenancy.apischema documents the 429

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        raw = request.data.get("username") if hasattr(request.data, "get") else None
        username = raw if isinstance(raw, str) else None
        address = client_address(request)
        if username:
            seconds = lockout.seconds_locked(username=username, address=address)
            if seconds is not None:
                return _too_many(seconds)
        try:
            response: Response = super().post(request, *args, **kwargs)
        except exceptions.ValidationError as exc:
            detail = exc.detail if isinstance(exc.detail, dict) else {}
            if username and "non_field_errors" in detail:  # the credentials, not a missing field
                locked = lockout.record_failure(username=username, address=address)
                if locked is not None:
                    return _too_many(locked)
            raise
        if username:
            lockout.record_success(username=username)
        return response


def _too_many(seconds: int) -> Response:
    return Response({"detail": lockout.locked_message(seconds)}, status=status.HTTP_429_TOO_MANY_REQUESTS,
                    headers={"Retry-After": str(seconds)})
