"""Roofline and fixed step times, KV sizing and hardware-file overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.virtual_vllm.latency import (
    MODELS,
    FixedLatency,
    HardwareConfigError,
    RooflineLatency,
    load_hardware_file,
    resolve_gpu,
    resolve_model,
)


def test_fixed_latency_is_prefill_tokens_plus_one_decode_step():
    fixed = FixedLatency(0.001, 0.02)
    assert fixed.step_time(100, 0, 0, 0) == pytest.approx(0.1)
    assert fixed.step_time(100, 0, 5, 999) == pytest.approx(0.12)
    assert fixed.step_time(0, 0, 7, 0) == pytest.approx(0.02)


def test_qwen3_8b_geometry_gives_about_8_billion_parameters_and_its_kv_bytes_per_token():
    model = MODELS["qwen/qwen3-8b"]
    assert 7.9e9 < model.params < 8.4e9
    assert model.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2  # c = 2 L H_kv d_h b


def test_decode_is_memory_bound_and_grows_with_context_prefill_is_compute_bound():
    h100 = RooflineLatency(resolve_gpu("h100"), resolve_model("qwen/qwen3-8b"))
    single = h100.step_time(0, 0, 1, 512)
    batch = h100.step_time(0, 0, 64, 64 * 512)
    # One decode step reads the weights once: ~16 GB at 80 % of 3.35 TB/s is about 6 ms (+2 ms overhead).
    assert 0.006 < single < 0.010
    assert single < batch < 64 * single  # batching amortizes the weight reads
    long_prompt = h100.step_time(8192, 8192 * 8192, 0, 0)
    assert long_prompt > 8 * h100.step_time(512, 512 * 512, 0, 0)


def test_faster_memory_decodes_faster_and_a10_l4_is_slowest():
    model = resolve_model("qwen/qwen3-8b")
    times = {
        name: RooflineLatency(resolve_gpu(name), model).step_time(0, 0, 8, 8 * 1024)
        for name in ("h100", "h200", "l4")
    }
    assert times["h200"] < times["h100"] < times["l4"]


def test_kv_blocks_follow_memory_left_after_the_weights():
    model = resolve_model("qwen/qwen3-8b")
    h100 = RooflineLatency(resolve_gpu("h100"), model).kv_blocks(16)
    h200 = RooflineLatency(resolve_gpu("h200"), model).kv_blocks(16)
    assert h200 > 1.9 * h100 > 0
    with pytest.raises(ValueError, match="does not fit"):
        RooflineLatency(resolve_gpu("a10"), resolve_model("qwen/qwen3-14b")).kv_blocks(16)


def test_hardware_file_overrides_and_adds_entries(tmp_path: Path):
    path = tmp_path / "hw.yaml"
    path.write_text(
        "gpus:\n  h100: {memory_bandwidth: 1.0e12}\n  b200: {peak_flops: 2.2e15, memory_bandwidth: 8.0e12, memory_bytes: 1.8e11}\n"
        "models:\n  tiny: {num_layers: 2, hidden_size: 64, num_heads: 2, num_kv_heads: 1, head_dim: 32,"
        " intermediate_size: 128, vocab_size: 1000}\nefficiency: {step_overhead_s: 0.0}\n"
    )
    gpus, models, efficiency = load_hardware_file(path)
    assert gpus["h100"].memory_bandwidth == 1.0e12 and gpus["h100"].peak_flops == 989e12
    assert "b200" in gpus and "tiny" in models and efficiency.step_overhead_s == 0.0
    slow = RooflineLatency(gpus["h100"], resolve_model("qwen/qwen3-8b"), efficiency)
    fast = RooflineLatency(resolve_gpu("h100"), resolve_model("qwen/qwen3-8b"), efficiency)
    assert slow.step_time(0, 0, 1, 100) > 3 * fast.step_time(0, 0, 1, 100)


def test_unknown_names_and_bad_files_raise_with_the_name(tmp_path: Path):
    with pytest.raises(HardwareConfigError, match="tpu"):
        resolve_gpu("tpu")
    with pytest.raises(HardwareConfigError, match="gpt-x"):
        resolve_model("gpt-x")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  h100: {warp_speed: 9}\n")
    with pytest.raises(HardwareConfigError, match="bad.yaml"):
        load_hardware_file(bad)
