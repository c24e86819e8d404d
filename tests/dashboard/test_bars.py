from __future__ import annotations

from apps.dashboard.bars import UsageBar, format_bytes, format_quantity, usage_bars


def test_bars_come_in_fixed_order_with_missing_dimensions_as_zero() -> None:
    bars = usage_bars(reserved={"slots": 4}, capacity={"slots": 16, "tokens_per_second": 2600})
    assert [b.key for b in bars] == ["slots", "tokens_per_second", "kv_bytes"]
    assert bars[0].percent == 25.0
    assert bars[1].reserved == 0 and bars[1].percent == 0.0
    assert bars[2].capacity == 0 and bars[2].level == "ok"


def test_levels_turn_amber_near_the_top_and_red_when_full_or_overcommitted() -> None:
    assert UsageBar("slots", "Slots", 12, 16, "slots").level == "ok"
    assert UsageBar("slots", "Slots", 13, 16, "slots").level == "high"
    assert UsageBar("slots", "Slots", 16, 16, "slots").level == "full"
    over = UsageBar("slots", "Slots", 20, 16, "slots")
    assert over.level == "full"
    assert over.percent == 100.0
    assert over.raw_percent == 125.0
    assert over.free == 0.0
    assert UsageBar("slots", "Slots", 1, 0, "slots").level == "full"


def test_quantities_are_formatted_for_people() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    assert format_quantity(2600, "tok/s") == "2,600 tok/s"
    assert format_quantity(2.5, "slots") == "2.5 slots"
    assert UsageBar("kv_bytes", "KV cache", 1024**3, 4 * 1024**3, "bytes").capacity_display == "4.00 GiB"
