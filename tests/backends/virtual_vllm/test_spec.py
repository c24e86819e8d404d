"""`InstanceSpec` and `build_latency`: what the simulator and the virtual vLLM both build an instance from."""

from __future__ import annotations

from dataclasses import fields

import pytest

from apps.simulator.simulation import SimConfig, Simulation
from backends.virtual_vllm.latency import FixedLatency, RooflineLatency
from backends.virtual_vllm.spec import DEFAULT_FIXED_KV_BLOCKS, InstanceSpec, build_latency


def test_fixed_times_are_milliseconds_and_kv_defaults_to_plenty() -> None:
    latency, kv_blocks = build_latency(InstanceSpec(latency_model="fixed", prefill_ms_per_token=2, decode_ms_per_token=30))
    assert latency == FixedLatency(0.002, 0.03)
    assert kv_blocks == DEFAULT_FIXED_KV_BLOCKS
    assert build_latency(InstanceSpec(latency_model="fixed", kv_blocks=64))[1] == 64


def test_roofline_kv_blocks_come_from_the_gpu_memory_left() -> None:
    latency, kv_blocks = build_latency(InstanceSpec(gpu="h200", model="qwen/qwen3-8b", block_size=16))
    assert isinstance(latency, RooflineLatency)
    assert kv_blocks == latency.kv_blocks(16) > build_latency(InstanceSpec(gpu="h100"))[1]


def test_an_unknown_latency_model_or_gpu_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown latency model 'exact'"):
        build_latency(InstanceSpec(latency_model="exact"))
    with pytest.raises(ValueError, match="unknown GPU 'tpu'"):
        build_latency(InstanceSpec(gpu="tpu"))


def test_the_simulator_describes_its_instances_with_the_same_fields_and_defaults() -> None:
    assert SimConfig().instance_spec() == InstanceSpec()
    config = SimConfig(latency_model="fixed", decode_ms_per_token=5, max_num_seqs=3, kv_blocks=50, block_size=8,
                       max_batched_tokens=None)  # fmt: skip
    spec = config.instance_spec()
    assert {f.name: getattr(spec, f.name) for f in fields(spec)} == {
        f.name: getattr(config, f.name) for f in fields(spec)
    }
    simulation = Simulation(config)
    (instance,) = simulation.cluster.instances
    assert (instance.max_num_seqs, instance.total_blocks, instance.block_size, instance.max_batched_tokens) == (
        3, 50, 8, None
    )  # fmt: skip
    assert simulation.latency == FixedLatency(0.0001, 0.005)
