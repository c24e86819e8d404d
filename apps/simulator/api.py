"""``POST /api/v1/pools/NAME/whatif/`` (issue 26): replay a recorded window of the pool's traffic under its current
entitlements and, with a manifest, under the proposed ones (validated as ``apply`` validates it, for the user
asking, and never persisted): the report of ``manage.py replay --format json`` for that pool.

Who: operators (superusers) see every entitlement; an owner of a tenant holding an entitlement in the pool sees
its own tenants' entitlements and the pool's totals (the replay itself runs on every tenant's traffic: the pool
is shared, so the totals are the pool's); anyone else gets 403 (404 for a pool that does not exist).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.gateway.selectors import request_log_oldest, request_log_window
from apps.pools.manifests import ManifestError
from apps.pools.manifests.limits import too_large
from apps.pools.selectors import pool_get
from apps.pools.serializers import ApplyErrorsSerializer
from apps.simulator.replay_site import (
    EmptyWindow,
    ReplayInputError,
    parse_window,
    read_records,
    whatif_report,
)
from apps.tenancy.models import Role, Tenant
from apps.tenancy.services import SYSTEM


class WhatIfRequestSerializer(serializers.Serializer):
    manifest = serializers.CharField(required=False, allow_blank=False, trim_whitespace=False,
                                     help_text="the proposed manifest (YAML, as POST /api/v1/apply takes it)")
    since = serializers.CharField(help_text="window start: 90s, 30m, 1h, 2d before now, or an ISO 8601 time")
    until = serializers.CharField(required=False, help_text="window end, as since (default: now)")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name, value in attrs.items():
            if "\x00" in value:
                raise ValidationError({name: ["text may not contain NUL characters (U+0000)"]})
        return attrs


class WhatIfReportSerializer(serializers.Serializer):
    """The report's shape (`apps.simulator.replay_site.whatif_report`), for the schema."""

    window = serializers.DictField()
    entitlements = serializers.DictField(help_text='{NAME: {"pool", "tenant", "recorded", "current", "proposed"}}: '
                                                   "each column with offered, admitted, rejected, rejected_by_reason, "
                                                   "errors, waited, p50_ttft_s, p99_ttft_s, throttle, peak_debt")
    pools = serializers.DictField(help_text="per pool, the same columns over all its entitlements")
    caveats = serializers.ListField(child=serializers.CharField())


def visible_tenants(user: Any, pool: Any) -> set[str] | None:
    """The tenant slugs whose rows the user sees (None: all of them, an operator); PermissionDenied (a 403 for
    the API and the page alike) when none."""
    if getattr(user, "is_superuser", False):
        return None
    owned = set(Tenant.objects.filter(memberships__user=user, memberships__role=Role.OWNER,
                                      entitlements__pool=pool).values_list("slug", flat=True))
    if not owned:
        raise PermissionDenied("only operators and owners of this pool's tenants may run a what-if on it")
    return owned


def scoped(report: dict[str, Any], tenants: set[str] | None) -> dict[str, Any]:
    """The report with only the rows of `tenants` (pool totals kept) and no caveat naming another's entitlement."""
    if tenants is None:
        return report
    hidden = [name for name, row in report["entitlements"].items() if row["tenant"] not in tenants]
    report["entitlements"] = {n: row for n, row in report["entitlements"].items() if n not in hidden}
    report["caveats"] = [c for c in report["caveats"] if not any(f"'{name}'" in c for name in hidden)]
    if "ttft_s" in report:
        report["ttft_s"] = {n: v for n, v in report["ttft_s"].items() if n not in hidden}
    return report


def whatif_run(*, user: Any, pool: Any, tenants: set[str] | None, since: str, until: str | None,
               manifest: str | None) -> dict[str, Any]:
    """The pool's what-if report as `user` may see it (`tenants`: `visible_tenants`), every request's TTFT
    included (`ttft_s`: the page's distributions). Raises ReplayInputError (a bad window; EmptyWindow: nothing
    recorded in it) or ManifestError (the manifest's errors, as apply raises them for `user`)."""
    window = parse_window(since, until, now=timezone.now())
    held = request_log_window(user=SYSTEM, since=window[0], until=window[1], pool=pool.name).count()
    if held > settings.WHATIF_MAX_RECORDS:
        # A replay runs inside the web request: bounded as every other input is (the command has no bound).
        raise ReplayInputError(f"--since: the window holds {held:,} recorded requests, more than the "
                               f"{settings.WHATIF_MAX_RECORDS:,} a web request replays (WHATIF_MAX_RECORDS); narrow "
                               "it, or run `manage.py replay`")
    records = read_records(user=SYSTEM, since=window[0], until=window[1], pool=pool.name)
    report = whatif_report(records=records, since=window[0], until=window[1], proposed_documents=manifest,
                           actor=user, pool=pool.name, oldest=request_log_oldest(user=SYSTEM),
                           tenant_slugs=dict(Tenant.objects.values_list("id", "slug")))
    return scoped(report, tenants)


class WhatIfView(APIView):
    @extend_schema(request=WhatIfRequestSerializer, responses={
        200: OpenApiResponse(WhatIfReportSerializer, description="per entitlement: recorded, current, proposed"),
        400: OpenApiResponse(ApplyErrorsSerializer, description="the manifest's errors, as apply answers them (a bad "
                                                                "or empty window: field errors)"),
        403: OpenApiResponse(ApplyErrorsSerializer, description="not an operator or an owner of the pool's tenants, "
                                                                "or a document the user may not apply"),
        413: OpenApiResponse(ApplyErrorsSerializer, description="a manifest larger than MANIFEST_MAX_BYTES"),
    })
    def post(self, request: Request, name: str) -> Response:
        pool = pool_get(user=request.user, name=name)
        tenants = visible_tenants(request.user, pool)
        payload = WhatIfRequestSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        manifest = data.get("manifest")
        problem = too_large(len(manifest.encode())) if manifest else None
        if problem:
            return Response({"errors": [{"index": None, "kind": "", "name": "", "field": "manifest",
                                         "message": problem}]}, status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        try:
            report = whatif_run(user=request.user, pool=pool, tenants=tenants, since=data["since"],
                                until=data.get("until"), manifest=manifest)
        except EmptyWindow as exc:
            raise ValidationError({"since": [str(exc)]}) from exc
        except ReplayInputError as exc:
            field = "until" if str(exc).startswith("--until") else "since"
            raise ValidationError({field: [str(exc).removeprefix(f"--{field}: ")]}) from exc
        except ManifestError as exc:
            return Response({"errors": [i.as_dict() for i in exc.issues]}, status=403 if exc.forbidden else 400)
        report.pop("ttft_s", None)
        return Response(report)
