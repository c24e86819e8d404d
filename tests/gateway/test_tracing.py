"""Traces of the request path (issue 28, item 5): with tracing on, a request is one server span with a child
span per pipeline step, carrying who asked (tenant, entitlement, pool), how it was served (class, decision,
reason, queue wait, tokens); the backend gets the upstream span's `traceparent`; a client's `traceparent` is
the request span's parent. With tracing off (the default) nothing is traced, no header is added and no
OpenTelemetry module is imported.

The spans are read from the SDK's in-memory exporter, through a real gateway and a real backend."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from apps.gateway.tracing import tracer_from_env, tracing_requested
from apps.gateway.tracing_otel import GatewayTracer, build_provider
from bench.otlp_sink import OtlpSink

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["authenticate", "parse", "count tokens", "admit or wait", "upstream", "relay", "account"]
BODY = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}


def traced(harness: Any) -> InMemorySpanExporter:
    """Trace the harness's gateway into memory (what `OTEL_*` would send to a collector)."""
    exporter = InMemorySpanExporter()
    harness.gateway.tracer = GatewayTracer(build_provider(processor=SimpleSpanProcessor(exporter)))
    return exporter


def requests(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The request spans (kind SERVER), once `count` of them ended: the last bytes of an answer go out before
    its span ends."""
    deadline = time.monotonic() + 10
    while True:
        roots = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
        if len(roots) >= count or time.monotonic() > deadline:
            return sorted(roots, key=lambda s: s.start_time or 0)
        time.sleep(0.01)


def steps(exporter: InMemorySpanExporter, root: ReadableSpan) -> list[ReadableSpan]:
    assert root.context is not None
    children = [s for s in exporter.get_finished_spans()
                if s.parent is not None and s.parent.span_id == root.context.span_id]
    return sorted(children, key=lambda s: s.start_time or 0)


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def fire(harness: Any, bodies: list[dict[str, Any]], headers: dict[str, str] | None = None) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:
            return await asyncio.gather(*(client.post(harness.url + "/v1/chat/completions", json=body,
                                                      headers={**harness.auth(), **(headers or {})})
                                          for body in bodies))

    return asyncio.run(run())


def test_a_whole_and_a_streamed_request_are_a_span_each_with_a_child_per_step(gateway_factory: Any) -> None:
    harness = gateway_factory()
    exporter = traced(harness)
    (whole,) = fire(harness, [BODY])
    (streamed,) = fire(harness, [{**BODY, "stream": True}])
    assert whole.status_code == 200 and streamed.status_code == 200
    assert streamed.text.rstrip().endswith("data: [DONE]")
    roots = requests(exporter, 2)
    assert len(roots) == 2
    upstream = harness.upstreams[0]
    for root, sent in zip(roots, upstream.received_headers, strict=True):
        assert root.name == "POST /v1/chat/completions" and root.parent is None
        children = steps(exporter, root)
        assert [s.name for s in children] == STEPS
        # One after the other, inside the request's span.
        for before, after in zip(children, children[1:], strict=False):
            assert before.end_time is not None and after.start_time is not None
            assert before.end_time <= after.start_time
        assert root.start_time <= children[0].start_time and children[-1].end_time <= root.end_time  # type: ignore[operator]
        assert root.status.status_code == StatusCode.UNSET
        attributes = attrs(root)
        assert attributes["tokenpools.tenant"] == "acme"
        assert attributes["tokenpools.entitlement"] == harness.entitlement.name
        assert attributes["tokenpools.pool"] == "tiny"
        assert attributes["tokenpools.service_class"] == "guaranteed"
        assert attributes["tokenpools.service_tier"] == "guaranteed"
        assert attributes["tokenpools.decision"] == "admitted"
        assert attributes["tokenpools.queue_wait_ms"] == 0.0
        assert "tokenpools.reason" not in attributes
        assert attributes["gen_ai.request.model"] == "tiny-model"
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.request.max_tokens"] == 4
        # The backend's usage: two words and two for its chat template; four tokens generated.
        assert attributes["gen_ai.usage.input_tokens"] == 4
        assert attributes["gen_ai.usage.output_tokens"] == 4
        assert attributes["http.response.status_code"] == 200
        # The backend got the upstream span's trace context: its own spans join this trace, under that span.
        call = children[STEPS.index("upstream")]
        assert call.kind == SpanKind.CLIENT
        assert attrs(call)["http.response.status_code"] == 200
        version, trace_id, parent_id, flags = sent["traceparent"].split("-")
        assert root.context is not None and call.context is not None
        assert version == "00" and int(flags, 16) & 1  # sampled
        assert int(trace_id, 16) == root.context.trace_id
        assert int(parent_id, 16) == call.context.span_id
    assert [attrs(r)["tokenpools.stream"] for r in roots] == [False, True]
    assert roots[0].resource.attributes["service.name"] == "tokenpools-gateway"


def test_a_client_traceparent_is_the_request_spans_parent(gateway_factory: Any) -> None:
    harness = gateway_factory()
    exporter = traced(harness)
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    (response,) = fire(harness, [BODY], {"traceparent": f"00-{trace_id}-{span_id}-01"})
    assert response.status_code == 200
    (root,) = requests(exporter, 1)
    assert root.parent is not None and root.parent.is_remote
    assert (root.parent.trace_id, root.parent.span_id) == (int(trace_id, 16), int(span_id, 16))
    assert root.context is not None and root.context.trace_id == int(trace_id, 16)
    # The backend's trace is the client's too.
    assert harness.upstreams[0].received_headers[-1]["traceparent"].split("-")[1] == trace_id


def test_a_sampled_out_request_records_nothing_and_still_passes_its_trace_on(
        gateway_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    harness = gateway_factory()
    exporter = traced(harness)
    (response,) = fire(harness, [BODY])
    assert response.status_code == 200
    _, trace_id, _, flags = harness.upstreams[0].received_headers[-1]["traceparent"].split("-")
    assert int(trace_id, 16) != 0 and int(flags, 16) & 1 == 0  # a trace the backend may join, not sampled
    time.sleep(0.2)
    assert exporter.get_finished_spans() == ()


def test_a_queued_request_says_its_wait_and_a_refused_one_its_reason_with_an_error(gateway_factory: Any,
                                                                                   upstream_factory: Any) -> None:
    upstream, _ = upstream_factory(first_token_delay_s=0.3)
    harness = gateway_factory(upstreams=[upstream],
                              entitlement={"concurrency": 1, "queue_max": 1, "queue_max_wait_ms": 5000})
    exporter = traced(harness)
    responses = fire(harness, [BODY] * 3)
    codes = sorted((r.status_code, r.json().get("error", {}).get("code", "")) for r in responses)
    assert codes == [(200, ""), (200, ""), (429, "queue_full")], codes
    roots = requests(exporter, 3)
    by_decision = {attrs(r)["tokenpools.decision"]: r for r in roots}
    assert sorted(by_decision) == ["admitted", "queued", "rejected"]

    queued = attrs(by_decision["queued"])
    assert queued["tokenpools.queue_wait_ms"] >= 200.0  # it waited for the first one's release (0.3 s)
    assert [s.name for s in steps(exporter, by_decision["queued"])] == STEPS

    refused = by_decision["rejected"]
    attributes = attrs(refused)
    assert attributes["tokenpools.reason"] == "queue_full"
    assert attributes["error.type"] == "queue_full"
    assert attributes["http.response.status_code"] == 429
    assert attributes["tokenpools.tenant"] == "acme"
    assert "gen_ai.usage.input_tokens" not in attributes  # nothing served
    assert refused.status.status_code == StatusCode.ERROR and refused.status.description == "queue_full"
    # It stopped at the admission step, which carries the error too.
    children = steps(exporter, refused)
    assert [s.name for s in children] == STEPS[:STEPS.index("admit or wait") + 1]
    assert children[-1].status.status_code == StatusCode.ERROR
    assert len(upstream.received_headers) == 2  # the refused one never reached the backend


def test_a_bad_key_is_an_errored_span_that_stopped_at_authenticate(gateway_factory: Any) -> None:
    harness = gateway_factory()
    exporter = traced(harness)
    response = httpx.post(harness.url + "/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    (root,) = requests(exporter, 1)
    assert root.status.status_code == StatusCode.ERROR
    assert attrs(root)["http.response.status_code"] == 401
    assert "tokenpools.tenant" not in attrs(root)
    assert [s.name for s in steps(exporter, root)] == ["authenticate"]


def test_off_by_default_nothing_is_traced_nor_sent(gateway_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not tracing_requested({})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": "none"})
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    harness = gateway_factory()
    assert harness.gateway.tracer is None
    (response,) = fire(harness, [BODY], {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    assert response.status_code == 200
    # The client's own header is not forwarded either: the backend's headers are the gateway's.
    assert "traceparent" not in harness.upstreams[0].received_headers[-1]


def test_off_the_gateway_loads_no_tracing() -> None:
    """In a fresh process without OTEL_*: the gateway built and its request path imported, neither the live
    tracer nor OpenTelemetry's tracing SDK, propagator or exporter is loaded (the off path reads one attribute
    per step and calls nothing). redis-py (8) itself imports OpenTelemetry's API and metrics SDK when they
    are installed, for its own metrics (off unless configured): those are not ours and not looked at."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    code = ("import django, sys; django.setup()\n"
            "from apps.gateway.app import Gateway\n"
            "gateway = Gateway()\n"
            "assert gateway.tracer is None\n"
            "print(sorted(m for m in sys.modules if m.startswith(TRACING)))\n")
    tracing = ("apps.gateway.tracing_otel", "opentelemetry.sdk.trace", "opentelemetry.exporter",
               "opentelemetry.trace.propagation.tracecontext")
    env.setdefault("DJANGO_SETTINGS_MODULE", "tokenpools_site.settings")
    out = subprocess.run([sys.executable, "-c", f"TRACING = {tracing!r}\n" + code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    # The same check, with tracing asked for, does see them (so it can fail).
    on = subprocess.run([sys.executable, "-c", f"TRACING = {tracing!r}\n" + code.replace("assert gateway.tracer is None", "")],
                        cwd=ROOT, env={**env, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
                        capture_output=True, text=True, timeout=120)
    assert on.returncode == 0, on.stderr
    assert "apps.gateway.tracing_otel" in on.stdout.strip().splitlines()[-1]


def test_on_from_the_environment_it_exports_over_otlp_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """The standard variables configure it: the endpoint (OTLP/HTTP, /v1/traces appended) and the service name;
    the spans batched are exported when the tracer shuts down (the gateway's stop)."""
    sink = OtlpSink(count_spans=True).start()
    try:
        for name in [n for n in os.environ if n.startswith("OTEL_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.url)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "gw-test")
        tracer = tracer_from_env()
        assert tracer is not None
        assert tracer.provider.resource.attributes["service.name"] == "gw-test"
        with tracer.tracer.start_as_current_span("probe"):
            pass
        assert sink.posts == 0  # batched
        tracer.shutdown()
        assert (sink.posts, sink.spans) == (1, 1)
    finally:
        sink.stop()
