"""Who is acting and through which way in, for the audit entries written while they act.

A ``ContextVar``: each request (thread or task) and each command sees its own. The HTTP middleware keeps the
request rather than its user, because DRF authenticates a token only inside the view (and then sets the user on
the Django request too): the actor is read when an entry is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

# The ways in, as entries name them.
CHANNELS = ("ui", "api", "apply", "delete", "prune", "admin", "command", "system")
SYSTEM_NAME = "system"


@dataclass(frozen=True)
class Acting:
    channel: str = "system"
    user: Any = None  # a user (or SYSTEM), or None: read from ``request`` or "system"
    request: Any = None  # the Django HttpRequest of an HTTP call

    def actor(self) -> tuple[int | None, str]:
        """(user id, username) of who acts: a login, or (None, "system") for the operator and the loops."""
        user = self.user if self.user is not None else getattr(self.request, "user", None)
        if user is None or not getattr(user, "is_authenticated", False):
            return None, SYSTEM_NAME if user is None else "anonymous"
        pk = getattr(user, "pk", None)
        name = user.get_username() if hasattr(user, "get_username") else str(getattr(user, "username", ""))
        return pk, name or SYSTEM_NAME


# Nothing set (a control loop, a shell, a command that sets nothing): the system acts.
_SYSTEM = Acting()
_current: ContextVar[Acting | None] = ContextVar("audit_acting", default=None)


def current() -> Acting:
    return _current.get() or _SYSTEM


@contextmanager
def acting(*, channel: str, user: Any = None, request: Any = None) -> Iterator[Acting]:
    """Attribute the changes made inside to ``user`` (or the request's user), through ``channel``."""
    if channel not in CHANNELS:
        raise ValueError(f"unknown audit channel {channel!r}")
    token = _current.set(Acting(channel=channel, user=user, request=request))
    try:
        yield current()
    finally:
        _current.reset(token)


@contextmanager
def through(channel: str) -> Iterator[None]:
    """The same actor, another way in (``apply --prune`` deletes as ``prune``)."""
    if channel not in CHANNELS:
        raise ValueError(f"unknown audit channel {channel!r}")
    token = _current.set(replace(current(), channel=channel))
    try:
        yield
    finally:
        _current.reset(token)

