"""What one instance is: its step-time model and its batching limits, and the latency model they imply.

The simulator's `SimConfig` (virtual time) and the virtual vLLM's flags (real time) both describe an instance
with these fields, so both build its latency model and KV size here: one instance model, two clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.virtual_vllm.latency import (
    Efficiency,
    FixedLatency,
    LatencyModel,
    RooflineLatency,
    load_hardware_file,
    resolve_gpu,
    resolve_model,
)

# Under fixed per-token times nothing says how much KV an instance holds: enough that it never runs out.
DEFAULT_FIXED_KV_BLOCKS = 1_000_000
LATENCY_MODELS = ("roofline", "fixed")


@dataclass(frozen=True)
class InstanceSpec:
    latency_model: str = "roofline"  # "roofline" | "fixed"
    model: str = "qwen/qwen3-8b"  # geometry for the roofline
    gpu: str = "h100"
    prefill_ms_per_token: float = 0.1  # the fixed model's times
    decode_ms_per_token: float = 20.0
    hardware_file: str | None = None  # YAML overrides of the roofline's GPU and model tables
    tensor_parallel: int = 1
    max_num_seqs: int = 256
    kv_blocks: int | None = None  # None: what the GPU's memory left after the weights holds
    block_size: int = 16
    max_batched_tokens: int | None = 8192


def build_latency(spec: InstanceSpec) -> tuple[LatencyModel, int]:
    """The step-time model and the KV blocks per instance it implies; ValueError on an unknown model or GPU."""
    if spec.latency_model == "fixed":
        latency = FixedLatency(spec.prefill_ms_per_token / 1000, spec.decode_ms_per_token / 1000)
        return latency, spec.kv_blocks or DEFAULT_FIXED_KV_BLOCKS
    if spec.latency_model != "roofline":
        raise ValueError(f"unknown latency model {spec.latency_model!r}; expected roofline or fixed")
    gpus, models, efficiency = None, None, Efficiency()
    if spec.hardware_file:
        gpus, models, efficiency = load_hardware_file(spec.hardware_file)
    roofline = RooflineLatency(
        resolve_gpu(spec.gpu, gpus), resolve_model(spec.model, models), efficiency, spec.tensor_parallel
    )
    return roofline, spec.kv_blocks or roofline.kv_blocks(spec.block_size)
