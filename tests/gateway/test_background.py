"""The gateway's background loops: what they hand the control plane's ticks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from apps.gateway.app import Gateway
from apps.gateway.memory_state import MemoryStateStore
from apps.policy import EntitlementLimits


def test_the_ewma_tick_gets_the_bound_entitlements_of_the_current_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.policy import EntitlementState

    gateway = Gateway(store=MemoryStateStore())
    bound = EntitlementLimits(entitlement_id="b", service_class="spot")
    pending = EntitlementLimits(entitlement_id="p", service_class="spot", state=EntitlementState.PENDING)
    first = SimpleNamespace(pools={"p": SimpleNamespace(entitlements=[bound, pending])})
    monkeypatch.setattr(gateway.snapshots, "current", first)
    assert gateway.loops.bound_limits() == {"p": [bound]}
    assert gateway.loops.bound_limits() is gateway.loops.bound_limits()  # built once per snapshot
    monkeypatch.setattr(gateway.snapshots, "current", SimpleNamespace(pools={"p": SimpleNamespace(entitlements=[])}))
    assert gateway.loops.bound_limits() == {"p": []}  # a new snapshot: read again
