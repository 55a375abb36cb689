"""A trace collector for benchmarks: an OTLP/gRPC TraceService on a free local port that counts
what the services export to it and keeps nothing (what tracing costs a service is its spans'
recording and export, the collector's own work is another process's). It serves from threads of
its own: a service's last export comes while it stops, when the bench's event loop may be
blocked waiting for it."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from .common import free_port


class TraceSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.port = free_port()
        self.spans = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def env(self, traced: bool) -> dict[str, str]:
        """A service's variables (shared/telemetry.py reads the OTEL_* ones): its traces exported
        here, or (traced False) none exported at all."""
        if not traced:
            return {"OTEL_SDK_DISABLED": "true"}
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}", "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SDK_DISABLED": "false"}

    def start(self) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)

    def Export(self, request, context):  # noqa: N802 (the service's method name)
        spans = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
        with self._lock:
            self.bytes += request.ByteSize()
            self.spans += spans
        return trace_service_pb2.ExportTraceServiceResponse()
