"""A tiny OTLP/HTTP endpoint that takes traces and keeps nothing but counts: what the gateway exports to in
`bench.gateway --otel` (the exporter's cost measured without a collector's) and in tests/gateway/test_tracing.py.

    python -m bench.otlp_sink [--port 4318]

It answers every `POST /v1/traces` with 200 and an empty ExportTraceServiceResponse (a valid protobuf).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OtlpSink:
    """Serve on 127.0.0.1 in a thread; `posts` and `bytes` count what arrived on /v1/traces, and `spans` the
    spans in it when `count_spans` (each export decoded: opentelemetry-proto, installed with the exporter).
    `cpu`: the core its threads run on (the bench keeps the decoding off the measured gateway's core)."""

    def __init__(self, port: int = 0, *, count_spans: bool = False, cpu: int | None = None) -> None:
        sink = self
        self.posts = 0
        self.bytes = 0
        self.spans = 0
        self.count_spans = count_spans
        self.cpu = cpu
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                spans = _spans(body) if sink.count_spans else 0
                with sink.lock:
                    sink.posts += 1
                    sink.bytes += len(body)
                    sink.spans += spans
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        if self.cpu is not None:  # this thread's, inherited by the threads it starts (one per connection)
            os.sched_setaffinity(0, {self.cpu})
        self.server.serve_forever()

    def start(self) -> OtlpSink:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _spans(body: bytes) -> int:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest.FromString(body)
    return sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=4318)
    sink = OtlpSink(parser.parse_args().port, count_spans=True)
    print(f"OTLP sink on {sink.url}/v1/traces", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        sink.server.serve_forever()
    print(f"{sink.posts} exports, {sink.spans} spans, {sink.bytes} bytes")


if __name__ == "__main__":
    main()
