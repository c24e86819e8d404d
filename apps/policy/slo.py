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


def is_sheddable(priority: int) -> bool:
    """The llm-d IsSheddable contract: priority < 0."""
    return priority < 0
