from __future__ import annotations

import json

from backends.engine.model import LlamaConfig
from backends.engine.tiny_model import TinyModelSpec, generate_tiny_model, main


def test_generation_is_reproducible_and_loadable(tmp_path):
    spec = TinyModelSpec(vocab_size=512, tokenizer_corpus_bytes=200_000, seed=3)
    first = generate_tiny_model(tmp_path / "a", spec)
    second = generate_tiny_model(tmp_path / "b", spec)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    config = LlamaConfig.from_folder(first)
    assert config.vocab_size == 512
    assert config.num_attention_heads % config.num_key_value_heads == 0 and config.num_key_value_heads < 4
    tokenizer_config = json.loads((first / "tokenizer_config.json").read_text())
    assert "chat_template" in tokenizer_config

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(first / "tokenizer.json"))
    text = "def add(a, b):\n    return a + b  # ünïcode\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_command_line_sets_the_shape(tmp_path):
    main(
        [
            "--out",
            str(tmp_path / "m"),
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "2",
            "--num-key-value-heads",
            "1",
            "--num-hidden-layers",
            "1",
            "--intermediate-size",
            "64",
            "--vocab-size",
            "400",
        ]
    )
    config = LlamaConfig.from_folder(tmp_path / "m")
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (32, 2, 1)
    assert config.head_dim == 16 and config.num_hidden_layers == 1
