from __future__ import annotations

import random

import pytest

from backends.engine.quality import (
    full_cache_reference,
    iso_quality_budget,
    measure_quality,
    perplexity_of,
    score_policy,
    smallest_passing,
    windowed_perplexity,
)


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


def test_windowed_perplexity_is_the_full_cache_and_the_fifo_cache_of_that_size(tiny_model_dir):
    rng = random.Random(1)
    texts = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(4)]
    sinks, window = 4, 12
    # One token a step from the start, so arrival order interleaves the sequences position by position
    # and the global FIFO cut-off takes each sequence's oldest unprotected token in turn.
    prefix = 1
    reference = full_cache_reference(str(tiny_model_dir), texts, prefix)
    full = perplexity_of(texts, reference, prefix)
    assert windowed_perplexity(str(tiny_model_dir), texts, prefix, None, sinks) == pytest.approx(full, rel=1e-5)
    # Then one FIFO budget of (sinks + window) tokens per sequence keeps exactly the sinks and the last
    # `window` tokens of each, the keys the windowed forward lets every token see.
    fifo = score_policy(str(tiny_model_dir), "fifo", len(texts) * (sinks + window), texts, prefix, reference)
    windowed = windowed_perplexity(str(tiny_model_dir), texts, prefix, window, sinks)
    assert fifo.preemptions == 0
    assert windowed == pytest.approx(fifo.perplexity, rel=1e-5)
    assert abs(windowed - full) > 1e-3 * full  # the window does hide something


@pytest.mark.parametrize("threshold", [1, 2, 37, 500, 999, 1000])
def test_the_search_finds_the_threshold_of_a_monotone_predicate_without_touching_the_failing_end(threshold):
    calls: list[int] = []

    def passes(budget: int) -> bool:
        calls.append(budget)
        return budget >= threshold

    found, seen = smallest_passing(0, 1000, passes)
    assert found == threshold
    assert 0 not in calls  # the lower bound is known to fail
    assert len(calls) == len(set(calls)) == len(seen)  # nothing evaluated twice
    assert len(calls) <= 11  # bisection: about log2(1000) evaluations


@pytest.mark.parametrize("threshold", [13, 250, 777, 1000])
def test_a_coarse_resolution_answers_a_passing_budget_within_the_resolution(threshold):
    found, seen = smallest_passing(0, 1000, lambda budget: budget >= threshold, resolution=20)
    assert found is not None
    assert threshold <= found < threshold + 20
    assert seen[found] is True
    assert len(seen) <= 7  # log2(1000 / 20) + the final check


def test_the_search_says_none_when_even_the_upper_end_fails():
    found, seen = smallest_passing(10, 100, lambda budget: False, resolution=5)
    assert found is None
    assert seen[100] is False  # the upper end was tried rather than assumed


def test_a_non_monotone_predicate_still_answers_a_point_that_was_seen_to_pass():
    found, seen = smallest_passing(0, 64, lambda budget: budget in (32, 64))
    assert found == 32 and seen[32]


def test_the_search_refuses_an_empty_interval():
    with pytest.raises(ValueError):
        smallest_passing(10, 10, lambda budget: True)


def test_iso_quality_search_on_a_real_runner_stays_within_the_tolerance(tiny_model_dir):
    rng = random.Random(1)
    texts = [[rng.randrange(3, 1000) for _ in range(48)] for _ in range(4)]
    reference = full_cache_reference(str(tiny_model_dir), texts, prefix=8)
    reference_perplexity = perplexity_of(texts, reference, prefix=8)
    iso = iso_quality_budget(
        str(tiny_model_dir),
        "fifo",
        texts,
        8,
        reference,
        reference_perplexity,
        tolerance=0.01,
        resolution_tokens=4,
    )
    assert iso.result is not None and iso.budget_tokens is not None
    assert 4 * 12 < iso.budget_tokens <= 4 * 48
    assert iso.result.preemptions == 0
    assert iso.result.perplexity <= 1.01 * reference_perplexity
    assert iso.peak_kv_bytes == iso.result.peak_used_tokens * iso.bytes_per_token
    assert iso.result in iso.evaluations
