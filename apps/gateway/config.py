"""Gateway settings: Django settings when set there, else the environment, else an embedded default."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from apps.policy import AdmissionConfig


def _setting(name: str, default: Any) -> Any:
    try:
        from django.conf import settings

        if settings.configured and hasattr(settings, name):
            return getattr(settings, name)
    except ImportError:  # pragma: no cover - Django is always installed here
        pass
    raw = os.environ.get(name)
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    return type(default)(raw)


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str = ""
    state_backend: str = "memory"
    fail_open: bool = False
    max_body_bytes: int = 1_048_576
    max_tokens_limit: int = 1_000_000
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
    queue_max_default: int = 8
    health_interval_s: float = 2.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    usage_flush_s: float = 2.0
    # Feed the replicas' scraped vLLM saturation into admission check 5 (seed 004's detector).
    saturation_admission: bool = True
    background: bool = True
    # How long `serve` lets in-flight requests finish on SIGTERM before cancelling them.
    drain_timeout_s: float = 30.0
    # A reservation's lease in the shared store, and how often its process renews it: a process that
    # dies stops renewing, and its reservations are released one lease later.
    lease_s: float = 10.0
    lease_renew_s: float = 3.0
    extra: dict[str, Any] = field(default_factory=dict)

    def admission_config(self) -> AdmissionConfig:
        """The state machine's parameters: a waiter waits the acquire timeout (seed 002)."""
        return AdmissionConfig(wait_timeout_s=self.acquire_timeout_s)

    @classmethod
    def from_settings(cls, **overrides: Any) -> GatewayConfig:
        redis_url = _setting("REDIS_URL", "")
        values: dict[str, Any] = {
            "redis_url": redis_url,
            "state_backend": _setting("GATEWAY_STATE_BACKEND", "redis" if redis_url else "memory"),
            "fail_open": _setting("GATEWAY_FAIL_OPEN", False),
            "max_body_bytes": _setting("GATEWAY_MAX_BODY_BYTES", cls.max_body_bytes),
            "max_tokens_limit": _setting("GATEWAY_MAX_TOKENS_LIMIT", cls.max_tokens_limit),
            "default_max_tokens": _setting("GATEWAY_DEFAULT_MAX_TOKENS", cls.default_max_tokens),
            "context_window": _setting("GATEWAY_CONTEXT_WINDOW", cls.context_window),
            "tokenize": _setting("GATEWAY_TOKENIZE", cls.tokenize),
            "snapshot_poll_s": _setting("GATEWAY_SNAPSHOT_POLL_S", cls.snapshot_poll_s),
            "aimd_tick_s": _setting("GATEWAY_AIMD_TICK_S", cls.aimd_tick_s),
            "aimd_window_s": _setting("GATEWAY_AIMD_WINDOW_S", cls.aimd_window_s),
            "ttft_target_s": _setting("GATEWAY_TTFT_TARGET_S", cls.ttft_target_s),
            "budget_min_fraction": _setting("GATEWAY_BUDGET_MIN_FRACTION", cls.budget_min_fraction),
            "acquire_timeout_s": _setting("GATEWAY_ACQUIRE_TIMEOUT_S", cls.acquire_timeout_s),
            "queue_max_default": _setting("GATEWAY_QUEUE_MAX", cls.queue_max_default),
            "health_interval_s": _setting("GATEWAY_HEALTH_INTERVAL_S", cls.health_interval_s),
            "usage_flush_s": _setting("GATEWAY_USAGE_FLUSH_S", cls.usage_flush_s),
            "saturation_admission": _setting("GATEWAY_SATURATION_ADMISSION", cls.saturation_admission),
            "drain_timeout_s": _setting("GATEWAY_DRAIN_TIMEOUT_S", cls.drain_timeout_s),
            "lease_s": _setting("GATEWAY_LEASE_S", cls.lease_s),
            "lease_renew_s": _setting("GATEWAY_LEASE_RENEW_S", cls.lease_renew_s),
        }
        values.update(overrides)
        return cls(**values)
