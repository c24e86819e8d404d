"""Turn an admission spec (scenario `admission:` merged with `--policy-config` and flags) into an adapter."""

from __future__ import annotations

from typing import Any

from apps.policy.admission import AdmissionConfig
from apps.policy.errors import PolicyConfigError
from apps.policy.priority import DynamicsConfig
from apps.simulator.admission import BLIS_POLICIES, BlisAdmission, TokenPoolsAdmission
from apps.simulator.cluster import AdmissionAdapter
from apps.simulator.simulation import SimConfig

_BLIS_KEYS = {
    "policy", "token_bucket_capacity", "token_bucket_refill_rate", "tier_shed_threshold", "tier_shed_min_priority",
    "gaie_qd_threshold", "gaie_kv_threshold", "slo_priorities", "slo_targets", "tenant_budgets", "flow_control",
}  # fmt: skip
_POOL_CONFIG_KEYS = {"alpha_slo", "alpha_burst", "alpha_debt", "min_debt_factor", "expected_service_s",
                     "not_bound_retry_s", "never_retry_s", "wait_timeout_s"}  # fmt: skip
_POOL_KEYS = {"policy", "tick_s", "gamma_d", "gamma_b", "mean_slo_ms", "retry_jitter", "use_saturation",
              "slo_targets", "flow_control", "aimd", *_POOL_CONFIG_KEYS}  # fmt: skip


def _check_keys(spec: dict[str, Any], allowed: set[str], policy: str) -> None:
    unknown = set(spec) - allowed
    if unknown:
        raise PolicyConfigError(
            f"admission ({policy}): unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}"
        )


def build_admission(spec: dict[str, Any], config: SimConfig) -> AdmissionAdapter | None:
    policy = str(spec.get("policy") or "none").strip().lower()
    flow = spec.get("flow_control") or {}
    if flow.get("enabled"):
        from apps.simulator.flow import build_flow_control

        return build_flow_control(spec, config)
    if policy == "none":
        _check_keys(spec, {"policy", "slo_targets", "flow_control"}, policy)
        return None
    if policy == "token-pools":
        _check_keys(spec, _POOL_KEYS, policy)
        config_values: dict[str, Any] = {k: float(v) for k, v in spec.items() if k in _POOL_CONFIG_KEYS}
        admission_config = AdmissionConfig(**config_values)
        dynamics_values: dict[str, Any] = {k: float(spec[k]) for k in ("gamma_d", "gamma_b") if k in spec}
        dynamics = DynamicsConfig(**dynamics_values)
        from apps.simulator.flow import build_aimd

        aimd, aimd_tick_s, window_ticks, bounds = build_aimd(spec.get("aimd") or {})
        return TokenPoolsAdmission(
            config.tenants,
            seed=config.seed,
            tick_s=float(spec.get("tick_s", 1.0)),
            config=admission_config,
            dynamics=dynamics,
            mean_slo_ms=None if spec.get("mean_slo_ms") is None else float(spec["mean_slo_ms"]),
            retry_jitter=float(spec.get("retry_jitter", 0.0)),
            use_saturation=bool(spec.get("use_saturation", False)),
            aimd=aimd, aimd_tick_s=aimd_tick_s, aimd_window_ticks=window_ticks, aimd_bounds_s=bounds,
        )
    if policy == "drr":
        from apps.simulator.flow import build_drr

        return build_drr(spec, config)
    if policy in BLIS_POLICIES:
        _check_keys(spec, _BLIS_KEYS, policy)
        params: dict[str, Any] = {
            key: spec[key]
            for key in (
                "token_bucket_capacity",
                "token_bucket_refill_rate",
                "tier_shed_threshold",
                "tier_shed_min_priority",
                "gaie_qd_threshold",
                "gaie_kv_threshold",
            )  # fmt: skip
            if key in spec
        }
        budgets = spec.get("tenant_budgets")
        if budgets is not None and not isinstance(budgets, dict):
            raise PolicyConfigError("admission.tenant_budgets must map tenant names to budgets")
        return BlisAdmission(policy, params, budgets, spec.get("slo_priorities"))
    raise PolicyConfigError(
        f"unknown admission policy {policy!r}; expected one of {', '.join((*BLIS_POLICIES, 'token-pools', 'drr', 'none'))}"
    )
