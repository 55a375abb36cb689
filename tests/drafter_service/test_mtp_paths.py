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
