"""The drafter (and the client) are untrusted (issue 12): a drafter that floods chains cannot
grow the verifier's memory, an outage does not end drafting for the rest of a request, and
malformed, oversized or slow-to-tokenise requests neither crash nor stall the verifier."""

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.protocol import PROTOCOL_VERSION, common_pb2, drafter_pb2
from verifier_service import drafter_link
from verifier_service.drafter_link import MAX_QUEUED_CHAINS, DeadlineTracker, DrafterLink
from verifier_service.settings import VerifierSettings

from .conftest import CLOSE, ScriptedDrafter, chain, generate, q_row, request

PROMPT = [3, 14, 15, 92, 65]


class Flooder(ScriptedDrafter):
    def __init__(self, burst: int):
        super().__init__(lambda state: None)
        self.burst = burst

    async def Draft(self, request_iterator, context):
        async for up in request_iterator:
            if up.HasField("open"):
                tokens, round_id = list(up.open.token_ids), up.open.next_round_id
            else:
                tokens += list(up.commit.emitted_token_ids)
                round_id = up.commit.round_id + 1
            for i in range(self.burst):
                yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=drafter_pb2.DraftChain(
                    round_id=round_id + i % 3, base_length=len(tokens), token_ids=[1, 2], confidences=[1.0, 1.0],
                    source=1))


def test_the_chain_queue_is_bounded_and_drops_the_oldest():
    link = DrafterLink(stub=None, deadlines=DeadlineTracker(VerifierSettings()))
    link.next_round = 5
    for i in range(10_000):
        link.deliver(drafter_pb2.DraftChain(round_id=4 + i % 3, token_ids=[1]))
    assert len(link.chains) == MAX_QUEUED_CHAINS
    assert link.faults["stale_chain"] == 3334  # round 4 < the next round: dropped on arrival
    assert link.faults["chain_overflow"] == 10_000 - 3334 - MAX_QUEUED_CHAINS
    kept = [chain.round_id for chain in link.chains]
    assert all(r >= 5 for r in kept)  # the newest usable ones


@pytest.mark.parametrize("link", ["grpc", "local"])
async def test_a_flooding_drafter_costs_nothing_but_its_chains(servers, tiny_model, link):
    stub = await servers.start(tiny_model, drafter=Flooder(burst=500), max_draft_tokens=4, link=link)
    req = request(PROMPT, 12, temperature=0.9, seed=2)
    tokens, final, _ = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert tokens == plain and final.finish_reason == "length"
    assert final.stats.drafter_faults >= 400  # overflowing chains are counted, not kept


async def test_drafting_resumes_after_an_outage(servers, tiny_model, monkeypatch):
    monkeypatch.setattr(drafter_link, "RESYNC_BACKOFF_S", (0.001, 0.004))

    def propose(state):
        if drafter.sessions.index(state) < 6:  # the first six streams die at once: an outage
            return CLOSE
        return chain(state, [1])

    drafter = ScriptedDrafter(propose)
    stub = await servers.start(tiny_model, drafter=drafter, max_draft_tokens=2)
    req = request(PROMPT, 40, temperature=0.0, seed=1)
    tokens, final, rounds = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert tokens == plain
    assert len(drafter.sessions) >= 7  # more re-opens than the old limit of three
    assert any(r.retained > 0 for r in rounds[-5:])  # drafting is back by the end


# -- the verifier's own surface (items 6 and 7) ---------------------------------------------------


class SlowTokenizer:
    """Stands in for a tokenizer that takes a while on a long text."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.started = self.finished = 0  # encode calls begun and ended

    def encode(self, text):
        self.started += 1
        time.sleep(self.seconds)
        self.finished += 1
        return SimpleNamespace(ids=[1, 2, 3])

    def decode(self, ids):
        return ""


async def test_malformed_request_bytes_are_invalid_argument(servers, tiny_model):
    await servers.start(tiny_model)
    generate_raw = servers.channel.unary_stream("/tandem.v1.Verifier/Generate")  # no serializer: raw bytes
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in generate_raw(b"\xff\xff\xff\xff garbage"):
            pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed GenerateRequest" in error.value.details()


def test_a_maximal_valid_chain_fits_the_link_s_message_limit():
    """max_chain_bytes bounds every valid chain: 16 drafts, q rows of 1,024 pairs with the largest
    ids, every field at its widest, fit under it (and not by orders of magnitude)."""
    from verifier_service.chains import max_chain_bytes

    big = 2**32 - 1
    row = common_pb2.SparseRow(token_ids=[big - i for i in range(1024)], probs=[1 / 3] * 1024)
    chain_message = drafter_pb2.DraftChain(
        round_id=2**64 - 1, base_length=2**64 - 1, source=common_pb2.DRAFT_SOURCE_MTP, token_ids=[big] * 16,
        q_rows=[row] * 16, confidences=[0.5] * 16, assumed_token_ids=[big] * 17,
        costs=drafter_pb2.DrafterCosts(draft_ms=1e300, expert_slot_misses=big))
    size = drafter_pb2.DraftDown(protocol_version=2**32 - 1, chain=chain_message).ByteSize()
    assert size <= max_chain_bytes(16, 1024) <= 1.2 * size


def oversized(state, kind):
    drafts = [1, 2]
    if kind == "10,000 confidences":
        return chain(state, drafts, confidences=[1.0] * 10_000)
    if kind == "64 q rows for 2 drafts":
        return chain(state, drafts, q_rows=[q_row({1: 0.5, 2: 0.5})] * 64)
    # a message past the link's limit (16 drafts x 1,024 pairs): refused by gRPC unparsed
    return chain(state, drafts, q_rows=[q_row({t: 1 / 100_000 for t in range(100_000)})] * 2)


@pytest.mark.parametrize("link", ["grpc", "local"])
@pytest.mark.parametrize("kind", ["10,000 confidences", "64 q rows for 2 drafts", "a 2.6 MB message"])
async def test_oversized_chains_are_faults_and_cost_nothing_else(servers, tiny_model, kind, link):
    """Chains bigger than a valid one are dropped (a fault each; a message past the link's limit
    breaks the stream, which reopens): every round goes plain, the output is decoding's own."""
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(lambda state: oversized(state, kind)),
                               max_draft_tokens=4, drafter_deadline_ms=200.0, link=link)
    req = request(PROMPT, 5, temperature=0.9, seed=2)
    tokens, final, rounds = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert tokens == plain
    assert final.stats.drafter_faults >= 1 and final.stats.retained == 0


async def test_max_support_is_bounded_by_the_setting(servers, tiny_model):
    stub = await servers.start(tiny_model, max_support_limit=128)
    req = request(PROMPT, 4)
    req.sampling.max_support = 129
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(stub, req)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.max_support must lie in [0, max_support_limit = 128]" in error.value.details()
    req.sampling.max_support = 128
    tokens, _, _ = await generate(stub, req)
    assert len(tokens) == 4


@pytest.mark.parametrize("case", ["huge prompt_ids", "long schedule", "arabic digit", "long request_id"])
async def test_oversized_or_odd_values_are_refused_with_short_messages(servers, tiny_model, case):
    stub = await servers.start(tiny_model)
    req = request(PROMPT, 4)
    if case == "huge prompt_ids":
        req.prompt_ids.ids.extend([1] * 2_000_000)
    elif case == "long schedule":
        req.speculation.retention.schedule = "0.1," * 1000 + "x"
    elif case == "arabic digit":
        req.speculation.retention.schedule = "0.1,\u0661"
    else:
        req.request_id = "r" * 100_000
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(stub, req)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(error.value.details()) <= 400
    expected = {"huge prompt_ids": "the context holds 256", "long schedule": "at most 8 are allowed",
                "arabic digit": "is not a number (ASCII digits)", "long request_id": "request_id has 100000 characters"}
    assert expected[case] in error.value.details()


async def test_text_prompts_are_tokenised_off_the_event_loop(servers, tiny_model):
    tokenizer = SlowTokenizer(3.0)
    stub = await servers.start(tiny_model, tokenizer=tokenizer)
    health = health_pb2_grpc.HealthStub(servers.channel)
    req = request(PROMPT, 2)
    req.prompt_text = "a slow prompt"
    call = asyncio.ensure_future(generate(stub, req))
    while not tokenizer.started:  # the tokenizer is busy from now on
        await asyncio.sleep(0.01)
    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10.0)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert tokenizer.finished == 0  # answered while the prompt was being tokenised
    tokens, final, _ = await call
    assert len(tokens) == 2


async def test_a_text_prompt_over_the_byte_limit_is_refused_before_tokenising(servers, tiny_model):
    tokenizer = SlowTokenizer(30.0)
    stub = await servers.start(tiny_model, tokenizer=tokenizer)
    req = request(PROMPT, 2)
    req.prompt_text = "x" * (256 * 32 + 1)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(stub, req)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_text has 8193 bytes" in error.value.details()
    assert tokenizer.started == 0


# -- item 9: a drafter the verifier cannot reach is said loudly ------------------------------------


async def test_a_tls_mismatch_toward_the_drafter_is_logged_and_measured(servers, tiny_model, tmp_path):
    from structlog.testing import capture_logs

    from shared.security import make_test_pki

    pki = make_test_pki(tmp_path)
    with capture_logs() as logs:
        # the verifier expects TLS; the scripted drafter serves plaintext
        stub = await servers.start(tiny_model, drafter=ScriptedDrafter(lambda s: chain(s, [1])),
                                   drafter_tls_ca=str(pki["ca"]), drafter_deadline_ms=200)
        tokens, final, rounds = await generate(stub, request(PROMPT, 4, temperature=0.9, seed=3))
    assert len(tokens) == 4 and sum(r.retained for r in rounds) == 0
    warnings = [e for e in logs if "unreachable or refuses streams" in e.get("event", "")]
    assert len(warnings) >= 1 and warnings[0]["log_level"] == "warning"
    assert len({w["reason"] for w in warnings}) == len(warnings)  # each distinct failure once
    gauge = servers.verifier.service.metrics.drafter_reachable
    assert gauge._value.get() == 0


async def test_a_reachable_drafter_is_measured_as_such(servers, tiny_model):
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(lambda s: chain(s, [1])))
    await generate(stub, request(PROMPT, 3, temperature=0.9, seed=3))
    assert servers.verifier.service.metrics.drafter_reachable._value.get() == 1
