"""Records (DESIGN §9): every finished request that may draft sends the drafter its output, its
rounds drafted or not, so the drafter's index of outputs learns from requests decoded plainly
too; a record is a background hint that costs the request nothing when the drafter does not
take it."""

from __future__ import annotations

import asyncio

import pytest

import verifier_service.records as records_module
from shared.metrics import VerifierMetrics
from shared.protocol import RECORD_PROMPT_END, drafter_pb2, drafter_pb2_grpc
from verifier_service.governor import Load
from verifier_service.records import Recorder, record_request

from .conftest import ScriptedDrafter, chain, generate, request

PROMPT = [3, 14, 15, 92, 65]


async def records_of(drafter: ScriptedDrafter, count: int) -> list[drafter_pb2.RecordRequest]:
    """The drafter's records once `count` have arrived (they are sent after the request's end)."""
    for _ in range(200):
        if len(drafter.records) >= count:
            break
        await asyncio.sleep(0.01)
    return drafter.records


def recorded(servers, outcome: str) -> float:
    return servers.verifier.service.metrics.registry.get_sample_value(
        "tandem_verifier_drafter_records_total", {"outcome": outcome}) or 0.0


async def test_a_request_decoded_plainly_is_recorded_whole(servers, tiny_model, greedy_continuation):
    """The server learnt that speculation does not pay: the request never opens a stream, and the
    drafter learns its output all the same."""
    drafter = ScriptedDrafter(lambda s: chain(s, greedy_continuation(tiny_model, s.tokens, 2)))
    stub = await servers.start(tiny_model, drafter=drafter, governor=True, max_draft_tokens=2)
    ledger = servers.verifier.service.ledgers[Load.ALONE, False]
    for _ in range(64):  # (30 ms a token speculating against 3 ms plain)
        ledger.speculative.add(0.030, 1)
        ledger.plain.add(0.003, 1)
    tokens, final, _ = await generate(stub, request(PROMPT, 12))
    assert final.stats.speculative_rounds == 0 and not drafter.sessions
    (record,) = await records_of(drafter, 1)
    assert list(record.prompt_end_ids) == PROMPT
    assert list(record.output_ids[: len(tokens)]) == tokens and len(record.output_ids) <= len(tokens) + 1  # (+ an eos)
    assert record.session_id  # (its trace context: tests/observability/test_tracing.py)
    await servers.verifier.service.recorder.drain()  # (counted once the drafter's answer is back, after it has the record)
    assert recorded(servers, "recorded") == 1


async def test_a_request_that_drafted_is_recorded_once_and_one_without_a_drafter_not_at_all(
        servers, tiny_model, greedy_continuation):
    drafter = ScriptedDrafter(lambda s: chain(s, greedy_continuation(tiny_model, s.tokens, 2)))
    stub = await servers.start(tiny_model, drafter=drafter, max_draft_tokens=2)
    prompt = list(range(1, 81))  # longer than a record's prompt end
    tokens, final, _ = await generate(stub, request(prompt, 10))
    assert final.stats.speculative_rounds == final.stats.rounds > 0
    (record,) = await records_of(drafter, 1)
    assert list(record.prompt_end_ids) == prompt[-RECORD_PROMPT_END:]
    assert list(record.output_ids[: len(tokens)]) == tokens
    await generate(stub, request(PROMPT, 6, disable=True))  # speculation off: no drafter at all
    await asyncio.sleep(0.1)
    assert len(drafter.records) == 1


async def test_a_drafter_without_records_costs_the_requests_nothing(servers, tiny_model, greedy_continuation):
    class Unrecording(ScriptedDrafter):
        Record = drafter_pb2_grpc.DrafterServicer.Record  # (UNIMPLEMENTED, as an older drafter answers)

    drafter = Unrecording(lambda s: chain(s, greedy_continuation(tiny_model, s.tokens, 2)))
    stub = await servers.start(tiny_model, drafter=drafter, max_draft_tokens=2)
    for seed in range(3):
        tokens, final, _ = await generate(stub, request(PROMPT, 8, seed=seed))
        assert len(tokens) == 8 and final.finish_reason == "length"
    for _ in range(200):
        if recorded(servers, "failed") == 3:
            break
        await asyncio.sleep(0.01)
    assert recorded(servers, "failed") == 3 and recorded(servers, "recorded") == 0


async def test_records_in_flight_are_bounded_and_a_drain_waits_for_them(monkeypatch):
    """A drafter that never answers: at most MAX_IN_FLIGHT records wait (the rest are dropped and
    counted), and a drain gives up on them after its timeout."""
    monkeypatch.setattr(records_module, "MAX_IN_FLIGHT", 2)
    answered: list[str] = []

    class Stalling:
        async def Record(self, request, timeout, metadata):
            await asyncio.sleep(10 if request.session_id != "quick" else 0)
            answered.append(request.session_id)

    metrics = VerifierMetrics()
    recorder = Recorder(Stalling(), (), metrics)
    for name in ("a", "b", "c"):
        recorder.record(record_request(name, PROMPT, [1, 2], {}))
    assert metrics.registry.get_sample_value("tandem_verifier_drafter_records_total", {"outcome": "dropped"}) == 1
    await recorder.drain(timeout_s=0.05)
    await asyncio.sleep(0)
    assert answered == [] and not recorder._in_flight
    recorder.record(record_request("quick", PROMPT, [1, 2], {}))
    await recorder.drain()
    assert answered == ["quick"]
    assert metrics.registry.get_sample_value("tandem_verifier_drafter_records_total", {"outcome": "recorded"}) == 1


@pytest.mark.parametrize("prompt", [[5], list(range(200))])
def test_a_record_carries_the_prompt_s_end_and_the_output(prompt):
    message = record_request("r", prompt, [7, 8], {"traceparent": "x"})
    assert list(message.prompt_end_ids) == prompt[-RECORD_PROMPT_END:] and list(message.output_ids) == [7, 8]
    assert message.session_id == "r" and dict(message.trace_context) == {"traceparent": "x"}
