"""The live tracer (imported only when tracing is on, see `apps.gateway.tracing`): one server span per request,
a child span per pipeline step, the W3C trace context in from the client and out to the backend.

A request's steps run one after the other, so a step span ends where the next begins (`RequestTrace.step`);
a step left by an exception records it (error status, `error.type`), and so does the request's span. Attribute
names follow the OpenTelemetry HTTP and GenAI semantic conventions where one fits (`http.*`, `url.*`,
`server.*`, `error.type`, `gen_ai.*`); what is ours is under `tokenpools.*`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import httpx
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from apps.gateway.errors import UPSTREAM_SHED, GatewayError
from apps.gateway.parse import CHAT
from apps.gateway.state import WAITING

if TYPE_CHECKING:
    from apps.gateway.admission import Admission
    from apps.gateway.context import RequestContext
    from apps.gateway.parse import ParsedRequest

logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "tokenpools-gateway"
INSTRUMENTATION = "tokenpools.gateway"
# Only W3C trace context, in and out (not the global propagators: a client's baggage is not forwarded).
PROPAGATOR = TraceContextTextMapPropagator()
# The pipeline's steps, in order (apps/gateway/app.py).
AUTHENTICATE, PARSE, COUNT_TOKENS, ADMIT, UPSTREAM, RELAY, ACCOUNT = (
    "authenticate", "parse", "count tokens", "admit or wait", "upstream", "relay", "account")
ADMITTED, QUEUED, REJECTED = "admitted", "queued", "rejected"
# The steps where a GatewayError is the admission's refusal (the inference gateway's shed counts as one too).
REFUSING_STEPS = frozenset({ADMIT})


def build_provider(*, processor: SpanProcessor | None = None) -> TracerProvider:
    """A tracer provider configured from `OTEL_*` (resource, sampler; the exporter's endpoint, headers, timeout
    and protocol; the batch processor's sizes). `processor` replaces the exporting one (tests pass an in-memory
    exporter's). Not installed as the global provider: the gateway's spans go through its own."""
    attributes: dict[str, str] = {}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create(attributes))  # the sampler: OTEL_TRACES_SAMPLER(_ARG)
    provider.add_span_processor(processor or BatchSpanProcessor(_exporter()))
    return provider


def _exporter() -> SpanExporter:
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        return ConsoleSpanExporter()
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError:
            logger.warning("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc; "
                           "exporting with http/protobuf")
        else:
            return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, _HEADERS, _TIMEOUT, _COMPRESSION


class GatewayTracer:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(INSTRUMENTATION)

    async def serve(self, ctx: RequestContext, kind: str,
                    completion: Callable[[RequestContext, str], Awaitable[None]]) -> None:
        """Run the completion pipeline for `ctx` inside its request span."""
        request_trace = RequestTrace(self.tracer, ctx, kind)
        ctx.trace = request_trace
        send = ctx.send

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                request_trace.status = message["status"]
            await send(message)

        ctx.send = sending
        try:
            await completion(ctx, kind)
        except BaseException as exc:
            request_trace.finish(exc)
            raise
        request_trace.finish(None)

    def shutdown(self) -> None:
        """Export what is still batched, then stop (blocking: call it from a thread)."""
        self.provider.shutdown()


def _client_context(ctx: RequestContext) -> Context:
    """The client's trace context (`traceparent`, `tracestate`) as the request span's parent: a caller's trace
    continues through the gateway. It names a parent span, nothing more: who the caller is comes from its key."""
    carrier = {}
    for key, value in ctx.scope.get("headers") or ():
        name = key.lower()
        if name in (b"traceparent", b"tracestate"):
            carrier[name.decode()] = value.decode("latin-1")
    return PROPAGATOR.extract(carrier) if carrier else Context()


class RequestTrace:
    """One request's spans: the request's (kind SERVER, from the moment it came in) and its current step's."""

    __slots__ = ("ctx", "decision", "failed", "failed_step", "input_tokens", "parent", "recording", "root",
                 "status", "step_name", "step_span", "tracer")

    def __init__(self, tracer: trace.Tracer, ctx: RequestContext, kind: str) -> None:
        self.tracer = tracer
        self.ctx = ctx
        route = ctx.scope["path"].rstrip("/")
        began_ns = time.time_ns() - int((time.perf_counter() - ctx.started) * 1e9)
        self.root: Span = tracer.start_span(
            f"POST {route}", context=_client_context(ctx), kind=SpanKind.SERVER, start_time=began_ns,
            attributes={"http.request.method": "POST", "http.route": route, "url.path": ctx.scope["path"],
                        "url.scheme": ctx.scope.get("scheme", "http"),
                        "gen_ai.operation.name": "chat" if kind == CHAT else "text_completion",
                        "tokenpools.request_id": ctx.request_id})
        self.parent = trace.set_span_in_context(self.root)
        # Sampled out (OTEL_TRACES_SAMPLER): no step spans at all, only the trace context passed on.
        self.recording = self.root.is_recording()
        self.status: int | None = None
        self.decision: str | None = None
        self.input_tokens: int | None = None
        self.failed: BaseException | None = None
        self.failed_step: str | None = None
        self.step_name: str | None = None
        self.step_span: Span | None = None
        self.step(AUTHENTICATE)

    def step(self, name: str | None, kind: SpanKind = SpanKind.INTERNAL) -> None:
        """End the current step (with the exception on its way out, if one is) and begin `name` (None: none)."""
        self._end_step(sys.exc_info()[1])
        if name is not None and self.recording:
            self.step_name = name
            self.step_span = self.tracer.start_span(name, context=self.parent, kind=kind)

    def parsed(self, parsed: ParsedRequest) -> None:
        """The parse step is done (the body is valid, its model the key's pool's): the count tokens step begins."""
        attributes: dict[str, Any] = {"gen_ai.request.model": parsed.model, "tokenpools.stream": parsed.stream}
        if parsed.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = parsed.max_tokens
        self.root.set_attributes(attributes)
        self.step(COUNT_TOKENS)

    def upstream(self, admission: Admission, headers: Mapping[str, str]) -> Mapping[str, str]:
        """Admitted (at once, or after a wait): the upstream step begins; returns the backend's headers with the
        upstream span's `traceparent`, whose trace the backend's own spans join."""
        self.decision = QUEUED if admission.offer.state == WAITING else ADMITTED
        self.input_tokens = admission.reservation.input_tokens
        self.step(UPSTREAM, SpanKind.CLIENT)
        carrier = dict(headers)
        PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.step_span) if self.step_span else self.parent)
        return carrier

    def relaying(self, response: httpx.Response, url_full: str) -> None:
        """The backend answered (status and headers) from `url_full`: the relay step begins."""
        span = self.step_span
        if span is not None:
            url = httpx.URL(url_full)
            span.set_attributes({"http.request.method": "POST", "url.full": str(url), "server.address": url.host,
                                 "server.port": url.port or (443 if url.scheme == "https" else 80),
                                 "http.response.status_code": response.status_code})
            if response.status_code >= 500:
                span.set_status(Status(StatusCode.ERROR))
                span.set_attribute("error.type", str(response.status_code))
        self.step(RELAY)

    def _end_step(self, exc: BaseException | None) -> None:
        span = self.step_span
        if span is None:
            return
        if exc is not None and exc is not self.failed:  # an error seen once, where it happened
            self.failed, self.failed_step = exc, self.step_name
            _record(span, exc)
        span.end()
        self.step_span = self.step_name = None

    def finish(self, exc: BaseException | None) -> None:
        """The request is over (`exc`: how it failed, if it did): end its spans, with what it was and got."""
        self._end_step(exc)
        ctx, root = self.ctx, self.root
        if not self.recording:
            root.end()
            return
        attributes: dict[str, Any] = {}
        entry = ctx.entry
        if entry is not None:
            attributes.update({"tokenpools.tenant": entry.tenant_slug, "tokenpools.entitlement": entry.entitlement,
                               "tokenpools.pool": entry.pool_name,
                               "tokenpools.service_class": str(entry.limits.service_class)})
        if ctx.service_tier:
            attributes["tokenpools.service_tier"] = ctx.service_tier
        decision = self.decision
        if isinstance(exc, GatewayError) and (self.failed_step in REFUSING_STEPS or exc.code == UPSTREAM_SHED):
            decision = REJECTED
            attributes["tokenpools.reason"] = exc.code
        if decision is not None:
            attributes["tokenpools.decision"] = decision
            attributes["tokenpools.queue_wait_ms"] = round(ctx.queue_ms, 3)
        if ctx.proxied:
            prompt, completion = ctx.served.counts(self.input_tokens or 0)
            attributes["gen_ai.usage.input_tokens"] = prompt
            attributes["gen_ai.usage.output_tokens"] = completion
        if self.input_tokens is not None:
            attributes["tokenpools.input_tokens_counted"] = self.input_tokens
        status = exc.status if isinstance(exc, GatewayError) else self.status
        if status is not None:
            attributes["http.response.status_code"] = status
        root.set_attributes(attributes)
        if exc is not None:
            _record(root, exc)
        elif ctx.preempted or ctx.disconnected:
            reason = "preempted" if ctx.preempted else "client_disconnected"
            root.set_attribute("error.type", reason)
            root.set_status(Status(StatusCode.ERROR, reason))
        elif status is not None and status >= 500:
            root.set_attribute("error.type", str(status))
            root.set_status(Status(StatusCode.ERROR))
        root.end()


def _record(span: Span, exc: BaseException) -> None:
    if isinstance(exc, GatewayError):
        span.set_attribute("error.type", exc.code)
        span.set_status(Status(StatusCode.ERROR, exc.code))
        return
    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    if not isinstance(exc, Exception):  # a cancellation (client gone, shutdown): no stack trace to keep
        return
    span.record_exception(exc)
