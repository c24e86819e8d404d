"""A small Llama that must use long context, the tasks that make it, and how well it recalls.

Two long-range tasks, made of token ids between held-out text (seed 001 asks for a workload where the
choice of kept tokens matters; the committed `tiny-stdlib` model looks back only about 64 tokens):

- copy: a span of random tokens, a long text filler, the span again. From the repeat's second token on,
  each token can only be predicted by finding the first copy, past the filler (an induction head's job).
- recall: key-value pairs of random tokens, a long text filler, then keys again in another order, each
  followed by its value: the value can only be predicted by looking the key up among the pairs.

`TaskSequence.scored` lists the indices whose token is an answer; recall accuracy is the share of them a
model predicts (greedy, teacher-forced). Random tokens come from `TASK_TOKENS`, a fixed range of 256 ids, so
that a few minutes of training see each of them often.

    python -m backends.engine.long_context --out backends/engine/assets/tiny-recall --minutes 26

trains one on CPU: text mixed with dense copies (spans repeated a few tokens later), then with both tasks
too, their distance growing to the whole context. It uses the `tiny-stdlib` tokenizer, so the same
held-out files serve as filler.
"""

from __future__ import annotations

import functools
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

TASK_TOKENS = range(300, 556)
TOKENIZER_FROM = Path(__file__).resolve().parent / "assets" / "tiny-stdlib"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BOS = 1
KINDS = ("copy", "recall")


@dataclass(frozen=True)
class TaskSequence:
    kind: str
    ids: list[int]
    scored: list[int]  # indices of the answer tokens (the model predicts ids[i] from ids[:i])
    distance: int  # tokens between the first answer's source and the answer


def task_sequence(rng: random.Random, kind: str, filler: list[int], length: int, *, span: int = 24,
                  pairs: int = 12, lead: int = 0) -> TaskSequence:
    """One sequence of exactly `length` tokens: BOS, `lead` filler tokens, the task's first part, filler,
    the second part. `filler` must hold at least `length` tokens."""
    tokens = list(TASK_TOKENS)
    if kind == "copy":
        first = [rng.choice(tokens) for _ in range(span)]
        second = list(first)
        answers = list(range(1, span))  # the first token of the repeat is not predictable
    elif kind == "recall":
        keys = rng.sample(tokens, pairs)
        values = [rng.choice(tokens) for _ in keys]
        first = [t for pair in zip(keys, values, strict=True) for t in pair]
        order = rng.sample(range(pairs), pairs)
        second = [t for i in order for t in (keys[i], values[i])]
        answers = list(range(1, 2 * pairs, 2))
    else:
        raise ValueError(f"unknown task {kind!r}; one of {', '.join(KINDS)}")
    gap = length - 1 - lead - len(first) - len(second)
    if gap < 0:
        raise ValueError(f"a {kind} sequence needs more than {length} tokens")
    ids = [BOS, *filler[:lead], *first, *filler[lead : lead + gap], *second]
    start = len(ids) - len(second)
    return TaskSequence(kind, ids, [start + a for a in answers], start - (1 + lead))


@functools.lru_cache(maxsize=4)
def _held_out_text(tokenizer_file: str) -> tuple[int, ...]:
    """The held-out standard-library files as one token sequence (read and encoded once per tokenizer)."""
    from tokenizers import Tokenizer

    from backends.engine.train_tiny import corpus_files

    tokenizer = Tokenizer.from_file(tokenizer_file)
    _, held_out = corpus_files()
    text: list[int] = []
    for encoding in tokenizer.encode_batch([p.read_text(encoding="utf-8") for p in held_out],
                                           add_special_tokens=False):
        text.extend(encoding.ids)
    return tuple(text)


def held_out_tasks(model_dir: str | Path, count: int, length: int, seed: int = 7,
                   kinds: tuple[str, ...] = KINDS) -> list[TaskSequence]:
    """`count` sequences of the `kinds` in turn (copy and recall), whose filler is text the model never
    saw (the held-out standard-library files), each at the longest distance `length` allows."""
    text = _held_out_text(str((Path(model_dir) / "tokenizer.json").resolve()))
    rng = random.Random(seed)
    sequences = []
    for index in range(count):
        start = rng.randrange(0, len(text) - length)
        filler = list(text[start : start + length])
        sequences.append(task_sequence(rng, kinds[index % len(kinds)], filler, length))
    return sequences


def windowed_accuracy(model_dir: str | Path, sequences: list[TaskSequence], window: int | None,
                      sinks: int = 4) -> float:
    """Recall accuracy when every token sees only the first `sinks` tokens and its last `window` (None:
    all of them): what a per-sequence FIFO cache of `sinks + window` tokens leaves the model."""
    from backends.engine.model import LlamaModel
    from backends.engine.quality import answer_accuracy

    model = LlamaModel(str(model_dir), num_slots=1)
    rows = []
    for sequence in sequences:
        logits = model.reference_logits(sequence.ids, window=window, sinks=sinks)
        rows.append(torch.log_softmax(logits[:-1].float(), dim=-1))
    return answer_accuracy([s.ids for s in sequences], [s.scored for s in sequences], rows, prefix=1)


@dataclass(frozen=True)
class LongContextSpec:
    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    context: int = 256
    batch_size: int = 16
    learning_rate: float = 2e-3
    warmup_steps: int = 300  # text and dense copies only
    minutes: float = 26.0
    # At least this many steps, however long they take (a test's few steps on a busy machine).
    min_steps: int = 0
    seed: int = 0
    corpus_bytes: int = 40_000_000


def _dense_copies(rng: random.Random, filler: list[int], length: int) -> tuple[list[int], list[int]]:
    """Copy tasks back to back, each repeat a few text tokens after its span: many answers per row. Spans
    and gaps vary in length, so copying from a fixed offset back does not work: the model must find the
    earlier occurrence of the current token (an induction head) to answer."""
    ids: list[int] = [BOS]
    scored: list[int] = []
    cursor = 0
    while True:
        span, gap = rng.randint(6, 40), rng.randint(0, 20)
        if len(ids) + 2 * span + gap > length:
            break
        first = [rng.choice(TASK_TOKENS) for _ in range(span)]
        ids += first + filler[cursor : cursor + gap]
        cursor += gap
        scored += range(len(ids) + 1, len(ids) + span)
        ids += first
    return ids + filler[cursor : cursor + length - len(ids)], scored


def _batch(spec: LongContextSpec, text: torch.Tensor, rng: random.Random, reach: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token windows of `context + 1` and a mask of the answer targets: a fifth of the rows plain text, half
    dense copies (`_dense_copies`), the rest long-range tasks whose answer lies up to `reach` x the context
    back (none while `reach` is 0, the warm-up)."""
    length = spec.context + 1
    rows, masks = [], []
    for _ in range(spec.batch_size):
        start = rng.randrange(0, text.numel() - length)
        filler = text[start : start + length].tolist()
        draw = rng.random()
        scored: list[int] = []
        if draw < 0.2:
            ids = filler
        elif reach <= 0 or draw < 0.7:
            ids, scored = _dense_copies(rng, filler, length)
        else:
            kind = rng.choice(KINDS)
            span, pairs = rng.randint(8, 32), rng.randint(6, 16)
            room = length - 1 - (2 * span if kind == "copy" else 4 * pairs)
            gap = rng.randint(0, max(0, int(room * reach)))
            sequence = task_sequence(rng, kind, filler, length, span=span, pairs=pairs, lead=room - gap)
            ids, scored = sequence.ids, sequence.scored
        mask = [False] * length
        for index in scored:
            mask[index] = True
        rows.append(ids)
        masks.append(mask)
    return torch.tensor(rows), torch.tensor(masks)


def train(out: Path, spec: LongContextSpec, progress: bool = True) -> dict:
    """Train for `spec.minutes`, write the model folder to `out` with `train_report.json` (the loss history
    and the held-out recall accuracy by window), and return the report."""
    from tokenizers import Tokenizer

    from backends.engine.train_tiny import TrainableLlama, TrainSpec, corpus, save_llama_folder

    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_FROM / name, out / name)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    shape = TrainSpec(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                      num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                      num_key_value_heads=spec.num_key_value_heads, context=spec.context, seed=spec.seed,
                      corpus_bytes=spec.corpus_bytes)
    text, _ = corpus(shape, tokenizer)
    model = TrainableLlama(shape, vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.05, betas=(0.9, 0.98))
    started = time.monotonic()
    budget = spec.minutes * 60
    step, history = 0, []
    while step < spec.min_steps or time.monotonic() - started < budget:
        warmup = step < spec.warmup_steps
        elapsed = min(1.0, (time.monotonic() - started) / budget)
        # The task's distance grows over the first half of the budget after the warm-up; the learning rate
        # warms up, then follows a cosine down to a tenth.
        reach = 0.0 if warmup else min(1.0, 0.1 + elapsed * 2)
        scale = min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed)))
        for group in optimizer.param_groups:
            group["lr"] = spec.learning_rate * scale
        window, mask = _batch(spec, text, rng, reach)
        logits = model(window[:, :-1])
        targets, answers = window[:, 1:], mask[:, 1:]
        losses = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), reduction="none")
        losses = losses.view_as(targets)
        text_loss = losses[~answers].mean()
        answer_loss = losses[answers].mean() if bool(answers.any()) else torch.zeros(())
        loss = text_loss + answer_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 50 == 0 or step == 1:
            accuracy = float((logits.argmax(-1)[answers] == targets[answers]).float().mean()) if bool(answers.any()) else 0.0
            entry = {"step": step, "seconds": round(time.monotonic() - started, 1), "text_loss": text_loss.item(),
                     "answer_loss": answer_loss.item(), "answer_accuracy": accuracy, "warmup": warmup}
            history.append(entry)
            if progress:
                print(f"step {step} ({entry['seconds']:.0f}s){' warm-up' if warmup else ''}: text loss "
                      f"{entry['text_loss']:.2f}, answer loss {entry['answer_loss']:.2f}, accuracy {accuracy:.2f}",
                      flush=True)
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    assert bos is not None and eos is not None, "the tiny-stdlib tokenizer has <s> and </s>"
    save_llama_folder(out, model, vocab_size, bos, eos)
    sequences = held_out_tasks(out, 32, spec.context)
    by_window = {str(w): windowed_accuracy(out, sequences, w) for w in (64, 128, 256, None)}
    report = {"spec": asdict(spec), "steps": step, "seconds": round(time.monotonic() - started, 1),
              "train_tokens": int(text.numel()), "held_out_recall_accuracy": by_window, "history": history}
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> None:
    from backends.engine.train_tiny import parse_spec

    out, spec = parse_spec(LongContextSpec(), Path("backends/engine/assets/tiny-recall"), argv, __doc__)
    report = train(out, spec)
    by_window = report["held_out_recall_accuracy"]
    print(f"wrote {out}: {report['steps']} steps; held-out recall accuracy, full cache {by_window['None']:.3f}, "
          + ", ".join(f"sinks + last {w} {by_window[w]:.3f}" for w in ("64", "128", "256")))

if __name__ == "__main__":
    main()
