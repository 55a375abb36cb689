"""OpenTelemetry bootstrap, one per process, from the standard OTEL_* environment variables.

- OTEL_SDK_DISABLED=true, or no exporter configured → no tracer provider is installed and
  every span is the API's no-op (tracing off costs nothing measurable).
- OTEL_TRACES_EXPORTER: `otlp` (default when OTEL_EXPORTER_OTLP_ENDPOINT is set; protocol
  from OTEL_EXPORTER_OTLP_PROTOCOL / OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc or
  http/protobuf), `console` (local debugging), or `none`.
- OTEL_SERVICE_NAME names the service (default: the service's own name); the sampler comes
  from OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, read by the SDK itself.
- gRPC instrumentation (client and server, asyncio) is registered here, before any server or
  channel exists; it carries trace context in gRPC metadata.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, MutableMapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter

from shared import light_spans
from shared.light_spans import Recorder

_recorder: Recorder | None = None  # (set by setup_tracing: where light spans go)


def _exporter(environ: Mapping[str, str]) -> SpanExporter | None:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    kind = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not kind:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        kind = "otlp" if endpoint else "none"
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "otlp":
        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    raise ValueError(f"OTEL_TRACES_EXPORTER {kind!r} is not supported here (otlp, console or none)")


def setup_tracing(service_name: str, *, exporter: SpanExporter | None = None, environ=None) -> bool:
    """Install the tracer provider (once per process) and the gRPC instrumentation.

    `exporter` overrides the environment (tests pass an InMemorySpanExporter). Returns
    whether tracing is on.
    """
    environ = os.environ if environ is None else environ
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return True  # already bootstrapped in this process
    chosen = exporter or _exporter(environ)
    if chosen is None:
        return False
    name = environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    processor = SimpleSpanProcessor(chosen) if exporter is not None else BatchSpanProcessor(chosen)
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    global _recorder
    _recorder = Recorder(provider.resource, processor)
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer

    GrpcAioInstrumentorServer().instrument()
    GrpcAioInstrumentorClient().instrument()
    return True


def shutdown_tracing() -> None:
    """Flush pending spans (batch processor) before the process exits."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def start_light_span(scope: str, name: str, parent: trace.Span | context.Context | None,
                     attributes: Mapping | None = None, start_time: int | None = None) -> trace.Span:
    """A span on a hot path (a round's; the drafter's answer to one): recorded whole at its end,
    for a few µs rather than the SDK's tens (shared/light_spans.py); the same span to the exporter."""
    return light_spans.start_light_span(_recorder, scope, name, parent, attributes, start_time)


def use_span(span: trace.Span):
    """A context manager making `span` current without ending it (the caller ends it); nothing
    to do for the no-op span of tracing off (a round's way passes here twice)."""
    if not traced(span):
        return contextlib.nullcontext()
    return trace.use_span(span, end_on_exit=False)


def traced(span: trace.Span) -> bool:
    """Whether `span` belongs to a trace: False for the no-op span of tracing off (a span
    not sampled still carries its trace's context to its children and the drafter)."""
    return span.get_span_context().is_valid


def set_span_in_context(span: trace.Span) -> context.Context:
    """A context whose current span is `span` (the parent of a span started in another task)."""
    return trace.set_span_in_context(span)


def inject_context(carrier: MutableMapping[str, str]) -> None:
    """Write the current span's context into a string map (carried per stream message)."""
    propagate.inject(carrier)


def extract_context(carrier: Mapping[str, str]) -> context.Context:
    return propagate.extract(dict(carrier))
