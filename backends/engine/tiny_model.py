"""Generate a small random-weight Llama model folder for tests and smoke runs.

The folder has the same layout a Hugging Face Llama checkpoint has (`config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`), so both our engine and vLLM
can load it. The tokenizer is a byte-level BPE trained here on the Python standard library sources,
which every machine with Python has, so nothing is downloaded.

    python -m backends.engine.tiny_model --out var/models/tiny
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

# A minimal chat template in Jinja, so that /v1/chat/completions (ours and vLLM's) can render messages.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 0
    tokenizer_corpus_bytes: int = 2_000_000


def stdlib_text(limit_bytes: int) -> Iterator[str]:
    """Python standard library sources in a fixed order, up to about `limit_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    used = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        used += len(text)
        if used >= limit_bytes:
            return


def train_tokenizer(vocab_size: int, corpus_bytes: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_text(corpus_bytes), trainer=trainer)
    return tokenizer


def llama_config(spec: TinyModelSpec, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }


def random_weights(spec: TinyModelSpec, vocab_size: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.hidden_size // spec.num_attention_heads

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps activations O(1) through the layers, so attention is peaked enough for
        # eviction to matter and greedy decoding has clear winners (no near-ties to flip on rounding).
        std = 1.0 / math.sqrt(in_features)
        return torch.randn(out_features, in_features, generator=generator) * std

    weights = {"model.embed_tokens.weight": torch.randn(vocab_size, spec.hidden_size, generator=generator)}
    for layer in range(spec.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        weights[f"{prefix}.self_attn.q_proj.weight"] = linear(
            spec.num_attention_heads * head_dim, spec.hidden_size
        )
        weights[f"{prefix}.self_attn.k_proj.weight"] = linear(
            spec.num_key_value_heads * head_dim, spec.hidden_size
        )
        weights[f"{prefix}.self_attn.v_proj.weight"] = linear(
            spec.num_key_value_heads * head_dim, spec.hidden_size
        )
        weights[f"{prefix}.self_attn.o_proj.weight"] = linear(
            spec.hidden_size, spec.num_attention_heads * head_dim
        )
        weights[f"{prefix}.mlp.gate_proj.weight"] = linear(spec.intermediate_size, spec.hidden_size)
        weights[f"{prefix}.mlp.up_proj.weight"] = linear(spec.intermediate_size, spec.hidden_size)
        weights[f"{prefix}.mlp.down_proj.weight"] = linear(spec.hidden_size, spec.intermediate_size)
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(spec.hidden_size)
        weights[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(spec.hidden_size)
    weights["model.norm.weight"] = torch.ones(spec.hidden_size)
    weights["lm_head.weight"] = linear(vocab_size, spec.hidden_size) * 4.0
    return {name: tensor.contiguous() for name, tensor in weights.items()}


def write_tokenizer_files(out: Path, tokenizer, max_length: int) -> tuple[int, int, int]:
    tokenizer.save(str(out / "tokenizer.json"))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
                "add_bos_token": False,
                "model_max_length": max_length,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2)
    )
    return bos_id, eos_id, pad_id


def generate_tiny_model(out: Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight Llama model folder; the same spec always gives the same files."""
    from safetensors.torch import save_file

    spec = spec or TinyModelSpec()
    if spec.hidden_size % spec.num_attention_heads or spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError("hidden_size must split into heads and heads into key/value groups")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size, spec.tokenizer_corpus_bytes)
    bos_id, eos_id, _ = write_tokenizer_files(out, tokenizer, spec.max_position_embeddings)
    vocab_size = tokenizer.get_vocab_size()
    config = llama_config(spec, vocab_size, bos_id, eos_id)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}, indent=2)
    )
    save_file(random_weights(spec, vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tinymodel_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("var/models/tiny"))
    defaults = TinyModelSpec()
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "seed",
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    args = parser.parse_args(argv)
    spec = TinyModelSpec(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        seed=args.seed,
    )
    path = generate_tiny_model(args.out, spec)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
