"""The long-range tasks, their accuracy, and the committed model that must use long context to answer them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from backends.engine.long_context import (
    TASK_TOKENS,
    LongContextSpec,
    held_out_tasks,
    task_sequence,
    train,
    windowed_accuracy,
)
from backends.engine.quality import answer_accuracy

COMMITTED = Path(__file__).resolve().parents[3] / "backends/engine/assets/tiny-recall"
FILLER = list(range(1000, 2000))  # never a task token, so every answer can only come from the task


def test_a_copy_answer_repeats_the_span_past_the_filler() -> None:
    sequence = task_sequence(random.Random(0), "copy", FILLER, 300, span=20, lead=30)
    ids = sequence.ids
    assert len(ids) == 300 and ids[0] == 1
    span = ids[31:51]
    assert all(t in TASK_TOKENS for t in span)
    assert ids[-20:] == span and sequence.scored == list(range(281, 300))
    assert sequence.distance == 300 - 20 - 31  # from the span's start to the repeat's
    assert all(ids[i] == ids[i - sequence.distance] for i in sequence.scored)


def test_a_recall_answer_is_the_value_that_followed_its_key() -> None:
    sequence = task_sequence(random.Random(1), "recall", FILLER, 200, pairs=8)
    ids = sequence.ids
    pairs = dict(zip(ids[1:17:2], ids[2:17:2], strict=True))
    assert len(sequence.scored) == 8 and len(ids) == 200
    for index in sequence.scored:
        assert ids[index] == pairs[ids[index - 1]]
    assert sorted(ids[i - 1] for i in sequence.scored) == sorted(pairs)  # every key asked once


def test_bad_task_requests_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        task_sequence(random.Random(0), "sort", FILLER, 100)
    with pytest.raises(ValueError, match="needs more than 40 tokens"):
        task_sequence(random.Random(0), "copy", FILLER, 40)


def test_accuracy_counts_the_argmax_of_answer_rows_and_missing_rows_as_wrong() -> None:
    texts = [[1, 5, 6, 7], [1, 8, 9, 4]]
    answers = [[2, 3], [3]]
    rows = torch.full((3, 10), -10.0)
    rows[1, 6] = 0.0  # predicts index 2 (token 6) right
    rows[2, 0] = 0.0  # predicts index 3 wrong
    short = torch.full((1, 10), -10.0)  # the second sequence was preempted after one row
    assert answer_accuracy(texts, answers, [rows, short], prefix=1) == pytest.approx(1 / 3)


def test_a_few_steps_of_training_write_a_model_the_engine_loads(tmp_path: Path) -> None:
    spec = LongContextSpec(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                           context=128, batch_size=2, warmup_steps=2, minutes=0.02, corpus_bytes=100_000,
                           min_steps=3)  # 1.2 s of training gave 2 steps on a loaded machine: steps, not time
    report = train(tmp_path, spec, progress=False)
    assert report["steps"] >= 3
    assert report["history"][0]["warmup"] is True
    assert set(report["held_out_recall_accuracy"]) == {"64", "128", "256", "None"}
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "tokenizer.json").exists()


def test_the_committed_model_needs_its_long_context_to_answer() -> None:
    # What benchmark 1's FIFO can save rests on this: the answers need tokens far older than a short window.
    sequences = held_out_tasks(COMMITTED, 8, 256)
    assert min(s.distance for s in sequences) > 200
    full = windowed_accuracy(COMMITTED, sequences, None)
    recent = windowed_accuracy(COMMITTED, sequences, 64)
    assert full >= 0.8, full
    assert recent <= 0.25, recent
