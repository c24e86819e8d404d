"""What the OpenAPI schema (/api/schema/) says about errors: every status an operation can answer is documented.

drf-spectacular documents only each operation's success. `ApiSchema` (``REST_FRAMEWORK["DEFAULT_SCHEMA_CLASS"]``)
adds, to every operation that does not declare the status itself:

* 400 with field errors where input is parsed: a body (POST, PUT, PATCH) or a list's filters and pagination;
* 401 wherever credentials are checked (a missing or bad token);
* 403 on every write (the role checks of the services and permission classes, the session's CSRF check);
* 404 where the path names an object (another tenant's objects are a 404 too);
* 415 where a body is read, for a Content-Type the operation does not list.

Reads answer no 403 (a signed-in user may read what they can see; the rest is a 404). An operation with
another error (a DELETE that a service may refuse with a 400, a manifest's own error list) declares it with
``extend_schema(responses=...)`` and the shared responses below. Nothing here answers 409: conflicts are 400
field errors. 429 only where a view says `signin_lockout` (the token endpoint's failed-password lockout); the
gateway's 429s are not part of this schema.
"""

from __future__ import annotations

from typing import Any

import uritemplate
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers
from rest_framework.permissions import SAFE_METHODS


class ErrorDetailSerializer(serializers.Serializer):
    """An error that concerns the whole request (authentication, permission, a missing object)."""

    detail = serializers.CharField()


# Free-form, so a schema of its own rather than a serializer (drf-spectacular drops field-less components).
_FIELD_ERRORS = ResolvedComponent(
    name="FieldErrors",
    type=ResolvedComponent.SCHEMA,
    object="FieldErrors",
    schema={
        "type": "object",
        "additionalProperties": {},
        "description": "Bad input, nothing written: each invalid field's name maps to a list of messages (an "
        "object, or a list of objects, for nested fields); `non_field_errors` lists the errors of the whole "
        "body; `detail` says why a body could not be parsed at all.",
    },
)

FIELD_ERRORS = OpenApiResponse(_FIELD_ERRORS.ref, description="bad input: field errors")
NOT_AUTHENTICATED = OpenApiResponse(ErrorDetailSerializer, description="no credentials, or bad ones")
FORBIDDEN = OpenApiResponse(ErrorDetailSerializer, description="the user may not do this")
NOT_FOUND = OpenApiResponse(ErrorDetailSerializer, description="no such object among those the user may see")
UNSUPPORTED_MEDIA_TYPE = OpenApiResponse(ErrorDetailSerializer, description="a body in a Content-Type not listed")
TOO_MANY_SIGNINS = OpenApiResponse(ErrorDetailSerializer, description="too many failed sign-ins for this user or "
                                   "from this address: locked for the seconds in Retry-After")


class ApiSchema(AutoSchema):
    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        self.registry.register_on_missing(_FIELD_ERRORS)  # FIELD_ERRORS refers to it wherever it is used
        responses: dict[str, Any] = super()._get_response_bodies(direction)
        for code, response in self._error_responses().items():
            if code not in responses:
                responses[code] = self._get_response_for_code(response, code, direction=direction)
        return responses

    def _get_filter_parameters(self) -> list[dict[str, Any]]:
        parameters: list[dict[str, Any]] = super()._get_filter_parameters()
        for parameter in parameters:
            # django-filter reads an empty value (what an HTML form sends for a blank field) as "no filter".
            if parameter.get("in") == "query":
                parameter["allowEmptyValue"] = True
        return parameters

    def _error_responses(self) -> dict[str, OpenApiResponse]:
        found: dict[str, OpenApiResponse] = {}
        takes_body = self.method in ("POST", "PUT", "PATCH") and self.get_request_serializer() is not None
        if takes_body or (self.method == "GET" and self._is_list_view()):
            found["400"] = FIELD_ERRORS
        if getattr(self.view, "authentication_classes", None):
            found["401"] = NOT_AUTHENTICATED
        if self.method not in SAFE_METHODS:
            found["403"] = FORBIDDEN
        if uritemplate.variables(self.path):
            found["404"] = NOT_FOUND
        if takes_body:
            found["415"] = UNSUPPORTED_MEDIA_TYPE
        if getattr(self.view, "signin_lockout", False):
            found["429"] = TOO_MANY_SIGNINS
        return found
