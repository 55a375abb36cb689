"""Followers (verifier_service.loop: Lane.follow): the round after a verify round, handed to the
engine loop from the drafter's chain drafted ahead before that round's outcome, runs at once
when the round emitted what the chain assumed and never otherwise, and only for a lane alone
in the loop; exact mode's tokens stay those of plain decoding, greedy and sampled, alone and
together."""

import asyncio
import time

from shared.protocol import PROTOCOL_VERSION, common_pb2, drafter_pb2, drafter_pb2_grpc
from verifier_service.loop import BatchSettings, EngineLoop
from verifier_service.rounds import RoundRequest

from .conftest import generate, request

K = 3  # drafts per chain


class AheadDrafter(drafter_pb2_grpc.DrafterServicer):
    """Proposes each request's known plain continuation (a draft at position p corrupted when
    p % 5 == 0), and after each chain the next round's, assuming every draft accepted and the
    continuation's next token as the bonus, as tandem's drafter drafts ahead."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.references: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + plain continuation

    def drafts(self, reference: list[int], start: int) -> list[int]:
        return [(t + 1) % self.vocab_size if p % 5 == 0 else t
                for p, t in enumerate(reference[start:start + K], start=start)]

    def chains(self, reference: list[int], round_id: int, base: int) -> list[drafter_pb2.DraftChain]:
        drafts = self.drafts(reference, base)
        out = [drafter_pb2.DraftChain(round_id=round_id, base_length=base, source=common_pb2.DRAFT_SOURCE_SUFFIX,
                                      token_ids=drafts, confidences=[1.0] * len(drafts))]
        after = base + len(drafts)
        if drafts and after + 1 < len(reference):
            assumed = [*drafts, reference[after]]
            ahead = self.drafts(reference, after + 1)
            if ahead:
                out.append(drafter_pb2.DraftChain(
                    round_id=round_id + 1, base_length=base + len(assumed), source=common_pb2.DRAFT_SOURCE_SUFFIX,
                    token_ids=ahead, confidences=[1.0] * len(ahead), assumed_token_ids=assumed))
        return out

    async def Draft(self, request_iterator, context):
        tokens: list[int] = []
        reference: list[int] = []
        assumed: tuple[int, list[int]] | None = None  # (round, tokens) the last chain drafted ahead assumed
        async for up in request_iterator:
            if up.HasField("open"):
                tokens = list(up.open.token_ids)
                reference = next((r for p, r in self.references.items() if tokens[:len(p)] == list(p)), [])
                round_id = up.open.next_round_id
            else:
                tokens += list(up.commit.emitted_token_ids)
                round_id = up.commit.round_id + 1
                if assumed is not None and assumed == (up.commit.round_id, list(up.commit.emitted_token_ids)):
                    assumed = None  # what the chain drafted ahead assumed: it answers this commit
                    continue
            chains = self.chains(reference, round_id, len(tokens)) if tokens == reference[:len(tokens)] else []
            assumed = (round_id, list(chains[1].assumed_token_ids)) if len(chains) == 2 else None
            for chain in chains:
                yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=chain)


PROMPTS = [([5, 17, 42, 8], 0.0, 0), ([3, 9, 27, 81 % 97], 0.8, 7), ([11, 13], 0.8, 3)]


async def test_followers_run_when_their_assumption_holds_and_tokens_stay_plain(servers, tiny_model):
    drafter = AheadDrafter(tiny_model.config.vocab_size)
    stub = await servers.start(tiny_model, fused="on", drafter=drafter, max_sessions=4)
    plain = []
    for prompt, temperature, seed in PROMPTS:
        tokens, _, _ = await generate(stub, request(prompt, 40, temperature=temperature, seed=seed, disable=True))
        drafter.references[tuple(prompt)] = prompt + tokens
        plain.append(tokens)

    def spec(prompt, temperature, seed):
        return request(prompt, 40, temperature=temperature, seed=seed, max_draft_tokens=K)

    # Each step lasts at least 5 ms, so a chain drafted ahead has time to arrive while its round
    # runs (on a fast machine a round of this tiny model can end before the drafter's message).
    engine = servers.verifier.service.engine
    run_rounds = engine.run_rounds
    engine.run_rounds = lambda rounds: time.sleep(0.005) or run_rounds(rounds)
    alone = [await generate(stub, spec(*p)) for p in PROMPTS]
    together = await asyncio.gather(*(generate(stub, spec(*p)) for p in PROMPTS))
    assert [tokens for tokens, _, _ in together] == plain  # exact mode: the tokens of plain decoding
    for (tokens, final, rounds), reference in zip(alone, plain):  # (only a lane alone follows)
        assert tokens == reference
        followed = [r for r in rounds if r.speculative and r.retained and r.draft_wait_ms == 0.0]
        assert len(followed) >= 2, [(r.retained, r.accepted, r.draft_wait_ms) for r in rounds]
        assert final.stats.ahead_hits >= len(followed)
        assert final.stats.ahead_misses >= 1  # (a corrupted draft: the assumption failed, nothing ran)


class Outcome:
    def __init__(self, emitted):
        self.emitted = emitted


class Session:
    def __init__(self, name):
        self.name = name

    def may_decode(self):
        return True


class EchoEngine:
    """Each round emits its drafts and then 0 (all accepted, bonus 0); records the steps."""

    def __init__(self):
        self.steps = []

    def run_rounds(self, rounds):
        self.steps.append([(r.session.name, list(r.drafts)) for r in rounds])
        return [Outcome([*r.drafts, 0]) for r in rounds]

    def computed_ahead(self):
        return []


async def test_the_loop_runs_a_follower_only_after_a_round_that_emitted_what_it_assumed():
    engine = EchoEngine()
    loop = EngineLoop("test-followers", BatchSettings(max_rounds=4, gather_s=0.0))
    loop.start(engine)
    try:
        session = Session("a")
        lane = loop.join(session)
        lane.turn(RoundRequest(session, [1, 2]))
        assert lane.follow(0, [1, 2, 0], RoundRequest(session, [3, 4]))  # (in time: round 0 not read yet)
        assert (await lane.outcome()).emitted == [1, 2, 0]
        assert (await lane.outcome()).emitted == [3, 4, 0]  # the follower ran, nobody handed it in
        assert not lane.follow(1, [3, 4, 0], RoundRequest(session, [9]))  # too late: round 1 ran
        lane.turn(RoundRequest(session, [5]))
        assert lane.follow(2, [5, 7], RoundRequest(session, [6]))  # assumes a bonus of 7: round 2 emits 0
        assert (await lane.outcome()).emitted == [5, 0]
        await asyncio.sleep(0.05)
        assert engine.steps == [[("a", [1, 2])], [("a", [3, 4])], [("a", [5])]]  # the follower was dropped
    finally:
        loop.shutdown(wait=True)


async def test_a_follower_too_late_leaves_its_chain_to_the_next_round(servers, tiny_model, monkeypatch):
    """When the round a chain drafted ahead follows has run already, the chain goes back to the
    link: a drafter whose assumption held sends no other chain for that round, so dropping it
    would cost the round its drafter's deadline (a plain round and a fault)."""
    from verifier_service.lane import Lane

    monkeypatch.setattr(Lane, "follow", lambda self, *args: False)  # always too late
    drafter = AheadDrafter(tiny_model.config.vocab_size)
    stub = await servers.start(tiny_model, fused="on", drafter=drafter, drafter_deadline_ms=500.0)
    prompt = [5, 17, 42, 8]
    tokens, _, _ = await generate(stub, request(prompt, 30, disable=True))
    drafter.references[tuple(prompt)] = prompt + tokens
    spec_tokens, final, rounds = await generate(stub, request(prompt, 30, max_draft_tokens=K))
    assert spec_tokens == tokens
    assert final.stats.drafter_faults == 0
    assert all(r.speculative and r.retained for r in rounds[:-1])  # every round verified drafts
    assert final.stats.ahead_hits >= 2


async def test_a_lane_follows_only_while_it_is_alone():
    loop = EngineLoop("test-followers", BatchSettings(max_rounds=4, gather_s=0.0))
    try:
        a, b = Session("a"), Session("b")
        lane = loop.join(a)
        other = loop.join(b)
        assert not lane.follow(0, [1, 0], RoundRequest(a, [2]))  # b's rounds keep the device busy
        other.leave()
        assert lane.follow(0, [1, 0], RoundRequest(a, [2]))
    finally:
        loop.shutdown(wait=True)
