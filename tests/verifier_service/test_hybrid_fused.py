"""The hybrid family on the fused path through the verifier (issue 34): windows and decode
batches over its linear-attention states, rolled back to the last accepted row, give exactly
what plain decoding gives (exact mode, greedy and sampled), with drafts fully, partly and not
at all accepted. On a CPU box the kernels run in Triton's interpreter."""

import pytest
import torch

from ..shared.model.next_checkpoints import write_fused_checkpoint
from .conftest import ScriptedDrafter, chain, generate, request

PROMPT = [3, 14, 15, 92, 65, 35, 89]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # one layer of each kind: the rollback of both (linear states, KV rows) at half the interpreter's time
    return write_fused_checkpoint(tmp_path_factory.mktemp("hybrid-fused"), layer_types=["linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def reference(checkpoint):
    from shared.model import load_model

    return load_model(checkpoint)


def greedy_continuation(model, tokens, k):
    out = []
    for _ in range(k):
        logits, _ = model(torch.tensor(tokens + out), model.new_cache(len(tokens) + k))
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_fused_verifier_windows_roll_back_like_plain_decoding(servers, checkpoint, reference, temperature):
    def propose(state):
        drafts = greedy_continuation(reference, state.tokens, 3)
        if state.round_id % 3 == 1:
            drafts[1] = (drafts[1] + 1) % 97
        elif state.round_id % 3 == 2:
            drafts = [(t + 5) % 97 for t in drafts]
        return chain(state, drafts)

    stub = await servers.start(None, drafter=ScriptedDrafter(propose), model=str(checkpoint), max_draft_tokens=3,
                               fused="on", max_sessions=2)
    assert servers.verifier.service.engine.path == "fused"
    req = request(PROMPT, 7, temperature=temperature, seed=1, max_draft_tokens=3)
    spec, final, rounds = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert spec == plain and len(spec) == 7
    assert final.stats.proposed > 0 and final.stats.drafter_faults == 0
    if temperature == 0:
        accepted = sorted({r.accepted for r in rounds if r.retained})
        assert accepted[0] < 2 and accepted[-1] >= 2  # rollbacks to several rows of the window


async def test_fused_verifier_with_experts_in_host_memory_decodes_like_plain(servers, checkpoint, reference):
    """2 of 8 experts a block on the device (the rest in host memory, copied in as routed): the
    fused verifier's windows, rolled back after partly accepted drafts, still give what plain
    decoding gives."""
    from shared.model.families.hybrid.loader import expert_modules

    def propose(state):
        drafts = greedy_continuation(reference, state.tokens, 3)
        drafts[1 + state.round_id % 2] = (drafts[1 + state.round_id % 2] + 1) % 97
        return chain(state, drafts)

    stub = await servers.start(None, drafter=ScriptedDrafter(propose), model=str(checkpoint), max_draft_tokens=3,
                               fused="on", max_sessions=2, num_expert_slots=2)
    engine = servers.verifier.service.engine
    assert engine.path == "fused"
    stores = [experts.store for experts in expert_modules(servers.verifier.service.model)]
    assert stores and all(store.num_slots == 2 and store.num_fixed == 1 for store in stores)
    req = request(PROMPT, 6, temperature=0.0, seed=1, max_draft_tokens=3)
    spec, final, _ = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert spec == plain and len(spec) == 6
    assert final.stats.accepted > 0
    assert engine.slot_misses() == sum(store.counters.misses for store in stores) > 0  # (what /metrics reports)
