"""Pool saturation, GAIE's utilization detector as seed 004 describes it ("Saturation Formula").

saturation = mean over instances of max(queue_depth / qd_threshold, kv_utilization / kv_threshold)
No instances, or an instance whose metrics are older than `staleness_s`, count as saturated (1.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from apps.policy.errors import PolicyConfigError, require_finite, require_positive

DEFAULT_QD_THRESHOLD = 5.0
DEFAULT_KV_THRESHOLD = 0.8
DEFAULT_STALENESS_S = 0.2


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """One backend's last scraped metrics (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...).

    `updated_at` is on the caller's clock (seconds); None means the caller does not track freshness.
    `batch_size` (running requests) feeds tier-shed's effective load `queue_depth + batch_size`.
    """

    queue_depth: float
    kv_utilization: float
    updated_at: float | None = None
    batch_size: float = 0.0

    @property
    def effective_load(self) -> float:
        return self.queue_depth + self.batch_size


def validate_thresholds(qd_threshold: float, kv_threshold: float) -> tuple[float, float]:
    qd = require_positive("qd_threshold", qd_threshold)
    kv = require_finite("kv_threshold", kv_threshold)
    if not 0.0 < kv <= 1.0:
        raise PolicyConfigError(f"kv_threshold must be in (0, 1], got {kv_threshold!r}")
    return qd, kv


def instance_saturation(
    snapshot: InstanceSnapshot,
    qd_threshold: float,
    kv_threshold: float,
    now: float | None = None,
    staleness_s: float = DEFAULT_STALENESS_S,
) -> float:
    if now is not None and snapshot.updated_at is not None and now - snapshot.updated_at > staleness_s:
        return 1.0
    return max(snapshot.queue_depth / qd_threshold, snapshot.kv_utilization / kv_threshold)


def pool_saturation(
    snapshots: Sequence[InstanceSnapshot],
    qd_threshold: float = DEFAULT_QD_THRESHOLD,
    kv_threshold: float = DEFAULT_KV_THRESHOLD,
    now: float | None = None,
    staleness_s: float = DEFAULT_STALENESS_S,
) -> float:
    qd, kv = validate_thresholds(qd_threshold, kv_threshold)
    if not snapshots:
        return 1.0
    total = 0.0
    for snapshot in snapshots:
        total += instance_saturation(snapshot, qd, kv, now, staleness_s)
    return total / len(snapshots)
