"""Strict readers of environment variables, used only by `tokenpools_site.settings`.

Every reader takes the variable's name and its embedded default and returns the parsed value; a value
that does not parse, or falls outside its bounds, raises `ImproperlyConfigured` naming the variable and
the value, so a typo stops start-up instead of silently becoming a default (`GATEWAY_FAIL_OPEN=ture`
would otherwise read as false). A variable that is unset, empty or only blanks takes the default.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping

from django.core.exceptions import ImproperlyConfigured

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def env_raw(name: str, *, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value with surrounding blanks removed, or None when unset or blank."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def env_names(pattern: str, *, environ: Mapping[str, str] | None = None) -> list[str]:
    """The names of the variables that are set and match the regular expression `pattern` in full, sorted."""
    compiled = re.compile(pattern)
    return sorted(name for name in (os.environ if environ is None else environ) if compiled.fullmatch(name))


def _bad(name: str, raw: str, expected: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"{name} must be {expected}, got {raw!r}")


def env_str(name: str, default: str, *, environ: Mapping[str, str] | None = None) -> str:
    raw = env_raw(name, environ=environ)
    return default if raw is None else raw


def env_bool(name: str, default: bool, *, environ: Mapping[str, str] | None = None) -> bool:
    """1/0, true/false, yes/no, on/off in any case; anything else is refused."""
    raw = env_raw(name, environ=environ)
    if raw is None:
        return default
    word = raw.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise _bad(name, raw, "a boolean (1/0, true/false, yes/no, on/off)")


def _check_bounds(
    name: str, raw: str, value: float, *, at_least: float | None, above: float | None, at_most: float | None
) -> None:
    if at_least is not None and value < at_least:
        raise _bad(name, raw, f"at least {at_least:g}")
    if above is not None and value <= above:
        raise _bad(name, raw, f"above {above:g}")
    if at_most is not None and value > at_most:
        raise _bad(name, raw, f"at most {at_most:g}")


def env_int(
    name: str,
    default: int,
    *,
    at_least: int | None = None,
    above: int | None = None,
    at_most: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """A whole number (underscores allowed, as in Python: 1_048_576), within the given bounds."""
    raw = env_raw(name, environ=environ)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, raw, "a whole number") from None
    _check_bounds(name, raw, value, at_least=at_least, above=above, at_most=at_most)
    return value


def env_float(
    name: str,
    default: float,
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> float:
    """A finite number within the given bounds (nan and inf are refused)."""
    raw = env_raw(name, environ=environ)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _bad(name, raw, "a number") from None
    if not math.isfinite(value):
        raise _bad(name, raw, "a finite number")
    _check_bounds(name, raw, value, at_least=at_least, above=above, at_most=at_most)
    return value


def env_choice(
    name: str, default: str, choices: Iterable[str], *, environ: Mapping[str, str] | None = None
) -> str:
    """One of `choices`, matched without regard to case; returned as spelled in `choices`."""
    options = tuple(choices)
    raw = env_raw(name, environ=environ)
    if raw is None:
        return default
    for option in options:
        if raw.lower() == option.lower():
            return option
    raise _bad(name, raw, "one of " + ", ".join(options))


def env_list(name: str, default: Iterable[str], *, environ: Mapping[str, str] | None = None) -> list[str]:
    """Comma-separated items, blanks around them dropped; empty items are skipped."""
    raw = env_raw(name, environ=environ)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]
