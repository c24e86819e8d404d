"""Resources and service classes (seed 000, sections 3.1 and 3.2, Table 1).

Three schedulable dimensions: token throughput (tokens/s), KV cache (bytes) and concurrency
(active sequences). Five service classes with the paper's base weights and protection semantics.

`CLASS_TRAITS` is the project's one table of the service classes: the Django models (choices, weights,
which classes bind capacity), the API's help texts and the gateway's DRR shares are all derived from it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from apps.policy.errors import PolicyConfigError


class Dimension(enum.StrEnum):
    """The three schedulable resources of a token pool (seed 000, section 3.1)."""

    TOKENS_PER_SECOND = "tokens_per_second"
    KV_BYTES = "kv_bytes"
    CONCURRENCY = "concurrency"


# The dimensions in order, as a tuple: iterating the enum class itself is several times slower, and the
# EWMA tick does it for every entitlement every second.
DIMENSIONS: tuple[Dimension, ...] = tuple(Dimension)
_TOKENS, _KV_BYTES, _CONCURRENCY = Dimension.TOKENS_PER_SECOND, Dimension.KV_BYTES, Dimension.CONCURRENCY


@dataclass(frozen=True, slots=True)
class ResourceVector:
    """An amount of each of the three resources, e.g. a baseline `(lambda_e, chi_e, r_e)`."""

    tokens_per_second: float = 0.0
    kv_bytes: float = 0.0
    concurrency: float = 0.0

    # Written out (dataclasses keeps a class's own __init__): mypyc compiles this one and `object.__setattr__` on a
    # field into a plain store, the generated one stays interpreted; the EWMA tick builds three per entitlement.
    def __init__(self, tokens_per_second: float = 0.0, kv_bytes: float = 0.0, concurrency: float = 0.0) -> None:
        object.__setattr__(self, "tokens_per_second", _amount("tokens_per_second", tokens_per_second))
        object.__setattr__(self, "kv_bytes", _amount("kv_bytes", kv_bytes))
        object.__setattr__(self, "concurrency", _amount("concurrency", concurrency))

    def get(self, dimension: Dimension) -> float:
        # By identity, not getattr(self, dimension.value): an enum's `.value` is a Python-level property.
        if dimension is _TOKENS:
            return float(self.tokens_per_second)
        if dimension is _KV_BYTES:
            return float(self.kv_bytes)
        if dimension is _CONCURRENCY:
            return float(self.concurrency)
        raise ValueError(f"not a dimension: {dimension!r}")


def _amount(name: str, value: float) -> float:
    """A resource amount as given, refused unless it is a non-negative number."""
    if not isinstance(value, int | float) or math.isnan(value) or value < 0:
        raise PolicyConfigError(f"{name} must be a non-negative number, got {value!r}")
    return value


class Baseline(enum.StrEnum):
    RESERVED = "reserved"
    TIME_AVERAGED = "time_averaged"
    NONE = "none"


class Shrink(enum.StrEnum):
    NEVER = "never"
    YES = "yes"
    EVICT = "evict"


class SloTier(enum.StrEnum):
    """The SLO tiers of seed 004 (GAIE convention)."""

    CRITICAL = "critical"
    STANDARD = "standard"
    BATCH = "batch"
    SHEDDABLE = "sheddable"
    BACKGROUND = "background"


@dataclass(frozen=True, slots=True)
class ClassTraits:
    """One row of Table 1 plus what the rest of the policy needs to know about the class."""

    base_weight: float
    baseline: Baseline
    may_burst: bool
    shrink: Shrink
    default_slo_tier: SloTier
    # The class's integer share of a pool's dispatch budget when every flow is backlogged (seed 002's DRR).
    drr_weight: int
    # The entitlement's own queue unless it sets one: how many requests over its own limits may wait, and how
    # long (0: refused at once).
    queue_max: int = 0
    queue_max_wait_ms: float = 0.0
    # Derived from the row once (every admission decision reads them; plain attributes, not properties):
    # dedicated and guaranteed capacity is held for the entitlement even while it is idle (`reserved`); spot
    # and preemptible have no baseline to owe them, so they never accumulate debt (`accrues_debt`).
    reserved: bool = field(init=False, repr=False, compare=False)
    accrues_debt: bool = field(init=False, repr=False, compare=False)
    evictable: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "reserved", self.baseline is Baseline.RESERVED)
        object.__setattr__(self, "accrues_debt", self.baseline is not Baseline.NONE)
        object.__setattr__(self, "evictable", self.shrink is Shrink.EVICT)

    @property
    def binds_capacity(self) -> bool:
        """Binding fits the baseline into the pool's capacity: reserved, or time-averaged for elastic."""
        return self.baseline is not Baseline.NONE


class ServiceClass(enum.StrEnum):
    DEDICATED = "dedicated"
    GUARANTEED = "guaranteed"
    ELASTIC = "elastic"
    SPOT = "spot"
    PREEMPTIBLE = "preemptible"

    @property
    def traits(self) -> ClassTraits:
        return CLASS_TRAITS[self]

    @property
    def label(self) -> str:
        return self.value.capitalize()

    @property
    def rank(self) -> int:
        """0 for dedicated, the highest tier, down to 4 for preemptible (the order of Table 1)."""
        return CLASS_ORDER.index(self)

    def is_lower_than(self, other: ServiceClass | str) -> bool:
        return self.rank > ServiceClass.parse(other).rank

    @classmethod
    def parse(cls, value: ServiceClass | str) -> ServiceClass:
        if isinstance(value, ServiceClass):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            known = ", ".join(member.value for member in cls)
            raise PolicyConfigError(f"unknown service class {value!r}; expected one of {known}") from None


# Highest tier first (seed 000, Table 1): a request may be served at a lower tier than its entitlement's
# (spillover, quota demotion: issue 24), never a higher one.
CLASS_ORDER: tuple[ServiceClass, ...] = tuple(ServiceClass)
# The classes that may name a spillover class, and the classes a request may spill over or be demoted to.
SPILLOVER_FROM = frozenset({ServiceClass.DEDICATED, ServiceClass.GUARANTEED, ServiceClass.ELASTIC})
SPILLOVER_TO = (ServiceClass.ELASTIC, ServiceClass.SPOT, ServiceClass.PREEMPTIBLE)

CLASS_TRAITS: dict[ServiceClass, ClassTraits] = {
    # base weight, baseline, may burst, shrink, default SLO tier, DRR weight, queue max, queue max wait (ms)
    ServiceClass.DEDICATED: ClassTraits(1000.0, Baseline.RESERVED, True, Shrink.NEVER, SloTier.CRITICAL, 8, 8, 1000.0),
    ServiceClass.GUARANTEED: ClassTraits(1000.0, Baseline.RESERVED, False, Shrink.NEVER, SloTier.CRITICAL, 8, 8,
                                         1000.0),
    ServiceClass.ELASTIC: ClassTraits(100.0, Baseline.TIME_AVERAGED, True, Shrink.YES, SloTier.STANDARD, 4, 4, 1000.0),
    ServiceClass.SPOT: ClassTraits(1.0, Baseline.NONE, True, Shrink.YES, SloTier.SHEDDABLE, 1),
    ServiceClass.PREEMPTIBLE: ClassTraits(0.1, Baseline.NONE, True, Shrink.EVICT, SloTier.BACKGROUND, 1),
}


def default_slo_tier(service_class: ServiceClass | str) -> SloTier:
    """The SLO tier a class maps to unless the entitlement or the request overrides it."""
    return ServiceClass.parse(service_class).traits.default_slo_tier


def effective_slo_tier(
    service_class: ServiceClass | str,
    entitlement_tier: SloTier | str | None = None,
) -> str:
    """The tier an entitlement grants: its own override, else its class's default. A request's objective
    can only relax this (`apps.policy.slo.relaxed_slo_tier`), never replace it.

    Returned as a plain string because seed 004 lets operators define tiers beyond the five
    defaults (unknown tiers are then treated as `standard` by `slo_priority`).
    """
    if entitlement_tier is not None and str(entitlement_tier).strip():
        tier = entitlement_tier
        return tier.value if isinstance(tier, SloTier) else str(tier).strip().lower()
    return default_slo_tier(service_class).value
