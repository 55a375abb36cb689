"""The Qwen3-Next / Qwen3.5-MoE family (issue 17) through the verifier: loaded from its
checkpoint, verify windows over its hybrid cache — linear-attention states rolled back to the
last accepted row — give exactly what plain decoding gives (exact mode, greedy and sampled),
with drafts fully, partly and not at all accepted."""

import pytest
import torch

from ..shared.model.next_checkpoints import write_checkpoint
from .conftest import ScriptedDrafter, chain, generate, request

PROMPT = [3, 14, 15, 92, 65, 35, 89]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def checkpoint(request, tmp_path_factory, next_pair):
    name = "hybrid" if request.param == "qwen3_next" else "qwen3.5"
    return write_checkpoint(tmp_path_factory.mktemp(request.param), next_pair(name)[1], request.param)


def greedy_continuation(model, tokens, k):
    out = []
    for _ in range(k):
        logits, _ = model(torch.tensor(tokens + out), model.new_cache(len(tokens) + k))
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_exact_mode_identical_with_and_without_drafts(servers, checkpoint, temperature):
    """Chains of 4: the greedy continuation (all accepted when greedy), the same with its third
    token spoiled (two accepted), or junk (none): each round rolls the states back differently."""
    from shared.model import load_model

    model = load_model(checkpoint)

    def propose(state):
        drafts = greedy_continuation(model, state.tokens, 4)
        if state.round_id % 3 == 1:
            drafts[2] = (drafts[2] + 1) % 97
        elif state.round_id % 3 == 2:
            drafts = [(t + 5) % 97 for t in drafts]
        return chain(state, drafts)

    stub = await servers.start(None, drafter=ScriptedDrafter(propose), model=str(checkpoint), max_draft_tokens=4)
    service = servers.verifier.service
    assert service.engine.path == "reference" and service.model.mtp is None  # (the MTP layer is the drafter's)
    for seed in range(2):
        req = request(PROMPT, 16, temperature=temperature, seed=seed, max_draft_tokens=4)
        spec, final, rounds = await generate(stub, req)
        req.speculation.disable = True
        plain, _, _ = await generate(stub, req)
        assert spec == plain and len(spec) == 16
        assert final.stats.proposed > 0 and final.stats.drafter_faults == 0
        if temperature == 0:
            accepted = sorted({r.accepted for r in rounds if r.retained})
            assert accepted[0] < 2 and accepted[-1] >= 2  # rollbacks to several rows of the window


async def test_logprobs_of_drafted_tokens_are_those_of_plain_decoding(servers, checkpoint):
    """The hybrid family's rows (rolled-back states included) give every token the same
    log-probabilities, bit for bit, whether it was drafted and accepted or decoded plainly.
    The drafter proposes the draws plain decoding makes (the pick stream's u at each position),
    so sampled drafts are accepted too."""
    from kernels.rng import uniform_at
    from kernels.sampling import SamplingParams, process_logits, sample
    from shared.model import load_model
    from shared.protocol import verifier_pb2

    model = load_model(checkpoint)
    params = {0.0: SamplingParams(temperature=0.0), 0.8: SamplingParams(temperature=0.8)}

    def the_draws(state):
        tokens = list(state.tokens)
        for _ in range(3):
            logits, _ = model(torch.tensor(tokens), model.new_cache(len(tokens)))
            # (temperature: the loop's below, the request's being drafted)
            tokens.append(int(sample(process_logits(logits[-1:], params[temperature]), uniform_at(state.seed, len(tokens)))))
        return chain(state, tokens[len(state.tokens):])

    stub = await servers.start(None, drafter=ScriptedDrafter(the_draws), model=str(checkpoint), max_draft_tokens=3)
    for temperature, mode in ((0.0, verifier_pb2.LOGPROB_MODE_RAW), (0.8, verifier_pb2.LOGPROB_MODE_PROCESSED)):
        req = request(PROMPT, 12, temperature=temperature, seed=1, max_draft_tokens=3)
        req.logprobs.CopyFrom(verifier_pb2.LogprobParams(num_top=2, mode=mode))
        runs = []
        for disable in (False, True):
            req.speculation.disable = disable
            tokens, logprobs, accepted = [], [], 0
            async for event in stub.Generate(req):
                tokens += list(event.token_ids)
                logprobs += [(x.logprob, x.rank, list(x.top_token_ids), list(x.top_logprobs)) for x in event.logprobs]
                accepted += event.round.accepted if event.HasField("round") else 0
            runs.append((tokens, logprobs, accepted))
        (spec, spec_lp, spec_accepted), (plain, plain_lp, _) = runs
        assert spec_accepted >= 6 and spec == plain and len(spec_lp) == len(spec) == 12
        assert spec_lp == plain_lp
