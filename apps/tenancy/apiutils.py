"""Glue between the services and DRF shared by every REST API: the services' Django exceptions as DRF
responses, the one pagination of every list (``REST_FRAMEWORK["DEFAULT_PAGINATION_CLASS"]``), filters that
keep what a database refuses out of queries, and the body parsers (``DEFAULT_PARSER_CLASSES``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import IO, Any, TypeVar

import django_filters
from django import forms
from django.core.exceptions import ValidationError as DjangoValidationError
from django_filters.fields import IsoDateTimeField
from rest_framework import parsers, serializers
from rest_framework.exceptions import ParseError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request

T = TypeVar("T")

# The lookup_value_regex of viewsets whose objects are named in the path (slugs, names): anything but a slash,
# and not NUL, which PostgreSQL refuses to compare (a 500); such a path matches no route, a 404.
NAME_IN_PATH = r"[^/\x00]+"


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


class ApiPagination(LimitOffsetPagination):
    """Every list of the REST API: ``?limit=`` (1 to ``max_limit``, default ``PAGE_SIZE``) and ``?offset=``.

    DRF's own class silently ignores a bad ``limit`` and passes any size of number to the database, where one
    past 64 bits is a 500. Here a value that is not a plain decimal integer in range, or is given twice, is a
    400 with a field error, and the schema states the bounds.
    """

    max_limit = 500
    # Past the number of rows a page is empty anyway; the bound only keeps the number the database sees small.
    max_offset = 2**31 - 1

    def get_limit(self, request: Request) -> int | None:
        value = _bounded_int(request, self.limit_query_param, minimum=1, maximum=self.max_limit)
        return self.default_limit if value is None else value

    def get_offset(self, request: Request) -> int:
        value = _bounded_int(request, self.offset_query_param, minimum=0, maximum=self.max_offset)
        return 0 if value is None else value

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        bounds = {self.limit_query_param: (1, self.max_limit), self.offset_query_param: (0, self.max_offset)}
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            low, high = bounds[parameter["name"]]
            parameter["schema"] = {**parameter["schema"], "minimum": low, "maximum": high}
            if parameter["name"] == self.limit_query_param:
                parameter["schema"]["default"] = self.default_limit
        return parameters


def _bounded_int(request: Request, name: str, *, minimum: int, maximum: int) -> int | None:
    """The query parameter ``name`` as an int in [minimum, maximum]; None when absent; else a 400 naming it."""
    values = request.query_params.getlist(name)
    if not values:
        return None
    problem = f"must be a whole number from {minimum} to {maximum}"
    if len(values) > 1:
        raise serializers.ValidationError({name: [f"give {name} once; it {problem}"]})
    raw = values[0]
    # int() would also take " 7", "+7", "7_0" and other scripts' digits; the API takes plain ASCII digits.
    if not (raw.isascii() and raw.isdigit()) or not minimum <= int(raw) <= maximum:
        raise serializers.ValidationError({name: [f"{problem}, not {raw[:40]!r}"]})
    return int(raw)


# --- filters --------------------------------------------------------------------------------------------


class UtcIsoDateTimeField(IsoDateTimeField):
    """An ISO 8601 time, turned to UTC before it reaches a query.

    Python takes UTC offsets up to ±23:59 and years from 1; PostgreSQL refuses offsets past ±15:59, and a
    time near year 1 or 9999 may leave the calendar once converted: either way a 500 unless caught here.
    """

    def to_python(self, value: Any) -> datetime | None:
        result = super().to_python(value)
        if result is None:
            return None
        try:
            return result.astimezone(UTC)
        except OverflowError as exc:
            raise forms.ValidationError("out of range once converted to UTC") from exc


class UtcIsoDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcIsoDateTimeField


# --- body parsers ---------------------------------------------------------------------------------------

NUL_MESSAGE = "text may not contain NUL characters (U+0000)"


# Deeper than any body of this API (a manifest document nests 32 deep at most, apps.pools.manifests.limits).
MAX_BODY_DEPTH = 64


def reject_nul(data: Any) -> None:
    """Raise ParseError (400) if any text in a parsed body holds a NUL character, or it nests deeper than
    ``MAX_BODY_DEPTH``.

    PostgreSQL cannot store or even compare text with NUL, so a lookup by such a name (a slug field naming a
    tenant, a username) would be a 500 there and a plain miss on SQLite; no valid input contains one. The walk
    is iterative, and the depth bound keeps every later recursive walk of the body within Python's limit.
    """
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            raise ParseError(f"the body is nested deeper than {MAX_BODY_DEPTH} levels")
        if isinstance(item, str):
            if "\x00" in item:
                raise ParseError(NUL_MESSAGE)
        elif isinstance(item, Mapping):
            for key, value in (item.lists() if hasattr(item, "lists") else item.items()):
                stack.append((key, depth + 1))
                stack.append((value, depth + 1))
        elif isinstance(item, list | tuple):
            stack.extend((child, depth + 1) for child in item)


class JSONParser(parsers.JSONParser):
    def parse(self, stream: IO[Any], media_type: str | None = None,
              parser_context: Mapping[str, Any] | None = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError as exc:  # json's decoder gives up past Python's recursion limit: a 500 otherwise
            raise ParseError(f"the body is nested deeper than {MAX_BODY_DEPTH} levels") from exc
        reject_nul(data)
        return data


class FormParser(parsers.FormParser):
    def parse(self, stream: IO[Any], media_type: str | None = None,
              parser_context: Mapping[str, Any] | None = None) -> Any:
        data = super().parse(stream, media_type, parser_context)
        reject_nul(data)
        return data


class MultiPartParser(parsers.MultiPartParser):
    def parse(self, stream: IO[Any], media_type: str | None = None,
              parser_context: Mapping[str, Any] | None = None) -> Any:
        parsed = super().parse(stream, media_type, parser_context)
        reject_nul(parsed.data)
        return parsed

