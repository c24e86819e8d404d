"""The live site a scenario asks for (`apps.simulator.live`): its entitlements are the simulator's, their own
queue included, so that the sim-to-live agreement test compares one machine under two clocks."""

from __future__ import annotations

import pytest

from apps.pools.manifests import manifests_apply
from apps.pools.models import TokenEntitlement
from apps.simulator.admission import entitlement_limits
from apps.simulator.live import live_entitlement, scenario_manifest
from apps.simulator.scenario import load_scenario
from apps.tenancy.services import SYSTEM, tenant_create
from tests.support.site import REPO

QUEUE_SCENARIO = REPO / "apps/simulator/scenarios/seed000_queue_agreement.yaml"


@pytest.mark.django_db
def test_the_live_entitlements_get_the_scenarios_queue_or_the_class_default() -> None:
    tenants = load_scenario(QUEUE_SCENARIO).config.tenants
    tenant_create(actor=SYSTEM, name="Exp", slug="exp")
    manifest = scenario_manifest(tenants, pool="experiment", owner="exp", backend_urls=["http://127.0.0.1:9"],
                                 slots_per_replica=16)
    manifests_apply(actor=SYSTEM, documents=manifest)
    for tenant in tenants:
        stored = TokenEntitlement.objects.get(name=tenant.name)
        simulated = entitlement_limits(tenant)
        assert (stored.queue_max, stored.queue_max_wait_ms) == (tenant.entitlement.get("queue_max"),
                                                                tenant.entitlement.get("queue_max_wait_ms"))
        assert stored.concurrency == simulated.concurrency
    queued = next(t for t in tenants if t.name == "guaranteed-q")
    assert entitlement_limits(queued).own_queue_max == 8
    # The REST body of a tenant that joins later carries the same queue.
    body = live_entitlement(queued, pool="experiment", owner="exp")
    assert (body["queue_max"], body["queue_max_wait_ms"]) == (8, 8000)
    spot = next(t for t in tenants if t.name == "spot-b")
    assert "queue_max" not in live_entitlement(spot, pool="experiment", owner="exp")
