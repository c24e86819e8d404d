"""Priority weight (1), service debt (2) and burst intensity (3) from seed 000, section 3.3.

(1)  w_e = w_class * (1 + a_slo * l_e / l_mean)^-1 * (1 + a_burst * b_e)^-1 * (1 + a_debt * d_e)
(2)  d_e(k) = gamma_d * d_e(k-1) + (1 - gamma_d) * g_e(k)
(3)  delta_e = sum over dimensions of max(0, served / baseline - 1);  b_e(k) = gamma_b * b_e(k-1) + (1 - gamma_b) * delta_e(k)

Refinements beyond the paper (documented in the package docstring):
- the service gap counts only unmet demand: g = (min(baseline, demand) - served) / baseline, so an
  idle entitlement gains no debt and one bursting above its baseline earns credit (g < 0);
- spot and preemptible never accrue debt, and any debt passed for them is ignored by (1);
- a dimension with a zero baseline contributes nothing to burst (the ratio is undefined);
- the debt factor (1 + a_debt * d) is floored at `min_debt_factor` (default 0.1) because a large
  credit would otherwise make the weight negative, which (1) never intends.
"""

from __future__ import annotations

from dataclasses import dataclass

from apps.policy.classes import DIMENSIONS, Dimension, ResourceVector, ServiceClass
from apps.policy.errors import PolicyConfigError, require_finite, require_non_negative, require_positive

DEFAULT_ALPHA_SLO = 2.0
DEFAULT_ALPHA_BURST = 1.0
DEFAULT_ALPHA_DEBT = 4.0
DEFAULT_GAMMA_DEBT = 0.7
DEFAULT_GAMMA_BURST = 0.7
DEFAULT_MIN_DEBT_FACTOR = 0.1


def priority_weight(
    service_class: ServiceClass | str,
    slo_target_ms: float,
    mean_slo_ms: float,
    burst: float = 0.0,
    debt: float = 0.0,
    *,
    alpha_slo: float = DEFAULT_ALPHA_SLO,
    alpha_burst: float = DEFAULT_ALPHA_BURST,
    alpha_debt: float = DEFAULT_ALPHA_DEBT,
    min_debt_factor: float = DEFAULT_MIN_DEBT_FACTOR,
) -> float:
    """Formula (1) of seed 000: one scalar that orders every admission decision."""
    traits = ServiceClass.parse(service_class).traits
    require_positive("slo_target_ms", slo_target_ms)
    require_positive("mean_slo_ms", mean_slo_ms)
    require_non_negative("burst", burst)
    require_finite("debt", debt)
    if not traits.accrues_debt:
        debt = 0.0
    slo_factor = 1.0 / (1.0 + alpha_slo * slo_target_ms / mean_slo_ms)
    burst_factor = 1.0 / (1.0 + alpha_burst * burst)
    debt_factor = max(min_debt_factor, 1.0 + alpha_debt * debt)
    return traits.base_weight * slo_factor * burst_factor * debt_factor


def service_gap(baseline: float, demand: float, served: float) -> float:
    """g = (min(baseline, demand) - served) / baseline; 0 when there is no baseline to owe."""
    if baseline <= 0:
        return 0.0
    return (min(baseline, max(demand, 0.0)) - max(served, 0.0)) / baseline


def ewma(previous: float, sample: float, gamma: float) -> float:
    """x(k) = gamma * x(k-1) + (1 - gamma) * sample: the update shared by (2) and (3)."""
    return gamma * previous + (1.0 - gamma) * sample


def debt_update(previous_debt: float, gap: float, gamma_d: float = DEFAULT_GAMMA_DEBT) -> float:
    """Formula (2)."""
    return ewma(previous_debt, gap, gamma_d)


def burst_delta(served: ResourceVector, baseline: ResourceVector) -> float:
    """Formula (3)'s delta_e; dimensions with a zero baseline contribute nothing."""
    total = 0.0
    for dimension in DIMENSIONS:
        base = baseline.get(dimension)
        if base > 0:
            total += max(0.0, served.get(dimension) / base - 1.0)
    return total


def burst_update(previous_burst: float, delta: float, gamma_b: float = DEFAULT_GAMMA_BURST) -> float:
    return ewma(previous_burst, delta, gamma_b)


@dataclass(frozen=True, slots=True)
class Dynamics:
    """The EWMA state of one entitlement between ticks."""

    debt: float = 0.0
    burst: float = 0.0

    # Written out, as `ResourceVector.__init__` (mypyc compiles it; the generated one stays interpreted).
    def __init__(self, debt: float = 0.0, burst: float = 0.0) -> None:
        object.__setattr__(self, "debt", debt)
        object.__setattr__(self, "burst", burst)


# An entitlement that owes nothing and has not burst: where every EWMA starts and where idle ones stay.
AT_REST = Dynamics()


@dataclass(frozen=True, slots=True)
class DynamicsConfig:
    gamma_d: float = DEFAULT_GAMMA_DEBT
    gamma_b: float = DEFAULT_GAMMA_BURST
    # The dimension whose baseline the service gap is measured against; the paper uses throughput.
    debt_dimension: Dimension = Dimension.TOKENS_PER_SECOND

    def __post_init__(self) -> None:
        for name in ("gamma_d", "gamma_b"):
            value = require_finite(name, getattr(self, name))
            if not 0.0 <= value < 1.0:
                raise PolicyConfigError(f"{name} must be in [0, 1), got {value!r}")


def update_dynamics(
    previous: Dynamics,
    service_class: ServiceClass | str,
    baseline: ResourceVector,
    demand: ResourceVector,
    served: ResourceVector,
    config: DynamicsConfig | None = None,
) -> Dynamics:
    """One EWMA tick of debt (2) and burst (3) for one entitlement.

    The gap is measured on `config.debt_dimension`, falling back to the first dimension that has a
    baseline (an entitlement sized only in slots, as in Experiment 2, still accrues debt).
    """
    config = config or DynamicsConfig()
    traits = ServiceClass.parse(service_class).traits
    debt = 0.0
    if traits.accrues_debt:
        dimension = config.debt_dimension
        if baseline.get(dimension) <= 0:
            dimension = next((d for d in DIMENSIONS if baseline.get(d) > 0), dimension)
        gap = service_gap(baseline.get(dimension), demand.get(dimension), served.get(dimension))
        debt = debt_update(previous.debt, gap, config.gamma_d)
    burst = burst_update(previous.burst, burst_delta(served, baseline), config.gamma_b)
    return Dynamics(debt=debt, burst=burst)
