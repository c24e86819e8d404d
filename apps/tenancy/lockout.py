"""Failed sign-ins are counted per user and per address; too many in a window lock both for a while.

`LOGIN_FAILURE_LIMIT` failures within `LOGIN_FAILURE_WINDOW_S` (counted from the first) for one username,
or from one address, lock that username, or that address, for `LOGIN_LOCKOUT_S`: every sign-in it
attempts is refused before its password is checked, the right password too (otherwise the lock would only
slow a guesser down to the rate the window allows and then confirm the hit). The lock ends by itself (a
cache entry that expires); a successful sign-in clears the user's count. Each lock is logged at WARNING
with the username and the address.

The counts live in Django's cache (`CACHES` in settings: Redis when `REDIS_URL` is set, so every server
process shares them; the process's memory otherwise, where `serve` runs one process). Usernames are
hashed into the keys (any length, any character) and compared without regard to case, so `Admin` and
`admin` share a count.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time

from django.conf import settings
from django.core.cache import cache

logger = logging.getLogger(__name__)

PREFIX = "tp:signin:"


def _subjects(username: str, address: str) -> tuple[tuple[str, str], ...]:
    digest = hashlib.sha256(username.casefold().encode()).hexdigest()[:32]
    return (("user", digest), ("addr", address or "unknown"))


def seconds_locked(*, username: str, address: str) -> int | None:
    """Whole seconds until this username and this address may try again (the longer lock), or None."""
    now = time.time()
    until = [cache.get(f"{PREFIX}lock:{kind}:{key}") for kind, key in _subjects(username, address)]
    left = max((float(u) - now for u in until if u is not None), default=0.0)
    return max(1, math.ceil(left)) if left > 0 else None


def _count(key: str, window_s: float) -> int:
    cache.add(key, 0, timeout=window_s)  # the window starts at the first failure
    try:
        return int(cache.incr(key))
    except ValueError:  # expired between add and incr: this failure starts a new window
        cache.set(key, 1, timeout=window_s)
        return 1


def record_failure(*, username: str, address: str) -> int | None:
    """Count a failed sign-in; returns the lock's length in seconds when this failure started one."""
    limit, window_s, lockout_s = settings.LOGIN_FAILURE_LIMIT, settings.LOGIN_FAILURE_WINDOW_S, settings.LOGIN_LOCKOUT_S
    locked = None
    for kind, key in _subjects(username, address):
        if _count(f"{PREFIX}fail:{kind}:{key}", window_s) >= limit:
            cache.set(f"{PREFIX}lock:{kind}:{key}", time.time() + lockout_s, timeout=lockout_s)
            cache.delete(f"{PREFIX}fail:{kind}:{key}")  # a fresh count once the lock has ended
            locked = math.ceil(lockout_s)
            logger.warning("sign-in locked for %d s: %d failed attempts within %g s for the %s of user %r "
                           "from address %s", locked, limit, window_s,
                           "username" if kind == "user" else "address", username, address)
    return locked


def record_success(*, username: str) -> None:
    """A right password (while not locked): the user's count starts again; the address's does not, so
    one valid account does not reset a guesser's count against the others."""
    kind, key = _subjects(username, "")[0]
    cache.delete(f"{PREFIX}fail:{kind}:{key}")


def locked_message(seconds: int) -> str:
    return f"Too many failed sign-ins for this user or from this address; try again in {seconds} s."
