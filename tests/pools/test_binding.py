"""Binding entitlements to pool capacity: three dimensions, every class, re-binding, expiry, history."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.pools.models import (
    GIB,
    RESERVING_CLASSES,
    SERVICE_CLASS_HELP,
    SERVICE_CLASS_WEIGHT,
    Capacity,
    EntitlementStateChange,
    TokenEntitlement,
)
from apps.pools.selectors import pool_reserved, pool_usage
from apps.pools.services import (
    entitlement_delete,
    entitlement_update,
    entitlements_expire,
    pool_update,
    replica_add,
    replica_remove,
    replica_set_enabled,
)
from tests.pools.factories import make_entitlement, make_pool

ALL_CLASSES = ["dedicated", "guaranteed", "elastic", "spot", "preemptible"]
RESERVING = ["dedicated", "guaranteed", "elastic"]
NON_RESERVING = ["spot", "preemptible"]

# One replica holds 16 slots, 240 tokens/s, 20 GiB. For each dimension: a first entitlement that uses
# all of it (and little of the others), and a second that needs just a bit more of that dimension.
DIMENSIONS = {
    "concurrency": (
        {"concurrency": 16, "tokens_per_second": 10, "kv_cache_gib": 1},
        {"concurrency": 1, "tokens_per_second": 1, "kv_cache_gib": Decimal("0.001")},
        "free slots",
    ),
    "tokens_per_second": (
        {"concurrency": 1, "tokens_per_second": 240, "kv_cache_gib": 1},
        {"concurrency": 1, "tokens_per_second": 1, "kv_cache_gib": Decimal("0.001")},
        "tokens/s",
    ),
    "kv_cache": (
        {"concurrency": 1, "tokens_per_second": 10, "kv_cache_gib": 20},
        {"concurrency": 1, "tokens_per_second": 1, "kv_cache_gib": Decimal("0.5")},
        "KV cache",
    ),
}


def test_service_class_weights_follow_table_1() -> None:
    assert SERVICE_CLASS_WEIGHT == {
        "dedicated": 1000.0, "guaranteed": 1000.0, "elastic": 100.0, "spot": 1.0, "preemptible": 0.1
    }


def test_the_models_class_tables_derive_from_the_policy_table() -> None:
    from apps.policy import CLASS_TRAITS, ServiceClass

    # The choices migration 0001 holds: deriving them from the policy changes no schema.
    assert TokenEntitlement._meta.get_field("service_class").choices == [
        ("dedicated", "Dedicated"), ("guaranteed", "Guaranteed"), ("elastic", "Elastic"), ("spot", "Spot"),
        ("preemptible", "Preemptible")]
    assert set(RESERVING_CLASSES) == set(RESERVING)
    assert CLASS_TRAITS[ServiceClass.GUARANTEED].queue_max == 8 and CLASS_TRAITS[ServiceClass.SPOT].queue_max == 0
    assert "guaranteed: weight 1000, reserved baseline, no burst, never shrinks" in SERVICE_CLASS_HELP
    assert "preemptible: weight 0.1, no baseline, may burst, evicted first" in SERVICE_CLASS_HELP


@pytest.mark.django_db
def test_pool_capacity_and_kv_geometry(admin: Any) -> None:
    pool = make_pool(admin, replicas=3)
    replica_set_enabled(actor=admin, replica=pool.replicas.first(), enabled=False)
    cap = pool.capacity()
    assert (cap.slots, cap.tokens_per_second, cap.kv_bytes) == (32, 480, 40 * GIB)
    assert pool.bytes_per_token == 2 * 36 * 8 * 128 * 2
    assert pool.kv_tokens_per_replica == 20 * GIB // pool.bytes_per_token


@pytest.mark.django_db
@pytest.mark.parametrize("dimension", list(DIMENSIONS))
@pytest.mark.parametrize("service_class", ALL_CLASSES)
def test_binding_on_each_dimension_for_each_class(admin: Any, acme: Any, pool: Any, dimension: str,
                                                   service_class: str) -> None:
    filler, extra, reason_word = DIMENSIONS[dimension]
    first = make_entitlement(admin, acme, pool, "first", service_class, **filler)
    assert first.state == "Bound"
    second = make_entitlement(admin, acme, pool, "second", service_class, **extra)
    if service_class in RESERVING:
        assert second.state == "Degraded"
        assert reason_word in second.state_reason
        assert pool_reserved(pool=pool) == first.baseline
    else:
        assert second.state == "Bound"
        assert pool_reserved(pool=pool).slots == 0


@pytest.mark.django_db
@pytest.mark.parametrize("service_class", RESERVING)
def test_exact_fit_binds_and_spot_does_not_take_room(admin: Any, acme: Any, pool: Any, service_class: str) -> None:
    make_entitlement(admin, acme, pool, "spot-big", "spot", concurrency=16, tokens_per_second=240, kv_cache_gib=20)
    ent = make_entitlement(admin, acme, pool, "full", service_class, concurrency=16, tokens_per_second=240,
                           kv_cache_gib=20)
    assert ent.state == "Bound"
    usage = pool_usage(user=admin, pool=pool)
    assert usage.free.slots == 0 and usage.free.tokens_per_second == 0 and usage.free.kv_bytes == 0
    assert usage.entitlements_by_state["Bound"] == 2


@pytest.mark.django_db
def test_shrunk_pool_degrades_newest_first_and_grown_pool_binds_back(admin: Any, acme: Any) -> None:
    pool = make_pool(admin, replicas=2)  # 32 slots
    names = ["old", "mid", "new"]
    for name in names:
        assert make_entitlement(admin, acme, pool, name, "guaranteed", concurrency=10).state == "Bound"
    spot = make_entitlement(admin, acme, pool, "spotty", "spot", concurrency=10)
    replica_set_enabled(actor=admin, replica=pool.replicas.last(), enabled=False)  # 16 slots
    states = dict(TokenEntitlement.objects.values_list("name", "state"))
    assert states == {"old": "Bound", "mid": "Degraded", "new": "Degraded", "spotty": "Bound"}
    replica_add(actor=admin, pool=pool, url="http://127.0.0.1:9999")  # 32 slots again
    states = dict(TokenEntitlement.objects.values_list("name", "state"))
    assert states == {"old": "Bound", "mid": "Bound", "new": "Bound", "spotty": "Bound"}
    history = list(EntitlementStateChange.objects.filter(entitlement__name="mid").values_list("from_state", "to_state"))
    assert history == [("", "Pending"), ("Pending", "Bound"), ("Bound", "Degraded"), ("Degraded", "Bound")]
    assert spot.state_changes.count() == 2  # created and bound, untouched since
    degraded = EntitlementStateChange.objects.get(entitlement__name="new", to_state="Degraded")
    assert "disabled" in degraded.reason and degraded.at is not None


@pytest.mark.django_db
def test_elastic_entitlements_stay_bound_through_a_capacity_drop_and_share_it(admin: Any, acme: Any) -> None:
    """Seed 000, Experiment 2: when a replica fails, bound elastic baselines are oversubscribed, not degraded."""
    pool = make_pool(admin, replicas=2)  # 32 slots
    copilot = make_entitlement(admin, acme, pool, "copilot", "elastic", concurrency=12)
    synth = make_entitlement(admin, acme, pool, "synth", "elastic", concurrency=12)
    replica_set_enabled(actor=admin, replica=pool.replicas.last(), enabled=False)  # 16 slots
    copilot.refresh_from_db()
    synth.refresh_from_db()
    assert (copilot.state, synth.state) == ("Bound", "Bound")
    assert "oversubscribed" in synth.state_reason and "shrank" in synth.state_reason
    # Oversubscription is not a reservation: a newer guaranteed baseline still binds in the room left (4).
    late = make_entitlement(admin, acme, pool, "late", "guaranteed", concurrency=4)
    assert late.state == "Bound"
    # An elastic entitlement that was not bound before the drop is not bound into an oversubscribed pool.
    newcomer = make_entitlement(admin, acme, pool, "newcomer", "elastic", concurrency=4)
    assert newcomer.state == "Degraded"
    replica_set_enabled(actor=admin, replica=pool.replicas.last(), enabled=True)  # 32 slots: all fit again
    states = dict(TokenEntitlement.objects.values_list("name", "state"))
    assert states == {"copilot": "Bound", "synth": "Bound", "late": "Bound", "newcomer": "Bound"}
    synth.refresh_from_db()
    assert "fits pool" in synth.state_reason
    assert list(synth.state_changes.values_list("to_state", flat=True)) == ["Pending", "Bound"]


@pytest.mark.django_db
def test_capacity_edit_rebinds_and_removing_last_replica_degrades_all_reservations(admin: Any, acme: Any,
                                                                                     pool: Any) -> None:
    a = make_entitlement(admin, acme, pool, "a", "elastic", tokens_per_second=100)
    b = make_entitlement(admin, acme, pool, "b", "dedicated", tokens_per_second=100)
    pool_update(actor=admin, pool=pool, tokens_per_second_per_replica=150)
    a.refresh_from_db()
    b.refresh_from_db()
    assert (a.state, b.state) == ("Bound", "Degraded")
    replica_remove(actor=admin, replica=pool.replicas.get())
    a.refresh_from_db()
    assert a.state == "Degraded"
    assert "0 free" in a.state_reason


@pytest.mark.django_db
def test_deleting_an_entitlement_frees_room_for_a_degraded_one(admin: Any, acme: Any, pool: Any) -> None:
    first = make_entitlement(admin, acme, pool, "first", concurrency=12)
    second = make_entitlement(admin, acme, pool, "second", concurrency=12)
    assert second.state == "Degraded"
    entitlement_delete(actor=admin, entitlement=first)
    second.refresh_from_db()
    assert second.state == "Bound"


@pytest.mark.django_db
def test_expiry_at_creation_by_tick_and_revival(admin: Any, acme: Any, pool: Any) -> None:
    now = timezone.now()
    past = make_entitlement(admin, acme, pool, "past", expires_at=now - timedelta(seconds=1))
    assert past.state == "Expired"
    soon = make_entitlement(admin, acme, pool, "soon", concurrency=16, expires_at=now + timedelta(hours=1))
    waiting = make_entitlement(admin, acme, pool, "waiting", concurrency=8)
    assert (soon.state, waiting.state) == ("Bound", "Degraded")
    assert entitlements_expire(now=now + timedelta(minutes=30)) == 0
    assert entitlements_expire(now=now + timedelta(hours=2)) == 1
    soon.refresh_from_db()
    waiting.refresh_from_db()
    assert soon.state == "Expired" and "expired at" in soon.state_reason
    assert waiting.state == "Bound"
    assert entitlements_expire(now=now + timedelta(hours=3)) == 0  # idempotent
    revived = entitlement_update(actor=admin, entitlement=past, expires_at=now + timedelta(days=1))
    assert revived.state == "Bound"


@pytest.mark.django_db
def test_moving_an_entitlement_to_another_pool_rebinds_both(admin: Any, acme: Any, pool: Any) -> None:
    other = make_pool(admin, name="other")
    a = make_entitlement(admin, acme, pool, "a", concurrency=16)
    b = make_entitlement(admin, acme, pool, "b", concurrency=16)
    assert b.state == "Degraded"
    entitlement_update(actor=admin, entitlement=a, pool=other)
    a.refresh_from_db()
    b.refresh_from_db()
    assert (a.state, a.pool_id, b.state) == ("Bound", other.pk, "Bound")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"service_class": "platinum"}, "service_class"),
        ({"concurrency": 0}, "concurrency"),
        ({"tokens_per_second": -5}, "tokens_per_second"),
        ({"kv_cache_gib": Decimal("0")}, "kv_cache_gib"),
        ({"slo_target_ms": 0}, "slo_target_ms"),
        ({"name": "Bad Name!"}, "name"),
    ],
)
def test_bad_entitlement_input_writes_nothing(admin: Any, acme: Any, pool: Any, overrides: dict, field: str) -> None:
    fields = {"name": "ok", "service_class": "guaranteed", **overrides}
    with pytest.raises(ValidationError) as err:
        make_entitlement(admin, acme, pool, fields.pop("name"), fields.pop("service_class"), **fields)
    assert field in err.value.message_dict
    assert TokenEntitlement.objects.count() == 0
    assert EntitlementStateChange.objects.count() == 0


@pytest.mark.django_db
def test_duplicate_entitlement_name_is_rejected(admin: Any, acme: Any, pool: Any) -> None:
    make_entitlement(admin, acme, pool, "dup")
    with pytest.raises(ValidationError) as err:
        make_entitlement(admin, acme, pool, "dup")
    assert "name" in err.value.message_dict
    assert TokenEntitlement.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"slots_per_replica": 0}, "slots_per_replica"),
        ({"tokens_per_second_per_replica": -1}, "tokens_per_second_per_replica"),
        ({"kv_cache_gib_per_replica": Decimal("-2")}, "kv_cache_gib_per_replica"),
        ({"kv_layers": 0}, "kv_layers"),
        ({"backend_kind": "tpu"}, "backend_kind"),
        ({"min_replicas": 5, "max_replicas": 2}, "min_replicas"),
        ({"replicas": [{"url": "not a url"}]}, "replicas"),
        ({"replicas": [{"url": f"http://h:{8000 + i}"} for i in range(11)]}, "replicas"),
        ({"replicas": [{"url": "http://a:1"}, {"url": "http://a:1"}]}, "replicas"),
    ],
)
def test_bad_pool_input_writes_nothing(admin: Any, overrides: dict, field: str) -> None:
    from apps.pools.models import Replica, TokenPool

    with pytest.raises(ValidationError) as err:
        make_pool(admin, **overrides)
    assert field in err.value.message_dict
    assert TokenPool.objects.count() == 0 and Replica.objects.count() == 0


@pytest.mark.django_db
def test_failed_pool_update_leaves_pool_and_states_unchanged(admin: Any, acme: Any, pool: Any) -> None:
    ent = make_entitlement(admin, acme, pool, "a", concurrency=16)
    with pytest.raises(ValidationError):
        pool_update(actor=admin, pool=pool, slots_per_replica=0)
    pool.refresh_from_db()
    ent.refresh_from_db()
    assert pool.slots_per_replica == 16 and ent.state == "Bound"


@pytest.mark.django_db
def test_only_superusers_manage_pools_and_only_owners_entitlements(admin: Any, acme: Any, owner: Any,
                                                                   member: Any, outsider: Any, pool: Any) -> None:
    for user in (owner, member, outsider):
        with pytest.raises(PermissionDenied):
            pool_update(actor=user, pool=pool, slots_per_replica=1)
    for user in (member, outsider):
        with pytest.raises(PermissionDenied):
            make_entitlement(user, acme, pool, f"by-{user.username}")
    assert make_entitlement(owner, acme, pool, "by-owner").state == "Bound"


@pytest.mark.django_db
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(ALL_CLASSES), st.integers(1, 12), st.integers(1, 200), st.integers(1, 15)),
        min_size=1,
        max_size=8,
    ),
    enabled_replicas=st.integers(0, 2),
)
def test_bound_reservations_never_exceed_capacity(admin: Any, acme: Any, specs: list, enabled_replicas: int) -> None:
    TokenEntitlement.objects.all().delete()
    from apps.pools.models import TokenPool

    TokenPool.objects.all().delete()
    pool = make_pool(admin, replicas=2)
    for i, (cls, conc, tps, kv) in enumerate(specs):
        make_entitlement(admin, acme, pool, f"e{i}", cls, concurrency=conc, tokens_per_second=tps, kv_cache_gib=kv)
    bound_before_the_drop = set(TokenEntitlement.objects.filter(state="Bound").values_list("name", flat=True))
    for replica in list(pool.replicas.all())[enabled_replicas:]:
        replica_set_enabled(actor=admin, replica=replica, enabled=False)
    cap = pool.capacity()
    # Reference model of the documented rule: oldest first, bound iff the baseline fits the room left; an
    # elastic entitlement bound before the pool shrank stays bound, oversubscribed, while any capacity is left.
    room, reserved = cap, Capacity.zero()
    for ent in TokenEntitlement.objects.order_by("created_at", "id"):
        if ent.service_class in NON_RESERVING:
            assert ent.state == "Bound"
        elif ent.baseline.fits_in(room):
            room = room - ent.baseline
            reserved = reserved + ent.baseline
            assert ent.state == "Bound"
        elif ent.service_class == "elastic" and ent.name in bound_before_the_drop and cap.slots > 0:
            assert ent.state == "Bound" and "oversubscribed" in ent.state_reason
        else:
            assert ent.state == "Degraded"
    assert reserved.fits_in(cap)  # what is reserved, rather than oversubscribed, never exceeds capacity
