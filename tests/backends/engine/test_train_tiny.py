from __future__ import annotations

import json

import torch

from backends.engine.model import LlamaModel
from backends.engine.tiny_model import TinyModelSpec, llama_config
from backends.engine.train_tiny import TrainableLlama, TrainSpec


def test_a_trained_checkpoint_loads_into_the_engine_with_the_same_logits(tmp_path):
    from safetensors.torch import save_file

    spec = TrainSpec(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    trainable = TrainableLlama(spec, vocab_size=300)
    with torch.no_grad():  # move the weights off their tiny init so the comparison is not trivially flat
        for parameter in trainable.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    model_spec = TinyModelSpec(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    (tmp_path / "config.json").write_text(json.dumps(llama_config(model_spec, 300, 1, 2)))
    save_file(trainable.hf_state_dict(torch.float32), str(tmp_path / "model.safetensors"))

    ids = [5, 17, 200, 3, 99, 42, 7]
    expected = trainable(torch.tensor([ids]))[0].detach()
    engine_model = LlamaModel(tmp_path, num_slots=16, device="cpu")
    torch.testing.assert_close(engine_model.reference_logits(ids), expected, atol=1e-4, rtol=1e-4)
