"""The gateway harness of tests/gateway, for the deploy artefacts' tests (they check against a real gateway)."""

from __future__ import annotations

from tests.gateway.conftest import gateway_factory, upstream_factory  # noqa: F401
from tests.pools.factories import acme, admin, globex  # noqa: F401
