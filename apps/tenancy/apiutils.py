"""Glue between the services' Django exceptions and DRF responses (shared by the tenancy and pools APIs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

T = TypeVar("T")


def call_service(fn: Callable[..., T], *, field_names: Mapping[str, str] | None = None, **kwargs: Any) -> T:
    """Run a service; turn its ``ValidationError`` into a DRF 400 with field errors.

    ``PermissionDenied`` and ``Http404`` pass through: DRF answers them with 403 and 404 itself.
    ``field_names`` renames service-side field names to the API's where they differ.
    """
    try:
        return fn(**kwargs)
    except DjangoValidationError as exc:
        if hasattr(exc, "error_dict"):
            renames = field_names or {}
            detail: Any = {renames.get(k, k): v for k, v in exc.message_dict.items()}
            detail = {("non_field_errors" if k == "__all__" else k): v for k, v in detail.items()}
        else:
            detail = {"non_field_errors": exc.messages}
        raise serializers.ValidationError(detail) from exc
