"""structlog configuration shared by both services.

JSON lines by default; human-readable console rendering when stderr is a terminal. Every line
carries the bound request id (contextvars) and, inside a span, its trace_id and span_id.
The level comes from TANDEM_LOG_LEVEL (debug, info, warning, error; default info).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
from opentelemetry import trace

LEVEL_ENV = "TANDEM_LOG_LEVEL"


def _add_trace_ids(logger, method_name, event_dict):
    span = trace.get_current_span()
    ctx = span.get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


def configure_logging(environ=None, stream=None) -> None:
    environ = os.environ if environ is None else environ
    stream = stream or sys.stderr
    name = environ.get(LEVEL_ENV, "info").strip().lower()
    level = logging.getLevelNamesMapping().get(name.upper())
    if level is None:
        raise ValueError(f"{LEVEL_ENV} {name!r} must be one of debug, info, warning, error")
    renderer = structlog.dev.ConsoleRenderer() if stream.isatty() else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
