"""Issue 12, items 2 and 8: a drafter that floods chains cannot grow the verifier's memory, and
a drafter outage does not end drafting for the rest of a request."""

from shared.protocol import PROTOCOL_VERSION, drafter_pb2
from verifier_service import drafter_link
from verifier_service.drafter_link import MAX_QUEUED_CHAINS, DeadlineTracker, DrafterLink
from verifier_service.settings import VerifierSettings

from .conftest import CLOSE, ScriptedDrafter, chain, generate, request

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
    assert link.chains.qsize() == MAX_QUEUED_CHAINS
    assert link.faults["stale_chain"] == 3334  # round 4 < the next round: dropped on arrival
    assert link.faults["chain_overflow"] == 10_000 - 3334 - MAX_QUEUED_CHAINS
    kept = [link.chains.get_nowait().round_id for _ in range(MAX_QUEUED_CHAINS)]
    assert all(r >= 5 for r in kept)  # the newest usable ones


async def test_a_flooding_drafter_costs_nothing_but_its_chains(servers, tiny_model):
    stub = await servers.start(tiny_model, drafter=Flooder(burst=500), max_draft_tokens=4)
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
