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


@register.filter
def duration(seconds: object) -> str:
    """``5400`` -> ``1 h 30 min``; ``42`` -> ``42 s``; None (never, at this rate) -> ``—``."""
    try:
        total = float(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "—"
    if total < 60:
        return f"{int(total)} s"
    minutes = int(total // 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{hours // 24} d {hours % 24} h"
