"""Schemathesis against /api/schema/: every REST operation, as a superuser and as a tenant owner.

Each operation is one test in its own database transaction (so on PostgreSQL too, under `make test-postgres`),
with a small world of tenants, pools, entitlements, keys (one made by the system, so ``created_by`` is null;
one revoked; one expired) and usage records. Path parameters are drawn either by schemathesis or from that
world's real names and ids, so detail operations also reach real objects, not only 404s.

Bounded and reproducible: a fixed seed, derandomized generation, no example database; 12 random cases per
operation plus the boundaries of every query and path parameter, 30 random cases per operation with a body
(valid and invalid alike). The site is called in-process through Django's WSGI handler (the same views,
middleware and authentication as under uvicorn, without a server). The checks: no 5xx, every status code
documented, response bodies, content types and headers as the schema says, invalid path and query
parameters (``limit``, ``offset``, filters, ids) rejected, authentication enforced where the schema asks
for it, and undeclared methods answered 405.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import schemathesis
import yaml
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.utils import timezone
from hypothesis import HealthCheck, settings
from rest_framework.authtoken.models import Token
from schemathesis.checks import not_a_server_error
from schemathesis.core import media_types
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from apps.gateway.models import UsageRecord
from apps.pools.models import Replica
from apps.tenancy.actors import SYSTEM
from apps.tenancy.models import ApiKey, Membership
from apps.tenancy.services import apikey_create, apikey_revoke
from tests.pools.factories import make_entitlement, make_pool

CONFIG = schemathesis.Config.from_dict({
    "seed": 20260614,
    "generation": {"max-examples": 12, "deterministic": True, "database": "none"},
    "phases": {"stateful": {"enabled": False}},
    # The coverage phase walks every boundary of every parameter (limit 0, 501, -1, text, 2**63...), but on a
    # body it makes hundreds of cases per operation (seconds each); bodies get more random examples instead.
    "operations": [{"include-method": ["POST", "PUT", "PATCH"], "phases": {"coverage": {"enabled": False}},
                    "generation": {"max-examples": 30}}],
})


def invalid_parameters_rejected(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
    """Schemathesis' negative_data_rejection for path and query parameters (``limit``, ``offset``, filters, ids).

    Bodies are left out: DRF's fields coerce by design (a number sent for a string field is taken as its
    text, "12" for an integer as 12), which the schema does not spell out; bad bodies are still checked
    for 5xx and for their documented 400.
    """
    if case.meta is not None and case.meta.is_negative_at(ParameterLocation.BODY):
        return None
    return negative_data_rejection(ctx, response, case)


@schemathesis.deserializer(*media_types.YAML_MEDIA_TYPES)
def yaml_stream(ctx: Any, response: Any) -> list[Any]:
    """``GET /api/v1/export`` answers a multi-document YAML stream, which its schema states as the list of its
    documents; schemathesis' own YAML reader takes a single document."""
    return list(yaml.safe_load_all(response.content.decode(response.encoding or "utf-8")))


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, invalid_parameters_rejected, ignored_auth, unsupported_method]

schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", WSGIHandler(), config=CONFIG)

# Real path parameters of the world of the running test, by operation path (filled by the `world` fixture).
KNOWN: dict[str, list[Any]] = {}
# Real values for the fields of request bodies that name another object.
KNOWN_REFERENCES = {"tenant": ["acme", "globex"], "pool": ["qwen3-8b", "spare"],
                    "entitlement": ["acme-g", "globex-e"], "user": ["olivia", "mark", "root"]}


def _pick(value: Any, choices: list[Any]) -> Any:
    """One of ``choices`` or None (keep the generated value), chosen by the value itself: deterministic."""
    pick = zlib.crc32(repr(value).encode()) % (len(choices) + 1)
    return choices[pick] if pick < len(choices) else None


def aim_at_known_objects(case: schemathesis.Case) -> None:
    """Most cases name real objects (in the path, and in a body's references to tenants, pools, entitlements
    and users), so that bodies reach validation and successes are checked too. Parts generated as invalid
    on purpose are kept. (Here rather than in a hook: the coverage phase runs no case hooks.)"""
    meta = case.meta
    params = case.path_parameters or {}
    known = KNOWN.get(case.operation.path)
    if known and len(params) == 1 and not (meta is not None and meta.is_negative_at(ParameterLocation.PATH)):
        ((name, value),) = params.items()
        chosen = _pick(value, known)
        if chosen is not None:
            case.path_parameters = {name: chosen}
    if isinstance(case.body, dict) and not (meta is not None and meta.is_negative_at(ParameterLocation.BODY)):
        body = dict(case.body)
        for field, choices in KNOWN_REFERENCES.items():
            if isinstance(body.get(field), str):
                chosen = _pick(body[field], choices)
                body[field] = body[field] if chosen is None else chosen
        case.body = body


# Cases called, by operation and status class ("failed": a check failed): printed at the end of the module (run with -s to see it).
CALLED: Counter[tuple[str, str]] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _print_case_count() -> Iterator[None]:
    yield
    statuses = Counter(status for (_, status), n in CALLED.items() for _ in range(n))
    operations = len({label for label, _ in CALLED})
    print(f"\nschemathesis: {sum(CALLED.values())} cases on {operations} operations, by status {dict(statuses)}")


@pytest.fixture(autouse=True)
def _requests_keep_the_test_connection() -> Iterator[None]:
    # Django's WSGI handler closes the database connection around each request, which would end the test's
    # transaction on PostgreSQL; Django's test client disconnects the same signals for the same reason.
    for signal in (request_started, request_finished):
        signal.disconnect(close_old_connections)
    yield
    for signal in (request_started, request_finished):
        signal.connect(close_old_connections)


@pytest.fixture
def world(admin: Any, acme: Any, globex: Any, owner: Any, member: Any, pool: Any) -> None:
    now = timezone.now()
    spare = make_pool(admin, name="spare", replicas=[{"url": "http://127.0.0.1:9001"}])
    Replica.objects.filter(pool=pool).update(healthy=True, scraped_at=now, num_requests_running=3, kv_cache_usage=0.5)
    ent = make_entitlement(admin, acme, pool, "acme-g", expires_at=now + timedelta(days=30))
    other = make_entitlement(admin, globex, pool, "globex-e", "elastic")
    keys = [
        apikey_create(actor=owner, entitlement=ent, name="owner's")[0],
        apikey_create(actor=SYSTEM, entitlement=ent, name="made by the system")[0],
        apikey_create(actor=member, entitlement=ent, name="soon expired", expires_at=now + timedelta(seconds=1))[0],
        apikey_create(actor=SYSTEM, entitlement=other)[0],
    ]
    revoked, _ = apikey_create(actor=owner, entitlement=ent, name="revoked")
    apikey_revoke(actor=owner, key=revoked)
    ApiKey.objects.filter(pk=keys[2].pk).update(expires_at=now - timedelta(minutes=1))
    minute = now.replace(second=0, microsecond=0)
    usage = [UsageRecord.objects.create(tenant=t, entitlement=e, minute=minute, requests=3, prompt_tokens=30,
                                        completion_tokens=12, rejected=1) for t, e in ((acme, "acme-g"), (globex, "globex-e"))]
    KNOWN.clear()
    KNOWN.update({
        "/api/v1/tenants/{slug}/": ["acme", "globex"],
        "/api/v1/users/{id}/": [admin.pk, owner.pk, member.pk],
        "/api/v1/memberships/{id}/": list(Membership.objects.values_list("pk", flat=True)),
        "/api/v1/pools/{name}/": [pool.name, spare.name],
        "/api/v1/entitlements/{name}/": ["acme-g", "globex-e"],
        "/api/v1/entitlements/{name}/history/": ["acme-g", "globex-e"],
        "/api/v1/keys/{id}/": [k.pk for k in (*keys, revoked)],
        "/api/v1/keys/{id}/revoke/": [k.pk for k in (*keys, revoked)],
        "/api/v1/usage/{id}/": [u.pk for u in usage],
    })


@pytest.fixture
def token(persona: str, world: None, admin: Any, owner: Any) -> str:
    return Token.objects.create(user=admin if persona == "superuser" else owner).key


@pytest.mark.api
@pytest.mark.django_db
@pytest.mark.parametrize("persona", ["superuser", "owner"])
@schema.parametrize()
# The fixtures are the world each operation's examples share (the test's transaction, rolled back after it).
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_api_conforms_to_its_schema(case: schemathesis.Case, token: str, persona: str) -> None:
    aim_at_known_objects(case)
    outcome = "failed"
    try:
        response = case.call_and_validate(headers={"Authorization": f"Token {token}"}, checks=CHECKS)
        outcome = f"{response.status_code // 100}xx"
    finally:
        CALLED[(case.operation.label, outcome)] += 1
