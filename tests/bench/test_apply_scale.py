"""The apply-at-scale benchmark's code path at a tiny size: every timing measured, the Degraded variant binds
what fits, the growth exponents computed (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.pools.models import TokenEntitlement
from bench.apply_scale import Row, exponents, measure, render


@pytest.mark.django_db
def test_the_bench_measures_every_step_of_a_small_manifest(tmp_path: Path) -> None:
    row = measure(50, tmp_path, degraded=0.1, requests=3)
    assert (row.entitlements, row.degraded) == (50, 5)
    assert all(value > 0 for value in (row.apply_s, row.reapply_unchanged_s, row.diff_unchanged_s,
                                       row.diff_changed_s, row.reapply_changed_s, row.apply_cpu, row.list_p99_ms,
                                       row.snapshot_s, row.ui_list_p99_ms))
    # The 1%-changed manifest was applied: one entitlement in a hundred (here the first) asks for 11 tokens/s.
    assert list(TokenEntitlement.objects.filter(tokens_per_second=11).values_list("name", flat=True)) == ["ent-00000"]
    assert TokenEntitlement.objects.filter(state="Degraded").count() == 5


def test_growth_exponents_are_one_for_linear_timings() -> None:
    a = Row(100, 0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.9, 0.4, 0.4, 0.4, 0.4, 1.0, 2.0, 0.1)
    b = Row(200, 0, 2.0, 1.0, 1.0, 1.0, 1.0, 3.6, 0.8, 0.8, 0.8, 0.8, 1.0, 2.0, 0.4)
    (growth,) = exponents([a, b])
    assert growth["apply_s"] == 1.0 and growth["snapshot_s"] == 2.0 and growth["apply_cpu"] == 2.0
    assert "100->200" in render([a, b])
