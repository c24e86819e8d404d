"""The long-context benchmark's report: the targets are computed from the runs, met or NOT met."""

from __future__ import annotations

import argparse

from backends.engine.long_context import TaskSequence
from backends.engine.quality import IsoQualityResult, QualityResult
from bench.engine import iso_ratios
from bench.engine_recall import render


def iso(policy: str, budget: int | None, peak: int) -> IsoQualityResult:
    result = None if budget is None else QualityResult(policy, budget, 3.0, 0.01, 0.99, peak, 0, recall_accuracy=0.95)
    return IsoQualityResult(policy, budget, result, () if result is None else (result,), bytes_per_token=100)


def test_the_report_compares_token_pd_with_fifo_and_h2o_and_says_which_target_is_missed() -> None:
    found = [iso("fifo", 1000, 1000), iso("h2o", 700, 700), iso("token-pd", 600, 600), iso("lru", None, 0)]
    assert iso_ratios(found)["fifo"]["peak_bytes"] == 0.6
    assert iso_ratios(found[:1] + found[2:])["h2o"]["peak_bytes"] is None  # H2O never ran: no ratio
    args = argparse.Namespace(model="m", length=512, prefix=16, accuracy_tolerance=0.01, tolerance=0.01,
                              resolution=0.02)
    figures = {"sequences": [TaskSequence("copy", [1] * 512, [500], 450), TaskSequence("recall", [1] * 512, [501], 460)],
               "need": 1024, "reference_accuracy": 0.96, "reference_perplexity": 3.0,
               "windows": [(64, 0.01, 3.2), (None, 0.96, 3.0)], "found": found}
    text = render(args, "python -m bench.engine_recall", figures)
    assert "| Token-PD <= 0.5x FIFO | 0.60 | NOT met |" in text
    assert "| Token-PD <= 0.8x H2O | 0.86 | NOT met |" in text
    assert "| lru | none passed |" in text
    assert "answers 450-460 tokens after their source" in text
    found[2] = iso("token-pd", 300, 300)
    text = render(args, "python -m bench.engine_recall", {**figures, "found": found})
    assert "| Token-PD <= 0.5x FIFO | 0.30 | met |" in text and "| Token-PD <= 0.8x H2O | 0.43 | met |" in text
