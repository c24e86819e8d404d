"""The served/demand window that feeds debt (2) and burst (3): one definition for every store.

Between two EWMA ticks the state machine integrates, per entitlement, what actually ran (slot-seconds,
KV byte-seconds, tokens of completed requests) and what was wanted and not served (requests refused for
lack of capacity or expired while waiting, and time spent waiting). At the tick `window_reading` turns
those integrals into served and demanded rates and steps the EWMAs.

The in-process ledger (`apps.policy.ledger`) accumulates a `ServiceWindow` in Python; the Redis store
keeps the same fields in the entitlement's hash, accumulated by its Lua scripts with the same arithmetic
(`apps/gateway/lua/`), and hands them to the same `window_reading` at its tick. So the live gateway and
the simulator price the next admission from one signal.
"""

from __future__ import annotations

from dataclasses import dataclass

from apps.policy.admission import EntitlementLimits
from apps.policy.classes import ResourceVector
from apps.policy.priority import Dynamics, DynamicsConfig, update_dynamics

# A tick closer than this to the previous one measures nothing (rates over it would be infinite).
MIN_TICK_WINDOW_S = 1e-6


class ServiceWindow:
    """Integrals of one entitlement since the last tick, advanced at every change of what it runs.

    `running`, `kv_running` and `waiting` are the levels being integrated; the transitions set them
    (after calling `accumulate(now)`, so the old level is integrated up to the change)."""

    __slots__ = (
        "last_change",
        "slot_seconds",
        "kv_seconds",
        "waiting_seconds",
        "tokens_served",
        "completed",
        "rejected_count",
        "rejected_tokens",
        "rejected_kv",
    )

    def __init__(self, now: float) -> None:
        self.last_change = now
        self.reset()

    def reset(self) -> None:
        self.slot_seconds = 0.0
        self.kv_seconds = 0.0
        self.waiting_seconds = 0.0
        self.tokens_served = 0.0
        self.completed = 0
        self.rejected_count = 0
        self.rejected_tokens = 0.0
        self.rejected_kv = 0.0

    def is_empty(self) -> bool:
        """Nothing integrated, served or refused since the last reset."""
        return not (self.slot_seconds or self.kv_seconds or self.waiting_seconds or self.tokens_served
                    or self.completed or self.rejected_count or self.rejected_tokens or self.rejected_kv)

    def accumulate(self, now: float, running: int, kv_running: float, waiting: int) -> None:
        elapsed = now - self.last_change
        if elapsed > 0:
            self.slot_seconds += running * elapsed
            self.kv_seconds += kv_running * elapsed
            self.waiting_seconds += waiting * elapsed
            self.last_change = now

    def count_refusal(self, tokens: float, kv: float) -> None:
        """A request turned away for lack of capacity (rejected, or expired while waiting): the demand
        that the next tick adds to what was served."""
        self.rejected_count += 1
        self.rejected_tokens += tokens
        self.rejected_kv += kv

    def count_completion(self, tokens: float) -> None:
        self.tokens_served += tokens
        self.completed += 1

    def figures(self) -> WindowFigures:
        return WindowFigures(
            slot_seconds=self.slot_seconds,
            kv_seconds=self.kv_seconds,
            waiting_seconds=self.waiting_seconds,
            tokens_served=self.tokens_served,
            completed=self.completed,
            rejected_count=self.rejected_count,
            rejected_tokens=self.rejected_tokens,
            rejected_kv=self.rejected_kv,
        )


@dataclass(frozen=True, slots=True)
class WindowFigures:
    """A closed window's integrals (what a store hands to `window_reading`)."""

    slot_seconds: float = 0.0
    kv_seconds: float = 0.0
    waiting_seconds: float = 0.0
    tokens_served: float = 0.0
    completed: int = 0
    rejected_count: int = 0
    rejected_tokens: float = 0.0
    rejected_kv: float = 0.0

    # Written out, as `ResourceVector.__init__` (mypyc compiles it; the generated one stays interpreted).
    def __init__(self, slot_seconds: float = 0.0, kv_seconds: float = 0.0, waiting_seconds: float = 0.0,
                 tokens_served: float = 0.0, completed: int = 0, rejected_count: int = 0,
                 rejected_tokens: float = 0.0, rejected_kv: float = 0.0) -> None:
        object.__setattr__(self, "slot_seconds", slot_seconds)
        object.__setattr__(self, "kv_seconds", kv_seconds)
        object.__setattr__(self, "waiting_seconds", waiting_seconds)
        object.__setattr__(self, "tokens_served", tokens_served)
        object.__setattr__(self, "completed", completed)
        object.__setattr__(self, "rejected_count", rejected_count)
        object.__setattr__(self, "rejected_tokens", rejected_tokens)
        object.__setattr__(self, "rejected_kv", rejected_kv)


@dataclass(frozen=True, slots=True)
class WindowReading:
    """One entitlement at a tick: the new EWMA state and the rates it was computed from."""

    dynamics: Dynamics
    served: ResourceVector
    demand: ResourceVector

    def __init__(self, dynamics: Dynamics, served: ResourceVector, demand: ResourceVector) -> None:
        object.__setattr__(self, "dynamics", dynamics)
        object.__setattr__(self, "served", served)
        object.__setattr__(self, "demand", demand)


# The reading of an entitlement at rest over an empty window: what `window_reading` computes for it.
RESTING_READING = WindowReading(Dynamics(), ResourceVector(), ResourceVector())


def window_reading(
    figures: WindowFigures,
    limits: EntitlementLimits,
    previous: Dynamics,
    elapsed_s: float,
    *,
    expected_service_s: float,
    config: DynamicsConfig | None = None,
) -> WindowReading:
    """Close a window of `elapsed_s` seconds: served and demanded rates, then debt (2) and burst (3).

    Served rates come from what ran; demand adds what was refused or is still waiting, a refused request
    counted as one mean holding time of slots (Little's law; `expected_service_s` before any completion)."""
    hold_s = figures.slot_seconds / figures.completed if figures.completed else expected_service_s
    served = ResourceVector(
        tokens_per_second=figures.tokens_served / elapsed_s,
        kv_bytes=figures.kv_seconds / elapsed_s,
        concurrency=figures.slot_seconds / elapsed_s,
    )
    demand = ResourceVector(
        tokens_per_second=(figures.tokens_served + figures.rejected_tokens) / elapsed_s,
        kv_bytes=(figures.kv_seconds + figures.rejected_kv * hold_s) / elapsed_s,
        concurrency=(figures.slot_seconds + figures.waiting_seconds + figures.rejected_count * hold_s) / elapsed_s,
    )
    baseline = ResourceVector(
        tokens_per_second=limits.tokens_per_second or 0.0,
        kv_bytes=limits.kv_bytes or 0.0,
        concurrency=limits.concurrency or 0,
    )
    dynamics = update_dynamics(previous, limits.service_class, baseline, demand, served, config)
    return WindowReading(dynamics, served, demand)
