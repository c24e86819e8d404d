"""Step-time models for one inference instance: a roofline of a named GPU and model, or fixed per-token times.

A *step* is one forward pass of the continuous batch: it prefills the prompts admitted for it and decodes one
token for every other running sequence. Both models answer ``step_time(prefill_tokens, prefill_square_tokens,
decode_seqs, context_tokens)`` in seconds; the instance calls it once per batch of steps, not per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

import yaml


class LatencyModel(Protocol):
    def step_time(
        self, prefill_tokens: int, prefill_square_tokens: int, decode_seqs: int, context_tokens: int
    ) -> float: ...


@dataclass(frozen=True)
class FixedLatency:
    """Given per-token times, independent of batch size: exact numbers for tests and for calibrated scenarios.

    A step costs ``prefill_tokens * prefill_s_per_token`` plus one ``decode_s_per_token`` when any sequence
    decodes in it, so a lone request of P prompt and N output tokens has TTFT ``P*prefill`` and E2E
    ``P*prefill + (N-1)*decode``.
    """

    prefill_s_per_token: float = 0.0001
    decode_s_per_token: float = 0.02

    def step_time(
        self, prefill_tokens: int, prefill_square_tokens: int, decode_seqs: int, context_tokens: int
    ) -> float:
        return prefill_tokens * self.prefill_s_per_token + (self.decode_s_per_token if decode_seqs else 0.0)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False
    bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0

    @property
    def layer_params(self) -> float:
        attention = 2 * self.hidden_size * self.num_heads * self.head_dim
        attention += 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size  # gated MLP: gate, up, down
        return float(attention + mlp)

    @property
    def params(self) -> float:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    @property
    def flops_per_token(self) -> float:
        # Matmul FLOPs per token: every layer's weights plus the LM head (the input embedding is a lookup).
        return 2.0 * (self.num_layers * self.layer_params + self.vocab_size * self.hidden_size)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        # c = 2 L H_kv d_h b (seed 000, section 3.1)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", peak_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80e9),
    "h200": GpuSpec("h200", peak_flops=989e12, memory_bandwidth=4.8e12, memory_bytes=141e9),
    # One "A10/L4-class" entry: an L4's bf16 dense compute with the bandwidth between an L4 and an A10.
    "a10-l4": GpuSpec("a10-l4", peak_flops=121e12, memory_bandwidth=450e9, memory_bytes=24e9),
}
GPU_ALIASES = {"a10": "a10-l4", "l4": "a10-l4", "a10/l4": "a10-l4", "h100-sxm": "h100"}

MODELS: dict[str, ModelGeometry] = {
    "qwen/qwen3-8b": ModelGeometry("qwen/qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
    "qwen/qwen3-14b": ModelGeometry("qwen/qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936),
    "meta-llama/llama-3.1-8b": ModelGeometry("meta-llama/llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "qwen/qwen2.5-0.5b": ModelGeometry(
        "qwen/qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, tied_embeddings=True
    ),
}


@dataclass(frozen=True)
class Efficiency:
    """How much of the roofline a real engine reaches, plus the per-step CPU overhead (scheduling, sampling)."""

    compute: float = 0.5
    bandwidth: float = 0.8
    step_overhead_s: float = 0.002
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True)
class RooflineLatency:
    gpu: GpuSpec
    model: ModelGeometry
    efficiency: Efficiency = field(default_factory=Efficiency)
    tensor_parallel: int = 1
    # Folded constants, set in __post_init__ (seconds per token, per attention pair, per step, per KV token).
    _token_s: float = field(init=False, repr=False, default=0.0)
    _pair_s: float = field(init=False, repr=False, default=0.0)
    _weights_s: float = field(init=False, repr=False, default=0.0)
    _kv_token_s: float = field(init=False, repr=False, default=0.0)

    def __post_init__(self) -> None:
        # The step time is called once per batch; fold the geometry into four constants once.
        m = self.model
        compute_rate = self.gpu.peak_flops * self.tensor_parallel * self.efficiency.compute
        memory_rate = self.gpu.memory_bandwidth * self.tensor_parallel * self.efficiency.bandwidth
        object.__setattr__(self, "_token_s", m.flops_per_token / compute_rate)
        # Causal attention: QK^T and AV cost 4*L*width per (query, key) pair; prefill has about P^2/2 pairs.
        object.__setattr__(self, "_pair_s", 4.0 * m.num_layers * m.num_heads * m.head_dim / compute_rate)
        object.__setattr__(self, "_weights_s", m.weight_bytes / memory_rate)
        object.__setattr__(self, "_kv_token_s", m.kv_bytes_per_token / memory_rate)

    def step_time(
        self, prefill_tokens: int, prefill_square_tokens: int, decode_seqs: int, context_tokens: int
    ) -> float:
        compute_s = self._token_s * (prefill_tokens + decode_seqs) + self._pair_s * (
            prefill_square_tokens / 2 + context_tokens
        )
        memory_s = self._weights_s + self._kv_token_s * (context_tokens + prefill_tokens)
        return (compute_s if compute_s > memory_s else memory_s) + self.efficiency.step_overhead_s

    def kv_blocks(self, block_size: int) -> int:
        usable = self.gpu.memory_bytes * self.tensor_parallel * self.efficiency.gpu_memory_utilization
        free = usable - self.model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"model {self.model.name} does not fit on {self.gpu.name} x{self.tensor_parallel}"
            )
        return int(free // (block_size * self.model.kv_bytes_per_token))


def _field_values(spec: GpuSpec | ModelGeometry) -> dict[str, Any]:
    """A spec's fields by name (its `__dict__`, which the compiled build's classes do not have: apps.compiled)."""
    return {item.name: getattr(spec, item.name) for item in fields(spec)}


class HardwareConfigError(ValueError):
    pass


def resolve_gpu(name: str, gpus: dict[str, GpuSpec] | None = None) -> GpuSpec:
    table = gpus or GPUS
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in table:
        raise HardwareConfigError(f"unknown GPU {name!r}; known: {', '.join(sorted(table))}")
    return table[key]


def resolve_model(name: str, models: dict[str, ModelGeometry] | None = None) -> ModelGeometry:
    table = models or MODELS
    key = name.lower()
    if key not in table:
        raise HardwareConfigError(f"unknown model {name!r}; known: {', '.join(sorted(table))}")
    return table[key]


def load_hardware_file(path: str | Path) -> tuple[dict[str, GpuSpec], dict[str, ModelGeometry], Efficiency]:
    """Read GPU, model and efficiency overrides from YAML; entries merge over the built-in tables."""
    try:
        data: Any = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise HardwareConfigError(f"cannot read hardware file {path}: {error}") from error
    data = data or {}
    if not isinstance(data, dict):
        raise HardwareConfigError(f"hardware file {path}: top level must be a mapping")
    gpus = dict(GPUS)
    models = dict(MODELS)
    efficiency = Efficiency()
    try:
        for name, spec in (data.get("gpus") or {}).items():
            base = gpus.get(name.lower())
            values: dict[str, Any] = {**(_field_values(base) if base else {}), **spec, "name": name.lower()}
            gpus[name.lower()] = GpuSpec(
                name.lower(),
                float(values["peak_flops"]),
                float(values["memory_bandwidth"]),
                float(values["memory_bytes"]),
            )
            unknown = set(values) - {"name", "peak_flops", "memory_bandwidth", "memory_bytes"}
            if unknown:
                raise HardwareConfigError(
                    f"hardware file {path}: gpus.{name}: unknown keys {sorted(unknown)}"
                )
        for name, spec in (data.get("models") or {}).items():
            base_model = models.get(name.lower())
            values = {**(_field_values(base_model) if base_model else {}), **spec, "name": name.lower()}
            models[name.lower()] = ModelGeometry(**values)
        if data.get("efficiency"):
            efficiency = replace(efficiency, **{k: float(v) for k, v in data["efficiency"].items()})
    except HardwareConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as error:
        raise HardwareConfigError(f"hardware file {path}: {error!r}") from error
    return gpus, models, efficiency


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) if tokens > 0 else 0


__all__ = [
    "GPUS",
    "MODELS",
    "Efficiency",
    "FixedLatency",
    "GpuSpec",
    "HardwareConfigError",
    "LatencyModel",
    "ModelGeometry",
    "RooflineLatency",
    "blocks_for",
    "load_hardware_file",
    "resolve_gpu",
    "resolve_model",
]
