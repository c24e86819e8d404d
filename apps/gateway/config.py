"""Gateway settings as one frozen object, built from Django's settings.

The settings themselves (names, embedded defaults, strict parsing of the environment) are defined in
`tokenpools_site.settings`; the README's Configuration section lists them. The field defaults here are the
same values, for a `GatewayConfig(...)` built directly (tests); a settings test holds the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from apps.policy import AdmissionConfig, Dimension, DynamicsConfig

# Field -> the Django setting it is read from (GatewayConfig.from_settings).
SETTING_NAMES: dict[str, str] = {
    "redis_url": "REDIS_URL",
    "redis_cluster": "GATEWAY_REDIS_CLUSTER",
    "state_backend": "GATEWAY_STATE_BACKEND",
    "fail_open": "GATEWAY_FAIL_OPEN",
    "max_body_bytes": "GATEWAY_MAX_BODY_BYTES",
    "max_tokens_limit": "GATEWAY_MAX_TOKENS_LIMIT",
    "max_json_depth": "GATEWAY_MAX_JSON_DEPTH",
    "default_max_tokens": "GATEWAY_DEFAULT_MAX_TOKENS",
    "context_window": "GATEWAY_CONTEXT_WINDOW",
    "tokenize": "GATEWAY_TOKENIZE",
    "snapshot_poll_s": "GATEWAY_SNAPSHOT_POLL_S",
    "aimd_tick_s": "GATEWAY_AIMD_TICK_S",
    "aimd_window_s": "GATEWAY_AIMD_WINDOW_S",
    "ttft_target_s": "GATEWAY_TTFT_TARGET_S",
    "budget_min_fraction": "GATEWAY_BUDGET_MIN_FRACTION",
    "acquire_timeout_s": "GATEWAY_ACQUIRE_TIMEOUT_S",
    "health_interval_s": "GATEWAY_HEALTH_INTERVAL_S",
    "usage_flush_s": "GATEWAY_USAGE_FLUSH_S",
    "request_log_days": "GATEWAY_REQUEST_LOG_DAYS",
    "saturation_admission": "GATEWAY_SATURATION_ADMISSION",
    "drain_timeout_s": "GATEWAY_DRAIN_TIMEOUT_S",
    "lease_s": "GATEWAY_LEASE_S",
    "lease_renew_s": "GATEWAY_LEASE_RENEW_S",
    "debt_dimension": "GATEWAY_DEBT_DIMENSION",
    "redis_max_connections": "GATEWAY_REDIS_MAX_CONNECTIONS",
    "redis_pool_timeout_s": "GATEWAY_REDIS_POOL_TIMEOUT_S",
}


@dataclass(frozen=True)
class GatewayConfig:
    # The state store's Redis: GATEWAY_REDIS_URL, else REDIS_URL (`from_settings`); a Redis Cluster when
    # `redis_cluster` (GATEWAY_REDIS_CLUSTER; the URL is any of its nodes).
    redis_url: str = ""
    redis_cluster: bool = False
    state_backend: str = "memory"
    fail_open: bool = False
    max_body_bytes: int = 1_048_576
    max_tokens_limit: int = 1_000_000
    # Deepest nesting of arrays/objects accepted in a /v1/* body (deeper is a 400 before admission).
    max_json_depth: int = 32
    default_max_tokens: int = 256
    context_window: int = 4096
    tokenize: bool = True
    snapshot_poll_s: float = 0.5
    aimd_tick_s: float = 5.0
    aimd_window_s: float = 30.0
    ttft_target_s: float = 2.0
    budget_min: int = 1
    # The AIMD floor as a share of the pool's slots (seed 002's cap_per_worker_min=16 of 64).
    budget_min_fraction: float = 0.25
    acquire_timeout_s: float = 1.0
    health_interval_s: float = 2.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    usage_flush_s: float = 2.0
    # Days the request log keeps (apps/gateway/request_log.py); 0: nothing is recorded.
    request_log_days: int = 7
    # Feed the replicas' scraped vLLM saturation into admission check 5 (seed 004's detector).
    saturation_admission: bool = True
    # How long `serve` lets in-flight requests finish on SIGTERM before cancelling the rest.
    drain_timeout_s: float = 30.0
    # The lease of a reservation in the shared store, and how often its holder renews it (< lease_s).
    lease_s: float = 10.0
    lease_renew_s: float = 3.0
    # The baseline the service gap of debt (2) is measured against (the paper: throughput).
    debt_dimension: str = "tokens_per_second"
    # The Redis connections of one gateway process (one blocking pool), and how long a call waits for a
    # free one before it answers 503 state_store_busy (waiting for a connection is not Redis being away).
    redis_max_connections: int = 128
    redis_pool_timeout_s: float = 10.0
    background: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lease_renew_s >= self.lease_s:
            # A lease renewed no sooner than it runs out lapses between renewals.
            raise ImproperlyConfigured(
                f"GATEWAY_LEASE_RENEW_S ({self.lease_renew_s:g}) must be below GATEWAY_LEASE_S ({self.lease_s:g})"
            )

    def admission_config(self) -> AdmissionConfig:
        """The state machine's parameters: a waiter waits the acquire timeout (seed 002)."""
        return AdmissionConfig(wait_timeout_s=self.acquire_timeout_s)

    def dynamics_config(self) -> DynamicsConfig:
        """The EWMA tick's parameters: the dimension the service gap is measured on."""
        return DynamicsConfig(debt_dimension=Dimension(self.debt_dimension))

    @classmethod
    def from_settings(cls, **overrides: Any) -> GatewayConfig:
        """The configuration from `django.conf.settings`, with `overrides` (field names) on top."""
        values: dict[str, Any] = {name: getattr(settings, setting) for name, setting in SETTING_NAMES.items()}
        # The store's own Redis when one is named, else the site's (Celery and the channel layer stay there).
        values["redis_url"] = getattr(settings, "GATEWAY_REDIS_URL", "") or values["redis_url"]
        values.update(overrides)
        return cls(**values)
