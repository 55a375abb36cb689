"""Prometheus /metrics of both services, scraped over HTTP; structlog JSON lines."""

import io
import json
import urllib.request

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from shared import telemetry
from shared.logs import configure_logging

from ..drafter_service.conftest import Pair
from ..verifier_service.conftest import generate, request


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_metrics_are_scrapable_and_match_the_request(tiny_mtp_model, free_port):
    pair = Pair()
    vport, dport = free_port(), free_port()
    try:
        stub = await pair.start(tiny_mtp_model, drafter_settings={"planner": "mtp", "metrics_port": dport},
                                metrics_port=vport)
        tokens, final, rounds = await generate(stub, request([3, 14, 15, 92, 65], 10, temperature=0.8, seed=2))
        v = scrape(vport)
        d = scrape(dport)
    finally:
        await pair.stop()
    assert v[("tandem_verifier_completion_tokens_total", ())] == len(tokens) == 10
    assert v[("tandem_verifier_requests_total", (("finish_reason", "length"),))] == 1
    assert v[("tandem_verifier_drafts_total", (("outcome", "retained"), ("source", "MTP")))] == final.stats.retained
    assert v[("tandem_verifier_drafts_total", (("outcome", "accepted"), ("source", "MTP")))] == final.stats.accepted
    assert v[("tandem_verifier_accepted_length_count", ())] == final.stats.rounds
    assert v[("tandem_verifier_accepted_length_sum", ())] >= len(tokens)
    assert v[("tandem_verifier_round_seconds_count", ())] == final.stats.rounds
    assert v[("tandem_verifier_ttft_seconds_count", ())] == 1
    assert v[("tandem_verifier_active_sessions", ())] == 0
    assert ("tandem_verifier_expert_slot_hit_rate", ()) in v
    engine = {state: v[("tandem_verifier_engine_seconds_total", (("state", state),))]
              for state in ("step", "job", "gather", "idle", "other")}
    assert engine["step"] > 0 and engine["job"] > 0  # (its rounds' steps; loading, its prefill)
    assert all(seconds >= 0 for seconds in engine.values())
    proposals = sum(value for (name, _), value in d.items() if name == "tandem_drafter_proposals_total")
    assert proposals >= final.stats.rounds - 1
    assert d[("tandem_drafter_draft_tokens_total", (("source", "MTP"),))] >= final.stats.proposed


def test_json_log_lines_carry_trace_and_request_ids():
    stream = io.StringIO()
    configure_logging(environ={"TANDEM_LOG_LEVEL": "info"}, stream=stream)
    try:
        log = structlog.get_logger("test")
        structlog.contextvars.bind_contextvars(request_id="req-42")
        with telemetry.tracer("test").start_as_current_span("work"):
            log.info("inside a span", tokens=3)
        log.debug("filtered out at info level")
        structlog.contextvars.unbind_contextvars("request_id")
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert len(lines) == 1
        line = lines[0]
        assert line["event"] == "inside a span" and line["request_id"] == "req-42" and line["level"] == "info"
        if telemetry.trace.get_current_span() is not None and "trace_id" in line:  # tracing installed
            assert len(line["trace_id"]) == 32 and len(line["span_id"]) == 16
    finally:
        structlog.reset_defaults()


def test_bad_log_level_is_refused():
    with pytest.raises(ValueError, match="TANDEM_LOG_LEVEL 'loud'"):
        configure_logging(environ={"TANDEM_LOG_LEVEL": "loud"}, stream=io.StringIO())
