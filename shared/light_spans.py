"""Spans recorded whole at their end: a round's span for a few µs rather than the SDK's tens.

A speculative round runs on the event loop between two steps of the device, and the OTel SDK's
`start_span` + attributes + `end` cost tens of µs of it (the sampler, bounded attributes under a
lock, the processor's hooks; measured in docs/PERFORMANCE.md) — a round's whole host budget on
a GPU is a few hundred. A `LightSpan` is an API span that holds its context (the trace's id and
a new span id, so children and the drafter's spans hang under it while it runs), its attributes
in a plain dict and its times, and hands the finished span to the span processor that
shared/telemetry.py installed, once, at its end: what the exporter gets is what the SDK's span
would have given (name, ids, parent, attributes, status, events, times, resource, scope).

It follows its parent's sampling decision (a parent not sampled: a context that carries the
trace on, nothing recorded), as the default ParentBased sampler does; without a parent, and
wherever shared/telemetry.py did not install the provider, the SDK's own span is made instead.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)


class Recorder:
    """Where finished light spans go: the installed provider's resource and span processor."""

    def __init__(self, resource, processor) -> None:
        self.resource, self.processor = resource, processor
        self._scopes: dict[str, InstrumentationScope] = {}

    def scope(self, name: str) -> InstrumentationScope:
        scope = self._scopes.get(name)
        if scope is None:
            scope = self._scopes[name] = InstrumentationScope(name)
        return scope


class LightSpan(trace.Span):
    def __init__(self, recorder: Recorder, scope: InstrumentationScope, name: str, context: SpanContext,
                 parent: SpanContext, attributes: Mapping | None, start_time: int | None) -> None:
        self._recorder, self._scope, self._name = recorder, scope, name
        self._context, self._parent = context, parent
        self._attributes = dict(attributes) if attributes else {}
        self._events: list[Event] = []
        self._status = Status(StatusCode.UNSET)
        self._start = start_time if start_time is not None else time.time_ns()
        self._recording = True

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._recording

    def set_attribute(self, key: str, value) -> None:
        if self._recording:
            self._attributes[key] = tuple(value) if isinstance(value, list) else value

    def set_attributes(self, attributes: Mapping) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping | None = None, timestamp: int | None = None) -> None:
        if self._recording:
            self._events.append(Event(name, attributes or {}, timestamp if timestamp is not None else time.time_ns()))

    def update_name(self, name: str) -> None:
        if self._recording:
            self._name = name

    def set_status(self, status, description: str | None = None) -> None:
        if self._recording:
            self._status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(self, exception: BaseException, attributes: Mapping | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        self.add_event("exception", {"exception.type": type(exception).__name__, "exception.message": str(exception),
                                     "exception.escaped": escaped, **(attributes or {})}, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if not self._recording:
            return
        self._recording = False
        self._recorder.processor.on_end(ReadableSpan(
            name=self._name, context=self._context, parent=self._parent, resource=self._recorder.resource,
            attributes=self._attributes, events=tuple(self._events), status=self._status, start_time=self._start,
            end_time=end_time if end_time is not None else time.time_ns(), instrumentation_scope=self._scope))


def start_light_span(recorder: Recorder | None, scope: str, name: str, parent: trace.Span | Context | None,
                     attributes: Mapping | None = None, start_time: int | None = None) -> trace.Span:
    """A child of `parent` (a span, or the context a message carried) named `name`: recorded whole
    at its end where it may be; see the module's note."""
    if isinstance(parent, trace.Span):
        parent_context = parent.get_span_context()
    else:
        parent_context = trace.get_current_span(parent).get_span_context() if parent is not None else None
    if recorder is None or parent_context is None or not parent_context.is_valid:
        context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        return trace.get_tracer(scope).start_span(name, context=context, attributes=attributes, start_time=start_time)
    span_id = random.getrandbits(64) or 1
    if not parent_context.trace_flags.sampled:  # (the trace goes on, nothing is recorded)
        return trace.NonRecordingSpan(SpanContext(parent_context.trace_id, span_id, is_remote=False,
                                                  trace_flags=NOT_SAMPLED, trace_state=parent_context.trace_state))
    context = SpanContext(parent_context.trace_id, span_id, is_remote=False, trace_flags=SAMPLED,
                          trace_state=parent_context.trace_state)
    return LightSpan(recorder, recorder.scope(scope), name, context, parent_context, attributes, start_time)
