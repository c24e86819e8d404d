from __future__ import annotations

from typing import Any

import pytest

from tests.pools.factories import acme, admin, globex, member, outsider, owner, pool  # noqa: F401


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
