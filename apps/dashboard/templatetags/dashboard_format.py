"""Number formatting for the admin UI (django.contrib.humanize is not installed, and this is all we need)."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def thousands(value: object) -> str:
    """``147456`` -> ``147,456``; anything that is not a number is shown as it is."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "" if value is None else str(value)
    return f"{int(number):,}" if number.is_integer() else f"{number:,.2f}"
