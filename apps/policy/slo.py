"""SLO tier priorities (seed 004, "SLO Tier Priorities"): GAIE convention, negative = sheddable."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from apps.policy.classes import SloTier
from apps.policy.errors import PolicyConfigError

DEFAULT_SLO_PRIORITIES: Mapping[str, int] = MappingProxyType(
    {
        SloTier.CRITICAL.value: 4,
        SloTier.STANDARD.value: 3,
        SloTier.BATCH.value: -1,
        SloTier.SHEDDABLE.value: -2,
        SloTier.BACKGROUND.value: -3,
    }
)


def _normalise(slo_class: SloTier | str | None) -> str:
    if slo_class is None:
        return ""
    return slo_class.value if isinstance(slo_class, SloTier) else str(slo_class).strip().lower()


def merged_priorities(overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    """The defaults with `overrides` merged on top (unspecified classes keep their defaults)."""
    merged = dict(DEFAULT_SLO_PRIORITIES)
    for name, value in (overrides or {}).items():
        key = _normalise(name)
        if not key:
            raise PolicyConfigError("slo_priorities has an empty class name")
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyConfigError(f"slo_priorities[{name!r}] must be an integer, got {value!r}")
        merged[key] = value
    return merged


def slo_priority(slo_class: SloTier | str | None, overrides: Mapping[str, int] | None = None) -> int:
    """Priority of an SLO class; empty or unknown classes are `standard`."""
    table = merged_priorities(overrides) if overrides else DEFAULT_SLO_PRIORITIES
    key = _normalise(slo_class)
    if key in table:
        return table[key]
    return table[SloTier.STANDARD.value]


def priority_in(table: Mapping[str, int], slo_class: SloTier | str | None) -> int:
    """Look a class up in a table already merged by `merged_priorities` (no re-validation: this
    is the per-request path of the admission policies and the flow controller)."""
    key = _normalise(slo_class)
    value = table.get(key)
    return table[SloTier.STANDARD.value] if value is None else value


def known_slo_tier(slo_class: SloTier | str | None, table: Mapping[str, int] = DEFAULT_SLO_PRIORITIES) -> str | None:
    """The normalised name of a tier the table knows (the five defaults plus any configured), else None."""
    key = _normalise(slo_class)
    return key if key in table else None


def relaxed_slo_tier(
    granted: str, requested: SloTier | str | None, table: Mapping[str, int] = DEFAULT_SLO_PRIORITIES
) -> str:
    """The tier a request runs at: the one it asks for only when that is no higher in priority than the tier
    its entitlement grants (a client may ask for less, never for more); unknown or empty asks count for
    nothing (the gateway refuses unknown objectives before they get here)."""
    key = _normalise(requested)
    if key in table and table[key] <= priority_in(table, granted):
        return key
    return granted


def is_sheddable(priority: int) -> bool:
    """The llm-d IsSheddable contract: priority < 0."""
    return priority < 0
