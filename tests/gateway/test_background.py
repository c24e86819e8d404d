"""The gateway's store view at scale: a pool of many entitlements is read a slice at a time, those with
requests in flight every time, the others keeping their last reading."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from apps.gateway import background
from apps.gateway.app import Gateway
from apps.gateway.memory_state import MemoryStateStore
from apps.policy import EntitlementLimits


def test_a_large_pool_is_read_a_slice_at_a_time_and_busy_entitlements_every_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "STORE_VIEW_IDLE_READS", 2)
    loops = Gateway(store=MemoryStateStore()).loops
    pool = SimpleNamespace(name="p", entitlements=[
        EntitlementLimits(entitlement_id=f"e{i}", service_class="spot") for i in range(5)])

    def read(busy: set[str]) -> list[str]:
        view = {("p", name): 1.0 for name in busy}
        kept: dict[tuple[str, ...], tuple[float, float, float]] = {}
        chosen = [limits.entitlement_id for limits in loops._entitlements_to_read(pool, view, kept)]
        assert set(chosen) | {key[1] for key in kept} == {f"e{i}" for i in range(5)}  # the rest keep theirs
        loops.store_dynamics = {**kept, **{("p", name): (0.0, 0.0, 1.0) for name in chosen}}
        return chosen

    assert read(set()) == ["e0", "e1", "e2", "e3", "e4"]  # never read: all of them
    assert read(set()) == ["e2", "e3"]
    assert read({"e0"}) == ["e0", "e4"]  # e4 and (wrapping) e0 are the slice; e0 is busy anyway
    assert read({"e3"}) == ["e1", "e2", "e3"]
