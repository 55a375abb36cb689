"""Draft-ahead on the verifier's side (DESIGN §9): a chain drafted before the commit it
depends on is taken only when the committed tokens end with what it assumed."""

from __future__ import annotations

import asyncio

from shared.protocol import drafter_pb2
from verifier_service.drafter_link import DeadlineTracker, DrafterLink
from verifier_service.settings import VerifierSettings

COMMITTED = [7, 8, 9, 10, 11]  # the last round emitted [10, 11]


def link_with(*chains: drafter_pb2.DraftChain, deadline_ms: float = 200.0) -> DrafterLink:
    link = DrafterLink(stub=None, deadlines=DeadlineTracker(VerifierSettings(drafter_deadline_ms=deadline_ms)))
    link.broken = None  # (no stream: chains are delivered by hand)
    for chain in chains:
        link.deliver(chain)
    return link


def ahead(round_id: int, assumed: list[int], base_length: int, tokens=(1, 2)) -> drafter_pb2.DraftChain:
    return drafter_pb2.DraftChain(round_id=round_id, base_length=base_length, token_ids=list(tokens),
                                  assumed_token_ids=assumed, source=2)


def regular(round_id: int, base_length: int, tokens=(3,)) -> drafter_pb2.DraftChain:
    return drafter_pb2.DraftChain(round_id=round_id, base_length=base_length, token_ids=list(tokens), source=2)


async def test_a_chain_whose_assumption_came_true_is_taken_at_once():
    link = link_with(ahead(4, [10, 11], 5), ahead(5, [1, 2, 6], 8))
    chain, waited = await link.next_chain(4, COMMITTED)
    assert list(chain.token_ids) == [1, 2] and link.ahead == {"hit": 1, "miss": 0}
    assert [c.round_id for c in link.chains] == [5]  # the next round's chain ahead is kept
    assert not link.faults


async def test_a_wrong_assumption_is_dropped_and_the_answer_to_the_commit_awaited():
    # a wrong token, and the right tokens with the wrong base length
    link = link_with(ahead(4, [10, 12], 5), ahead(4, [10, 11], 6))
    asyncio.get_running_loop().call_later(0.02, link.deliver, regular(4, 5))
    chain, waited = await link.next_chain(4, COMMITTED)
    assert list(chain.token_ids) == [3] and waited >= 15 and link.ahead == {"hit": 0, "miss": 2}
    assert not link.faults


async def test_a_shorter_true_assumption_is_taken():
    # [11] alone is a true tail at base length 5 (drafts judged after [.., 11]): usable
    link = link_with(ahead(4, [11], 5))
    chain, _ = await link.next_chain(4, COMMITTED)
    assert chain is not None and link.ahead["hit"] == 1


async def test_chains_ahead_for_rounds_that_did_not_wait_are_misses_not_faults():
    link = link_with(ahead(2, [5], 3), regular(3, 4))  # round 2 decoded plainly
    link.next_round = 4
    link.deliver(ahead(3, [9], 4))  # arrives after the verifier moved on: dropped at once
    chain, _ = await link.next_chain(4, COMMITTED)
    assert chain is None  # (deadline: nothing for round 4)
    assert link.ahead["miss"] == 2 and link.faults == {"stale_chain": 1, "deadline": 1}


class FakeCall:
    def __init__(self):
        self.sent = []

    async def write(self, message):
        self.sent.append(message)


async def test_the_two_chains_after_a_resume_get_the_lenient_deadline_and_stay_out_of_its_history():
    import torch

    link = link_with()
    link.call = FakeCall()
    link.hold(3, [10], torch.zeros(1, 4))
    link.hold(4, [11], torch.zeros(1, 4))
    assert await link.resume() > 0
    await link.flush()  # (commits are written behind the round)
    (message,) = link.call.sent
    assert (message.commit.round_id, message.commit.num_rounds, list(message.commit.emitted_token_ids)) == (4, 2, [10, 11])
    for round_id in (5, 6, 7):
        link.deliver(regular(round_id, 5))
        await link.next_chain(round_id, COMMITTED)
    assert len(link.deadlines.waits_ms) == 1  # only the third wait is a sample of the drafter's pace
