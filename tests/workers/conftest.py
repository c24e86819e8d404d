from __future__ import annotations

from tests.pools.factories import acme, admin  # noqa: F401  (fixtures)
