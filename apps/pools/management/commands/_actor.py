"""Who a management command acts as: the system operator, or ``--as USERNAME`` to act as a real user; and the
manifest sources the manifest commands read (``-f``, ``-R``)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from apps.tenancy.services import SYSTEM


def resolve_actor(username: str | None) -> Any:
    if not username:
        return SYSTEM
    try:
        return get_user_model().objects.get(username=username, is_active=True)
    except get_user_model().DoesNotExist as exc:
        raise CommandError(f"no active user {username!r}") from exc


def add_manifest_arguments(parser: Any) -> None:
    """``-f`` (repeatable: files, directories, ``-``), ``-R`` and ``--as``, as `apply` and `diff` take them."""
    parser.add_argument("-f", "--filename", action="append", required=True,
                        help="a manifest file (.yaml, .yml, .json), a directory of them, or - for stdin; repeatable")
    parser.add_argument("-R", "--recursive", action="store_true",
                        help="also read the subdirectories of the directories named with -f")
    parser.add_argument("--as", dest="as_user", help="act as this user (default: the platform operator)")
