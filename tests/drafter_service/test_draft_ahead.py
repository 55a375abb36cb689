"""Draft-ahead on the drafter's side (DESIGN §9): after a suffix chain, the next round's chain
assuming every draft accepted and the bonus the index expects; a commit that emits exactly
that is a hit (no chain answers it), anything else is answered as before."""

from __future__ import annotations

import torch

from drafter_service.proposers.suffix import SuffixIndex
from drafter_service.drafter import Drafter
from drafter_service.settings import DrafterSettings
from shared.protocol import common_pb2, drafter_pb2, encode_hidden

from ..verifier_service.conftest import generate, request

PATTERN = [11, 12, 13, 14, 15, 16, 17, 18]


def test_assuming_leaves_the_index_as_it_was():
    index = SuffixIndex()
    index.extend(PATTERN * 2 + [11, 12])
    tokens, prefix, counted = list(index.tokens), list(index.prefix), index.counted
    before = index.lookup(4)
    with index.assuming([13, 14, 15]):
        inside = index.lookup(4)
        assert index.tokens[-3:] == [13, 14, 15]
    assert (index.tokens, index.prefix, index.counted) == (tokens, prefix, counted)
    assert before.continuation == [13, 14, 15, 16] and inside.continuation == [16, 17, 18, 11]
    assert index.lookup(4) == before


def open_session(drafter: Drafter, model, tokens: list[int], draft_ahead: bool = True):
    hidden = torch.zeros(len(tokens) - 1, model.config.hidden_size)
    return drafter.open(drafter_pb2.DraftOpen(
        session_id="s", token_ids=tokens, hidden=encode_hidden(hidden), max_draft_tokens=3, max_new_tokens=32,
        draft_ahead=draft_ahead))


def commit(round_id: int, emitted: list[int], accepted: int, model) -> drafter_pb2.DraftCommit:
    return drafter_pb2.DraftCommit(round_id=round_id, num_accepted=accepted, num_verified=3, emitted_token_ids=emitted,
                                   hidden=encode_hidden(torch.zeros(len(emitted), model.config.hidden_size)))


def test_a_suffix_chain_is_followed_by_one_drafted_ahead(tiny_mtp_model):
    drafter = Drafter(tiny_mtp_model, DrafterSettings(planner="suffix"))
    context = PATTERN * 3 + [11, 12]
    session = open_session(drafter, tiny_mtp_model, context)
    chain = drafter.propose(session)
    assert chain.source == common_pb2.DRAFT_SOURCE_SUFFIX and list(chain.token_ids) == [13, 14, 15]
    ahead = drafter.propose_ahead(session, chain)
    # all three accepted, then the bonus the index expects (16); drafts after that
    assert list(ahead.assumed_token_ids) == [13, 14, 15, 16]
    assert (ahead.round_id, ahead.base_length) == (chain.round_id + 1, len(context) + 4)
    assert list(ahead.token_ids) == [17, 18, 11]
    assert drafter.commit(session, commit(0, [13, 14, 15, 16], 3, tiny_mtp_model))  # a hit
    assert session.in_flight is not None and session.in_flight.source == "SUFFIX"  # learns from the ahead chain
    # the next chain ahead builds on the one the verifier holds
    after = drafter.propose_ahead(session, session.ahead)
    assert list(after.assumed_token_ids) == [17, 18, 11, 12] and after.round_id == 2
    # a round that emits anything else is answered by a fresh chain
    assert not drafter.commit(session, commit(1, [17, 18, 19], 2, tiny_mtp_model))
    assert session.ahead is None and session.in_flight is None


def test_a_commit_s_cap_bounds_the_next_chains_and_ahead_chains(tiny_mtp_model):
    # The verifier's load gate (DESIGN §9) says with a commit how many drafts the next chain
    # may hold; 0 lifts it.
    for planner in ("suffix", "mtp"):
        drafter = Drafter(tiny_mtp_model, DrafterSettings(planner=planner))
        session = open_session(drafter, tiny_mtp_model, PATTERN * 3 + [11, 12], draft_ahead=False)
        assert len(drafter.propose(session).token_ids) == 3
        capped = commit(0, [13, 14, 15, 16], 3, tiny_mtp_model)
        capped.max_draft_tokens = 1
        drafter.commit(session, capped)
        assert len(drafter.propose(session).token_ids) == 1
        drafter.commit(session, commit(1, [17, 18], 1, tiny_mtp_model))
        assert len(drafter.propose(session).token_ids) == 3
    drafter = Drafter(tiny_mtp_model, DrafterSettings(planner="suffix"))
    session = open_session(drafter, tiny_mtp_model, PATTERN * 3 + [11, 12])
    drafter.commit(session, drafter_pb2.DraftCommit(round_id=0, num_rounds=2, emitted_token_ids=[13, 14],
                                                    max_draft_tokens=2,
                                                    hidden=encode_hidden(torch.zeros(2, tiny_mtp_model.config.hidden_size))))
    chain = drafter.propose(session)
    assert list(chain.token_ids) == [15, 16]
    assert list(drafter.propose_ahead(session, chain).token_ids) == [18, 11]  # after [15, 16] and the bonus 17


def test_no_chain_ahead_unless_both_sides_want_it(tiny_mtp_model):
    for verifier_wants, drafter_wants in ((False, True), (True, False)):
        drafter = Drafter(tiny_mtp_model, DrafterSettings(planner="suffix", draft_ahead=drafter_wants))
        session = open_session(drafter, tiny_mtp_model, PATTERN * 3 + [11, 12], draft_ahead=verifier_wants)
        assert drafter.propose_ahead(session, drafter.propose(session)) is None
    drafter = Drafter(tiny_mtp_model, DrafterSettings(planner="mtp"))  # (after an MTP chain: none)
    session = open_session(drafter, tiny_mtp_model, PATTERN * 3 + [11, 12])
    chain = drafter.propose(session)
    assert chain.source == common_pb2.DRAFT_SOURCE_MTP and drafter.propose_ahead(session, chain) is None


async def test_chains_drafted_ahead_are_used_through_the_pair_and_tokens_stay_the_same(pair, demo_model):
    from shared.model.registry import resolve_model
    from shared.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(resolve_model(None))
    stub = await pair.start(demo_model, tokenizer=tokenizer, drafter_settings={"planner": "suffix"})
    ids = tokenizer.encode("for index in range(10):\n    total += values[index] * weights[index]\n").ids
    prompt = [0] + ids * 4 + ids[:6]  # a passage repeated: suffix chains that come true
    req = request(prompt, 48, max_draft_tokens=4)
    tokens, final, rounds = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert tokens == plain
    assert final.stats.ahead_hits > 0 and final.stats.drafter_faults == 0
    # rounds on a chain drafted ahead wait only for its arrival, if at all: far fewer waits
    # than rounds. (Measured here: most rounds after the first hit.)
    assert final.stats.ahead_hits <= final.stats.rounds
