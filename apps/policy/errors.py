"""Errors raised by the policy engine."""

from __future__ import annotations


class PolicyConfigError(ValueError):
    """A policy parameter is invalid (non-positive capacity, NaN, threshold out of range, ...).

    Subclasses ValueError so callers that only know the builtin still catch it; the message names
    the parameter and the value so an operator can fix the configuration.
    """


def require_finite(name: str, value: float) -> float:
    """Reject NaN, infinities and non-numbers with a message naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value in (
        float("inf"),
        float("-inf"),
    ):
        raise PolicyConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def require_positive(name: str, value: float) -> float:
    number = require_finite(name, value)
    if number <= 0:
        raise PolicyConfigError(f"{name} must be > 0, got {value!r}")
    return number


def require_non_negative(name: str, value: float) -> float:
    number = require_finite(name, value)
    if number < 0:
        raise PolicyConfigError(f"{name} must be >= 0, got {value!r}")
    return number
