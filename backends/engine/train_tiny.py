"""Train a small Llama on the Python standard library sources, on CPU, within a time budget.

The result is a normal Llama folder (config.json, model.safetensors in bfloat16, tokenizer.json) that the
engine and vLLM load, small enough to commit (about 10 MB at the defaults), so eviction quality
(perplexity with and without eviction) can be measured without training again.

    python -m backends.engine.train_tiny --out backends/engine/assets/tiny-stdlib --minutes 24

Text: every `*.py` file under the standard library folder, in sorted order; the last 5% of the files
are held out for the validation perplexity written to `train_report.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from backends.engine.tiny_model import (
    TinyModelSpec,
    llama_config,
    train_tokenizer,
    write_tokenizer_files,
)


@dataclass(frozen=True)
class TrainSpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    context: int = 256
    batch_size: int = 16
    learning_rate: float = 3e-3
    minutes: float = 24.0  # training only; tokenizer, corpus encoding and evaluation add about 2 minutes
    max_steps: int = 100_000
    seed: int = 0
    corpus_bytes: int = 40_000_000
    threads: int = 0  # 0: torch's default


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, spec: TrainSpec, eps: float) -> None:
        super().__init__()
        head_dim = spec.hidden_size // spec.num_attention_heads
        self.heads, self.kv_heads, self.head_dim = (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            head_dim,
        )
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)
        self.q_proj = nn.Linear(spec.hidden_size, self.heads * head_dim, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, self.kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, self.kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * head_dim, spec.hidden_size, bias=False)
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TrainableLlama(nn.Module):
    """The same arithmetic as `backends.engine.model.LlamaModel`, with autograd and no KV pool."""

    inv_freq: torch.Tensor

    def __init__(self, spec: TrainSpec, vocab_size: int, eps: float = 1e-5, theta: float = 10000.0) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec, eps) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, eps)
        self.lm_head = nn.Linear(spec.hidden_size, vocab_size, bias=False)
        head_dim = spec.hidden_size // spec.num_attention_heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, dtype=torch.float64) * 2 / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(ids.shape[1], dtype=torch.float64)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().float(), angles.sin().float()
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def hf_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Weights under the Hugging Face Llama names."""
        out = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
            "model.norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        for index, module in enumerate(self.layers):
            layer = cast(Block, module)
            prefix = f"model.layers.{index}"
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[f"{prefix}.self_attn.{name}.weight"] = getattr(layer, name).weight
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[f"{prefix}.mlp.{name}.weight"] = getattr(layer, name).weight
            out[f"{prefix}.input_layernorm.weight"] = layer.input_layernorm.weight
            out[f"{prefix}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        return {name: tensor.detach().to(dtype).contiguous() for name, tensor in out.items()}


def corpus_files(corpus_bytes: int = TrainSpec.corpus_bytes) -> tuple[list[Path], list[Path]]:
    """The standard-library files training reads and the ones it holds out (the last 5%, sorted order).

    Benchmarks read the held-out list from here, so "held out" means the same files the model never saw.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    used = 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(path)
        used += len(text)
        if used >= corpus_bytes:
            break
    split = max(1, int(len(files) * 0.95))
    return files[:split], files[split:]


def corpus(spec: TrainSpec, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the training and held-out files, each file followed by the end-of-text token."""
    train_files, held_out_files = corpus_files(spec.corpus_bytes)
    eos = tokenizer.token_to_id("</s>")

    def encode(texts: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(eos)
        return torch.tensor(ids, dtype=torch.long)

    return encode([path.read_text(encoding="utf-8") for path in train_files]), encode(
        [path.read_text(encoding="utf-8") for path in held_out_files]
    )


def batches(data: torch.Tensor, context: int, batch_size: int, rng: random.Random) -> torch.Tensor:
    starts = [rng.randrange(0, data.numel() - context - 1) for _ in range(batch_size)]
    return torch.stack([data[s : s + context + 1] for s in starts])


@torch.no_grad()
def evaluate(model: TrainableLlama, data: torch.Tensor, context: int, windows: int = 32) -> float:
    model.eval()
    rng = random.Random(1234)
    losses = []
    for _ in range(windows):
        window = batches(data, context, 1, rng)
        logits = model(window[:, :-1])
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


def train(out: Path, spec: TrainSpec) -> dict:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size, min(spec.corpus_bytes, 8_000_000))
    bos_id, eos_id, _ = write_tokenizer_files(out, tokenizer, 2048)
    vocab_size = tokenizer.get_vocab_size()
    train_ids, held_out_ids = corpus(spec, tokenizer)
    model = TrainableLlama(spec, vocab_size)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.learning_rate, weight_decay=0.1, betas=(0.9, 0.95)
    )
    deadline = time.monotonic() + spec.minutes * 60
    started = time.monotonic()
    step = 0
    history = []
    while step < spec.max_steps and time.monotonic() < deadline:
        # Cosine schedule on elapsed time, since the budget is wall-clock, with a short warm-up.
        progress = (time.monotonic() - started) / (spec.minutes * 60)
        warmup = min(1.0, (step + 1) / 50)
        for group in optimizer.param_groups:
            group["lr"] = spec.learning_rate * warmup * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        window = batches(train_ids, spec.context, spec.batch_size, rng)
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 50 == 0 or step == 1:
            history.append(
                {"step": step, "seconds": round(time.monotonic() - started, 1), "loss": loss.item()}
            )
            print(f"step {step} loss {loss.item():.3f} ({time.monotonic() - started:.0f}s)", flush=True)
    held_out_loss = evaluate(model, held_out_ids, spec.context)
    save_llama_folder(out, model, vocab_size, bos_id, eos_id)
    report = {
        "spec": asdict(spec),
        "steps": step,
        "seconds": round(time.monotonic() - started, 1),
        "train_tokens": int(train_ids.numel()),
        "held_out_tokens": int(held_out_ids.numel()),
        "held_out_loss": held_out_loss,
        "held_out_perplexity": math.exp(held_out_loss),
        "history": history,
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    return report


def save_llama_folder(out: Path, model: TrainableLlama, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """Write `model` as a Hugging Face Llama folder (config, generation config, bfloat16 weights) that the
    engine and vLLM load; the tokenizer files are the caller's."""
    from safetensors.torch import save_file

    spec = model.spec
    model_spec = TinyModelSpec(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        seed=spec.seed,
    )
    config = llama_config(model_spec, vocab_size, bos_id, eos_id)
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}, indent=2)
    )
    save_file(model.hf_state_dict(torch.bfloat16), str(out / "model.safetensors"), metadata={"format": "pt"})


def parse_spec(defaults: Any, out: Path, argv: list[str] | None, description: str | None) -> tuple[Path, Any]:
    """`--out` and one `--field-name` option per field of the dataclass `defaults`; returns the folder and
    a spec of the same class with what the command line changed."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=out)
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    return args.out, type(defaults)(**{name: getattr(args, name) for name in asdict(defaults)})


def main(argv: list[str] | None = None) -> None:
    out, spec = parse_spec(TrainSpec(), Path("backends/engine/assets/tiny-stdlib"), argv, __doc__)
    report = train(out, spec)
    print(f"wrote {out}: {report['steps']} steps, held-out perplexity {report['held_out_perplexity']:.1f}")


if __name__ == "__main__":
    main()
