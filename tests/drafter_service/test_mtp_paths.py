"""The MTP proposer on the fused-kernel path drafts what the reference modules draft."""

import pytest
import torch

from drafter_service.proposers.mtp import MTPProposer, MTPState
from kernels.retention import RetentionPolicy
from kernels.sampling import SamplingParams
from kernels.speculative import Gate, Mode
from shared.model import RoutingOptions
from shared.model.fast import FusedModel


@pytest.mark.parametrize("temperature,moce", [(0.0, False), (0.7, True)])
def test_fused_mtp_drafts_like_the_reference(tiny_mtp_model, temperature, moce):
    model = tiny_mtp_model
    routing = RoutingOptions(moce=True, scale=1.4) if moce else None
    fused = FusedModel(model, max_rows=8, max_length=model.config.max_position_embeddings)
    tokens = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(4))
    _, hidden = model(tokens, model.new_cache(40))
    proposals = []
    for proposer in (MTPProposer(model, routing), MTPProposer(model, routing, fused)):
        state = MTPState(model, 64)
        proposer.catch_up(state, hidden[:20], tokens[1:21].tolist())  # 20 rows: fused (max_rows 8) falls back
        for end in (21, 24, 29):  # then short commits: the fused path
            proposer.catch_up(state, hidden[state.cache.length : end], tokens[state.cache.length + 1 : end + 1].tolist())
            proposal = proposer.draft(
                state, 4, sampling=SamplingParams(temperature=temperature), seed=3, base_position=end + 1,
                mode=Mode.EXACT, gate=Gate.TOP, coupled=False, policy=RetentionPolicy(),
            )
            assert state.cache.length == end  # draft rows rolled back
            proposals.append((proposal.token_ids, proposal.confidences))
    half = len(proposals) // 2
    assert [p[0] for p in proposals[:half]] == [p[0] for p in proposals[half:]]
    for (_, ref), (_, got) in zip(proposals[:half], proposals[half:]):
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-6)


def test_deferred_commits_settle_to_the_eager_state(tiny_mtp_model):
    """Commits deferred (MTPProposer.defer) and settled later run the same forwards as eager
    catch-ups: the same cache and the same first-draft logits, bit for bit."""
    model = tiny_mtp_model
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(7))
    _, hidden = model(tokens, model.new_cache(40))
    proposer = MTPProposer(model)
    eager, lazy = MTPState(model, 64), MTPState(model, 64)
    for state in (eager, lazy):
        proposer.catch_up(state, hidden[:10], tokens[1:11].tolist())
    for start, end in ((10, 13), (13, 14), (14, 18)):
        proposer.catch_up(eager, hidden[start:end], tokens[start + 1 : end + 1].tolist())
        proposer.defer(lazy, hidden[start:end], tokens[start + 1 : end + 1].tolist())
    assert lazy.cache.length == 10 and len(lazy.pending) == 3  # nothing ran yet
    proposer.settle(lazy)
    assert not lazy.pending and lazy.cache.length == eager.cache.length == 18
    assert torch.equal(lazy.next_logits, eager.next_logits)
    assert torch.equal(lazy.cache.keys[:, :18], eager.cache.keys[:, :18])


def test_a_suffix_round_leaves_the_mtp_rows_for_after_its_chain(tiny_mtp_model):
    """With suffix drafting (planner "suffix"), commit + propose run no MTP forward; the rows
    run in the job after the chain went out."""
    from drafter_service.drafter import Drafter
    from drafter_service.settings import DrafterSettings

    from .test_messages import commit_up, open_up

    drafter = Drafter(tiny_mtp_model, DrafterSettings(port=0, planner="suffix"))
    forwards = []
    original = drafter.mtp._forward
    drafter.mtp._forward = lambda *a, **k: forwards.append(1) or original(*a, **k)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    session = drafter.open(open_up(tiny_mtp_model, prompt).open)
    drafter.propose(session)
    forwards.clear()
    drafter.commit(session, commit_up(tiny_mtp_model, emitted=[5]).commit)
    chain = drafter.propose(session)
    assert chain.token_ids and not forwards  # a suffix chain, and no MTP work on the way
    drafter.settle(session)
    assert forwards and not session.mtp.pending and session.mtp.cache.length == len(session.tokens) - 1
