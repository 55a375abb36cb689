"""Faulty drafters cost speed, never correctness: output unchanged, request completes, fault counted."""

import math

import grpc
import pytest

from shared.protocol import common_pb2, verifier_pb2_grpc
from verifier_service.server import VerifierServer
from verifier_service.settings import VerifierSettings

from .conftest import CLOSE, STALL, ScriptedDrafter, Servers, chain, generate, q_row, request

PROMPT = [3, 14, 15, 92, 65]
GOOD_Q = {1: 0.5, 2: 0.5}


def bad_q(kind):
    return {
        "nan_q": q_row({1: math.nan, 2: 0.5}),
        "negative_q": q_row({1: -0.25, 2: 1.25}),
        "unnormalised_q": q_row({1: 0.5, 2: 0.4}),
        "drafted_token_missing": q_row({2: 1.0}),
        "q_id_out_of_range": q_row({1: 0.5, 500: 0.5}),
    }[kind]


FAULTS = {
    "nan_q": lambda s: chain(s, [1], [bad_q("nan_q")]),
    "negative_q": lambda s: chain(s, [1], [bad_q("negative_q")]),
    "unnormalised_q": lambda s: chain(s, [1], [bad_q("unnormalised_q")]),
    "drafted_token_missing": lambda s: chain(s, [1], [bad_q("drafted_token_missing")]),
    "q_id_out_of_range": lambda s: chain(s, [1], [bad_q("q_id_out_of_range")]),
    "token_out_of_range": lambda s: chain(s, [97]),
    "wrong_round_id": lambda s: chain(s, [1], round_id=s.round_id + 5),
    "wrong_base_length": lambda s: chain(s, [1], base_length=len(s.tokens) + 1),
    "too_long": lambda s: chain(s, [1] * 9),
    "q_rows_count": lambda s: chain(s, [1, 2], [q_row(GOOD_Q)]),
    "none_source_with_drafts": lambda s: chain(s, [1], source=common_pb2.DRAFT_SOURCE_NONE),
}


@pytest.mark.parametrize("kind", sorted(FAULTS))
@pytest.mark.parametrize("mode", [common_pb2.MODE_EXACT, common_pb2.MODE_PROBABILISTIC])
async def test_malformed_chains_are_dropped(servers, tiny_model, kind, mode):
    # a chain for a later round waits in the queue, so each round waits out its deadline: short here
    deadline = {"drafter_deadline_ms": 100.0} if kind == "wrong_round_id" else {}
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(FAULTS[kind]), max_draft_tokens=4, **deadline,
                               probabilistic_drafters="any")  # (probabilistic chains checked as such)
    req = request(PROMPT, 6, temperature=0.9, seed=11, mode=mode)
    tokens, final, rounds = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert tokens == plain
    assert final.stats.drafter_faults >= 6  # one dropped chain per round
    assert final.stats.retained == 0 and all(r.retained == 0 for r in rounds)


@pytest.mark.parametrize("link", ["grpc", "local"])
async def test_a_stalled_drafter_costs_plain_rounds(servers, tiny_model, link):
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(lambda s: STALL), drafter_deadline_ms=30, link=link)
    req = request(PROMPT, 5, temperature=0.9, seed=3)
    tokens, final, rounds = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert tokens == plain
    assert final.stats.drafter_faults >= 5
    assert all(25 <= r.draft_wait_ms < 1000 for r in rounds)


@pytest.mark.parametrize("link", ["grpc", "local"])
async def test_stream_closed_mid_request_resyncs_and_completes(servers, tiny_model, link):
    def propose(state):
        if drafter.sessions.index(state) == 0 and state.round_id == 2:
            return CLOSE
        return chain(state, [1])

    drafter = ScriptedDrafter(propose)
    stub = await servers.start(tiny_model, drafter=drafter, link=link)
    req = request(PROMPT, 8, temperature=0.9, seed=5)
    tokens, final, _ = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert tokens == plain and final.finish_reason == "length"
    assert final.stats.drafter_faults >= 1
    assert len(drafter.sessions) == 2  # the verifier re-opened the stream with the full context
    reopened = drafter.sessions[1]
    assert reopened.tokens[: len(PROMPT)] == PROMPT and len(reopened.tokens) > len(PROMPT)


async def test_unreachable_drafter_decodes_plainly(tiny_model):
    servers = Servers()
    try:
        servers.verifier = VerifierServer(VerifierSettings(port=0, drafter="127.0.0.1:1"), model=tiny_model)
        port = await servers.verifier.start()
        await servers.verifier.wait_loaded()
        servers.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = verifier_pb2_grpc.VerifierStub(servers.channel)
        tokens, final, _ = await generate(stub, request(PROMPT, 4))
        assert len(tokens) == 4 and final.finish_reason == "length"
    finally:
        await servers.stop()


def test_the_drafter_channel_reconnects_within_the_links_backoff():
    """gRPC's default reconnect backoff grows to 120 s, so a drafter that came up after the
    verifier went unused for up to two minutes; the drafter channel caps it at the link's own
    re-sync backoff."""
    from verifier_service.drafter_link import CHANNEL_OPTIONS, RESYNC_BACKOFF_S

    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.max_reconnect_backoff_ms"] <= RESYNC_BACKOFF_S[1] * 1000
    assert options["grpc.initial_reconnect_backoff_ms"] <= 1000
