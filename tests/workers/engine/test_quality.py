from __future__ import annotations

import random

import pytest

from workers.engine.quality import measure_quality


def test_quality_is_exact_with_room_and_degrades_under_a_tight_budget(tiny_model_dir):
    rng = random.Random(0)
    texts = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(4)]
    roomy, tight = 4 * 40 + 8, 64
    results = measure_quality(
        str(tiny_model_dir), ["token-pd", "h2o", "fifo"], [roomy, tight], texts, prefix=12
    )
    by_key = {(r.policy, r.budget_tokens): r for r in results}
    reference = by_key[("token-pd", roomy)].perplexity
    for policy in ("token-pd", "h2o", "fifo"):
        full = by_key[(policy, roomy)]
        assert full.mean_kl_from_full == pytest.approx(0.0, abs=1e-6)
        assert full.top1_agreement == 1.0
        assert full.perplexity == pytest.approx(reference, rel=1e-6)
        squeezed = by_key[(policy, tight)]
        assert squeezed.peak_used_tokens <= tight
        assert squeezed.mean_kl_from_full > 1e-4  # evicting 60% of the context changes the predictions
