"""Verification through the service with a test drafter whose q differs from p.

Lossless checks: exact mode is token-identical to decoding without a drafter; probabilistic
mode's emitted tokens follow the target law (chi-square, N and alpha below); the `pick`
gate shows the bias kernels.speculative's exact law predicts.
"""

import asyncio

import numpy as np
import pytest
import torch
from scipy import stats

from kernels.retention import RetentionPolicy
from kernels.sampling import SamplingParams, process_logits
from kernels.speculative import Gate, Mode, output_law
from shared.protocol import common_pb2

from .conftest import ScriptedDrafter, chain, drafted_as_plain, generate, request, sampled_chain

PROMPT = [3, 14, 15, 92, 65]
N_REQUESTS = 2000  # per distribution test
ALPHA = 1e-3
IN_FLIGHT = 32  # requests at once (the verifier's max_sessions; each one's draws are its own)


@pytest.mark.parametrize("link", ["grpc", "local"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_exact_mode_identical_with_and_without_drafter(servers, tiny_model, temperature, link,
                                                             greedy_continuation):
    q = {t: 1 / 8 for t in range(0, 96, 12)}
    drafter = ScriptedDrafter(lambda s: sampled_chain(s, q, 3) if s.round_id % 3 else chain(
        s, greedy_continuation(tiny_model, s.tokens, 3)))
    stub = await servers.start(tiny_model, drafter=drafter, link=link)
    for final in await drafted_as_plain(stub, PROMPT, 20, temperature=temperature, seeds=range(4)):
        assert final.stats.accepted > 0 and final.stats.proposed > 0
        assert final.stats.rounds < 20  # drafts were really accepted
        assert final.stats.drafter_faults == 0
    assert (servers.local.served if servers.local else 0) == (4 if link == "local" else 0)


async def run_many(stub, make_request, n):
    results = []
    for start in range(0, n, IN_FLIGHT):
        batch = await asyncio.gather(*(generate(stub, make_request(seed))
                                       for seed in range(start, min(n, start + IN_FLIGHT))))
        results += [tuple(tokens) for tokens, _, _ in batch]
    return results


async def test_probabilistic_mode_matches_the_target_law(servers, tiny_model, target_law_two_tokens):
    params = SamplingParams(temperature=1.0, top_k=3)
    law, _ = target_law_two_tokens(tiny_model, params, PROMPT)
    likely = sorted(law, key=law.get, reverse=True)
    # q puts weight on likely and unlikely tokens in other proportions than p
    q = {likely[0][0]: 0.15, likely[-1][0]: 0.45, 50: 0.25, 51: 0.15}
    drafter = ScriptedDrafter(lambda s: sampled_chain(s, q, 2))
    stub = await servers.start(tiny_model, drafter=drafter, probabilistic_drafters="any",  # the rule itself
                                draw_secret="law")  # the same draws every run: no 1-in-1,000 failures
    outcomes = await run_many(stub, lambda seed: request(
        PROMPT, 2, temperature=1.0, top_k=3, seed=seed, mode=common_pb2.MODE_PROBABILISTIC), N_REQUESTS)
    cells = sorted(law)
    observed = [outcomes.count(c) for c in cells]
    assert sum(observed) == N_REQUESTS  # no outcome outside the target's support
    expected = np.array([law[c] for c in cells]) * N_REQUESTS
    pooled = expected >= 5
    obs = np.array(observed)
    obs_pooled = np.append(obs[pooled], obs[~pooled].sum())
    exp_pooled = np.append(expected[pooled], expected[~pooled].sum())
    keep = exp_pooled > 0
    p_value = stats.chisquare(obs_pooled[keep], exp_pooled[keep]).pvalue
    assert p_value > ALPHA, (observed, expected)
    stats_sessions = drafter.sessions
    assert len(stats_sessions) == N_REQUESTS


async def test_pick_gate_bias_matches_the_exact_law(servers, tiny_model):
    """Constructed case: q(A)=0.875 on the target's top token A, q(B)=0.125, threshold 0.5."""
    params = SamplingParams(temperature=1.0, top_k=2)
    logits, _ = tiny_model.score(torch.tensor(PROMPT))
    p_row = process_logits(logits[-1:], params).row(0)
    a, b = sorted(p_row, key=p_row.get, reverse=True)
    q = {a: 0.875, b: 0.125}
    policy = RetentionPolicy(schedule=(0.5,))
    vocab = tiny_model.config.vocab_size
    p_dense = [p_row.get(t, 0.0) for t in range(vocab)]
    q_dense = [q.get(t, 0.0) for t in range(vocab)]
    laws = {
        gate: output_law(lambda prefix: p_dense, lambda prefix: q_dense, num_drafts=1, mode=Mode.PROBABILISTIC,
                         gate=gate, policy=policy, horizon=1)[(a,)]
        for gate in (Gate.PICK, Gate.TOP)
    }
    assert laws[Gate.TOP] == pytest.approx(p_row[a], abs=1e-12)
    assert laws[Gate.PICK] - laws[Gate.TOP] > 0.03  # the case is biased enough to see
    drafter = ScriptedDrafter(lambda s: sampled_chain(s, q, 1))
    stub = await servers.start(tiny_model, drafter=drafter, probabilistic_drafters="any",  # the rule itself
                                draw_secret="law")  # the same draws every run: no 1-in-1,000 failures
    outcomes = await run_many(stub, lambda seed: request(
        PROMPT, 1, temperature=1.0, top_k=2, seed=seed, mode=common_pb2.MODE_PROBABILISTIC,
        gate=common_pb2.GATE_PICK, schedule="0.5"), N_REQUESTS)
    hits = sum(1 for o in outcomes if o == (a,))
    # binomial test of the service's frequency against each law
    assert stats.binomtest(hits, N_REQUESTS, laws[Gate.PICK]).pvalue > ALPHA
    assert stats.binomtest(hits, N_REQUESTS, laws[Gate.TOP]).pvalue < ALPHA
