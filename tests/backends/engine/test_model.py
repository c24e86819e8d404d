from __future__ import annotations

import random

import torch

from backends.engine.model import LlamaModel, SequenceCache


def random_prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def greedy(model: LlamaModel, prompts: list[list[int]], steps: int) -> list[list[int]]:
    sequences = [SequenceCache(row=i) for i in range(len(prompts))]
    output = model.forward(sequences, prompts)
    generated = [[int(t)] for t in output.logits.argmax(-1)]
    for _ in range(steps - 1):
        output = model.forward(sequences, [[g[-1]] for g in generated])
        for g, token in zip(generated, output.logits.argmax(-1), strict=True):
            g.append(int(token))
    for seq in sequences:
        model.release(seq)
    return generated


def test_pool_forward_matches_a_plain_causal_forward(tiny_model_dir):
    model = LlamaModel(tiny_model_dir, num_slots=64, device="cpu")
    prompt = random_prompt(1, 10, model.config.vocab_size)
    seq = SequenceCache(row=0)
    prefill = model.forward([seq], [prompt[:7]])
    step = model.forward([seq], [prompt[7:]])  # a multi-token chunk on top of a cache
    reference = model.reference_logits(prompt)
    torch.testing.assert_close(prefill.logits[0], reference[6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step.logits[0], reference[9], atol=1e-4, rtol=1e-4)
    # Attention mass is a distribution over the cached tokens, averaged over queries.
    assert step.attention[0].shape == (10,)
    assert abs(float(step.attention[0].sum()) - 1.0) < 1e-4


def test_a_step_mixing_prompt_chunks_and_decode_tokens_matches_each_sequence_alone(tiny_model_dir):
    """Decode rows and prompt chunks attend in separate padded groups; the step must not mix them up."""
    model = LlamaModel(tiny_model_dir, num_slots=128, device="cpu")
    texts = [random_prompt(20 + i, 14, model.config.vocab_size) for i in range(4)]
    sequences = [SequenceCache(row=i) for i in range(4)]
    model.forward(sequences[:2], [texts[0][:9], texts[1][:5]])  # two sequences already have a cache
    new_tokens = [texts[0][9:10], texts[1][5:11], texts[2][:1], texts[3][:7]]  # decode, chunk, 1-token, prompt
    output = model.forward(sequences, new_tokens)
    ends = [10, 11, 1, 7]
    for b, (text, end) in enumerate(zip(texts, ends, strict=True)):
        reference = model.reference_logits(text[:end])
        torch.testing.assert_close(output.logits[b], reference[end - 1], atol=1e-4, rtol=1e-4)
        assert abs(float(output.attention[b].sum()) - 1.0) < 1e-4
    assert sorted(output.new_slots.tolist()) == sorted(set(output.new_slots.tolist()))
    assert output.new_slots.numel() == sum(len(tokens) for tokens in new_tokens)


def test_batched_greedy_of_four_sequences_equals_decoding_each_alone(tiny_model_dir):
    model = LlamaModel(tiny_model_dir, num_slots=512, device="cpu")
    prompts = [
        random_prompt(10 + i, length, model.config.vocab_size) for i, length in enumerate((3, 17, 9, 30))
    ]
    batched = greedy(model, prompts, steps=16)
    alone = [greedy(model, [prompt], steps=16)[0] for prompt in prompts]
    assert batched == alone
    assert model.pool.num_free == 512
    # The outputs depend on the prompt, so the comparison is not trivially equal.
    assert len({tuple(g) for g in batched}) == 4


def test_rope_positions_survive_eviction(tiny_model_dir):
    model = LlamaModel(tiny_model_dir, num_slots=128, device="cpu")
    prompt = random_prompt(3, 24, model.config.vocab_size)
    evicted = list(range(6, 14))
    seq = SequenceCache(row=0)
    logits = [model.forward([seq], [prompt]).logits[0]]
    keep = torch.ones(seq.cached, dtype=torch.bool)
    keep[evicted] = False
    assert model.evict(seq, keep) == len(evicted)
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(int(logits[-1].argmax()))
        logits.append(model.forward([seq], [[tokens[-1]]]).logits[0])
    assert seq.seen == len(tokens) and seq.cached == len(tokens) - len(evicted)

    hidden = torch.zeros(len(tokens), dtype=torch.bool)
    hidden[evicted] = True
    reference = model.reference_logits(tokens, hidden_mask=hidden, hide_from_query=len(prompt))
    for step, got in enumerate(logits):
        torch.testing.assert_close(got, reference[len(prompt) - 1 + step], atol=1e-4, rtol=1e-4)

    # The check is sensitive: keeping the evicted tokens, or numbering positions by cache length, differs.
    full = model.reference_logits(tokens)
    assert (full[-1] - logits[-1]).abs().max() > 1e-3
    shifted = torch.arange(len(tokens))
    shifted[len(prompt) :] -= len(evicted)
    wrong_positions = model.reference_logits(tokens, hidden, len(prompt), positions=shifted)
    assert (wrong_positions[-1] - logits[-1]).abs().max() > 1e-3


def test_a_reference_window_hides_exactly_the_keys_outside_it_but_the_sinks(tiny_model_dir):
    model = LlamaModel(tiny_model_dir, num_slots=8, device="cpu")
    tokens = random_prompt(3, 30, model.config.vocab_size)
    window, sinks = 4, 2
    base = model.reference_logits(tokens, window=window, sinks=sinks)[-1]

    def changed(at: int) -> list[int]:
        other = list(tokens)
        other[at] = 3 if tokens[at] != 3 else 4
        return other

    # Token 10 is outside the last token's window (positions 26..29) and not a sink. Every layer is
    # windowed, so each layer lets information travel at most 3 positions further: it would take 7 layers
    # for token 10 to reach the last token through the windows of the tokens between.
    assert model.config.num_hidden_layers < 7
    torch.testing.assert_close(model.reference_logits(changed(10), window=window, sinks=sinks)[-1], base)
    assert (model.reference_logits(changed(10))[-1] - model.reference_logits(tokens)[-1]).abs().max() > 1e-4
    for seen in (1, 25):  # a sink, and a token inside the window
        assert (model.reference_logits(changed(seen), window=window, sinks=sinks)[-1] - base).abs().max() > 1e-4
