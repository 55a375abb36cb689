"""Spans recorded whole at their end (shared/light_spans.py): what the exporter gets is what the
SDK's own span would have given, and the parent's sampling decision holds. A provider of the
test's own (not installed globally: tests/observability needs the process's first bootstrap)."""

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import StatusCode

from shared.light_spans import LightSpan, Recorder, start_light_span


@pytest.fixture
def recorded():
    """(the provider, its recorder for light spans, the exporter both end in)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "light-test"}))
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    return provider, Recorder(provider.resource, processor), exporter


def fields(span):
    return (span.name, span.context.trace_id, span.parent.span_id, dict(span.attributes), span.status.status_code,
            [(e.name, dict(e.attributes)) for e in span.events], span.start_time, span.end_time,
            span.resource.attributes["service.name"], span.instrumentation_scope.name, span.kind)


def test_the_exporter_gets_what_the_sdk_span_gives(recorded):
    provider, recorder, exporter = recorded
    parent = provider.get_tracer("tandem.verifier").start_span("Generate")
    attributes = {"tandem.source": "MTP", "tandem.accepted": 3, "tandem.confidences": [0.9, 0.5], "tandem.ms": 1.5}
    spans = []
    for light in (False, True):
        if light:
            span = start_light_span(recorder, "tandem.verifier", "round", parent, {"tandem.round_id": 7}, start_time=1000)
            assert isinstance(span, LightSpan)
        else:
            span = provider.get_tracer("tandem.verifier").start_span(
                "round", context=trace.set_span_in_context(parent), attributes={"tandem.round_id": 7}, start_time=1000)
        with trace.use_span(span, end_on_exit=False):  # (its children, and what a message to the drafter carries)
            assert trace.get_current_span().get_span_context() == span.get_span_context()
        span.set_attributes(attributes)
        span.set_attribute("tandem.emitted", 4)
        span.set_status(StatusCode.ERROR, "late")
        span.record_exception(ValueError("bad chain"))
        span.end(end_time=5000)
        span.set_attribute("tandem.after_end", 1)  # (ignored by both)
        span.end(end_time=9000)  # (once)
        spans.append(span)
    sdk, light = exporter.get_finished_spans()
    assert fields(light)[:5] == fields(sdk)[:5]
    assert [name for name, _ in fields(light)[5]] == [name for name, _ in fields(sdk)[5]] == ["exception"]
    assert fields(light)[5][0][1]["exception.type"] == "ValueError"
    assert fields(light)[6:] == fields(sdk)[6:]
    assert light.context.span_id not in (sdk.context.span_id, parent.get_span_context().span_id)
    assert light.context.trace_flags.sampled and not light.context.is_remote


def test_a_parent_carried_by_a_message_is_the_parent(recorded):
    provider, recorder, exporter = recorded
    parent = provider.get_tracer("v").start_span("round")
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(parent))
    span = start_light_span(recorder, "tandem.drafter", "propose", propagate.extract(carrier))
    span.end()
    (propose,) = exporter.get_finished_spans()
    assert propose.parent.span_id == parent.get_span_context().span_id
    assert propose.context.trace_id == parent.get_span_context().trace_id


def test_a_parent_not_sampled_carries_the_trace_and_records_nothing(recorded):
    _, recorder, exporter = recorded
    unsampled = TracerProvider(sampler=ALWAYS_OFF).get_tracer("v").start_span("Generate")
    assert unsampled.get_span_context().is_valid and not unsampled.get_span_context().trace_flags.sampled
    span = start_light_span(recorder, "tandem.verifier", "round", unsampled)
    assert not span.is_recording() and not isinstance(span, LightSpan)
    context = span.get_span_context()
    assert context.trace_id == unsampled.get_span_context().trace_id and not context.trace_flags.sampled
    assert context.span_id != unsampled.get_span_context().span_id
    span.set_attribute("tandem.x", 1)
    span.end()
    assert not exporter.get_finished_spans()


def test_without_a_recorder_or_a_parent_the_sdk_makes_the_span(recorded):
    provider, recorder, exporter = recorded
    parent = provider.get_tracer("v").start_span("Generate")
    assert not isinstance(start_light_span(None, "tandem.verifier", "round", parent), LightSpan)
    assert not isinstance(start_light_span(recorder, "tandem.drafter", "propose", None), LightSpan)
    assert not exporter.get_finished_spans()  # (those went to the process's provider, not this one)
