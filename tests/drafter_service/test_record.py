"""Record (DESIGN §9): a finished request's output joins the drafter's index of outputs — from
its record only, so a request whose rounds drafted counts once, and one decoded plainly counts
too; bad records are refused naming the field."""

from __future__ import annotations

import asyncio

import grpc
import pytest

import drafter_service.drafter as drafter_module
from drafter_service.proposers.global_index import GlobalIndex
from drafter_service.proposers.suffix import MAX_MATCH
from shared.protocol import PROTOCOL_VERSION, RECORD_PROMPT_END, drafter_pb2, drafter_pb2_grpc

PROMPT = [7, 8, 9, 10, 11] * 14  # longer than the prompt end a record carries
OUTPUT = [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24] * 3


def record(output=OUTPUT, prompt_end=PROMPT[-RECORD_PROMPT_END:], session_id="r") -> drafter_pb2.RecordRequest:
    return drafter_pb2.RecordRequest(protocol_version=PROTOCOL_VERSION, session_id=session_id,
                                     prompt_end_ids=prompt_end, output_ids=output)


async def settled(service) -> GlobalIndex:
    """The index once the additions in steps (between other work on the loop) are done."""
    for _ in range(200):
        if not service._background:
            break
        await asyncio.sleep(0.01)
    return service.drafter.global_index


async def test_a_recorded_output_joins_the_index_in_steps(tiny_mtp_model, monkeypatch, serve_drafter):
    monkeypatch.setattr(drafter_module, "LOOP_COUNT", 2)  # so the output takes several steps
    async with serve_drafter(tiny_mtp_model, "suffix") as (server, channel):
        reply = await drafter_pb2_grpc.DrafterStub(channel).Record(record())
        assert reply.protocol_version == PROTOCOL_VERSION
        index = await settled(server.service)
        expected = GlobalIndex(1 << 20)
        lead = min(RECORD_PROMPT_END, MAX_MATCH)  # (the prompt's last tokens count as contexts only)
        expected.add(PROMPT[len(PROMPT) - lead:] + OUTPUT, lead)
        assert len(index) == len(expected) > 0
        registry = server.service.metrics.registry
        assert registry.get_sample_value("tandem_drafter_global_index_bytes") == index.nbytes > 0
        assert registry.get_sample_value("tandem_drafter_global_index_requests") == index.requests == 1
        assert registry.get_sample_value("tandem_drafter_records_total") == 1


async def test_a_request_that_drafted_counts_once_from_its_record(tiny_mtp_model, open_up, commit_up, serve_drafter):
    """Its stream's end adds nothing (the stream heard only the rounds that drafted); its record adds
    the whole output. Before records, the stream's end added what it heard: a request that went
    plain for its last rounds left its index entry short of them."""
    async with serve_drafter(tiny_mtp_model, "suffix") as (server, channel):
        stub = drafter_pb2_grpc.DrafterStub(channel)
        call = stub.Draft()
        await call.write(open_up(tiny_mtp_model, PROMPT, max_draft_tokens=4))
        await call.read()
        for round_id, token in enumerate(OUTPUT[:3]):
            await call.write(commit_up(tiny_mtp_model, round_id=round_id, emitted=[token]))
            await call.read()
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        for _ in range(50):  # (the server's side of the stream ends after the client's)
            if not server.service.streams_by_peer:
                break
            await asyncio.sleep(0.01)
        assert len(await settled(server.service)) == 0
        await stub.Record(record())
        index = await settled(server.service)
        assert index.requests == 1 and len(index) > 0


@pytest.mark.parametrize("fields,named", [
    ({"session_id": "x" * 200}, "record.session_id"),
    ({"prompt_end": PROMPT}, "record.prompt_end_ids"),
    ({"output": [1] * 10_000}, "record.output_ids"),
    ({"output": [3, 4, 1 << 20]}, "record.output_ids[2]"),
    ({"prompt_end": [-1 & 0xFFFFFFFF]}, "record.prompt_end_ids[0]"),
])
async def test_bad_records_are_refused_naming_the_field(tiny_mtp_model, serve_drafter, fields, named):
    async with serve_drafter(tiny_mtp_model, "suffix") as (server, channel):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await drafter_pb2_grpc.DrafterStub(channel).Record(record(**fields))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert named in refused.value.details()
        assert len(await settled(server.service)) == 0


async def test_a_drafter_with_a_token_refuses_records_without_it(tiny_mtp_model, serve_drafter):
    async with serve_drafter(tiny_mtp_model, "suffix", auth_token="s3cret") as (server, channel):
        stub = drafter_pb2_grpc.DrafterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Record(record())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await stub.Record(record(), metadata=(("authorization", "Bearer s3cret"),))
        assert (await settled(server.service)).requests == 1
