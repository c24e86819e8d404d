"""OpenTelemetry traces of the request path, off unless the standard `OTEL_*` variables ask for them.

With `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER=console`)
set and the `otel` extra installed, the gateway exports one server span per `/v1/*completions` request with a
child span per pipeline step, and sends the W3C `traceparent` of its upstream span to the backend (vLLM's own
tracing joins the trace). The SDK is configured from the environment the standard way (`OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_EXPORTER_OTLP_*`, `OTEL_BSP_*`); `OTEL_SDK_DISABLED=true`
or `OTEL_TRACES_EXPORTER=none` turns it off.

This module imports nothing of OpenTelemetry: when tracing is off the gateway's tracer is None, each request's
`ctx.trace` stays None and the request path tests that and calls nothing (no import, no object, no call per
step). The live implementation is `apps.gateway.tracing_otel`, imported only when tracing is on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from apps.gateway.tracing_otel import GatewayTracer, RequestTrace

__all__ = ["GatewayTracer", "RequestTrace", "tracer_from_env", "tracing_requested"]

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracing_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces: an OTLP endpoint (or an explicit traces exporter other than
    `none`), and the SDK not disabled."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter) or any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def tracer_from_env() -> GatewayTracer | None:
    """The gateway's tracer as the environment (`os.environ`, which the SDK reads too) configures it, or None
    (tracing off: the default). Asked for without the packages installed, it says so and stays off rather
    than failing the gateway's start."""
    if not tracing_requested():
        return None
    try:
        from apps.gateway.tracing_otel import GatewayTracer, build_provider
    except ImportError as exc:
        logger.warning("OTEL_* asks for traces but OpenTelemetry is not installed (pip install 'tokenpools[otel]'): "
                       "%s; tracing stays off", exc)
        return None
    return GatewayTracer(build_provider())
