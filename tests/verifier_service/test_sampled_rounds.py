"""Sampled rounds in a batch: grouped processing, draws for plain rounds, verdicts computed
together — each session gets exactly what it gets alone."""

import dataclasses
import random

import pytest
import torch

import kernels.sampling as sampling_module
from kernels.sampling import SamplingParams, SparseRows, draw, process_logits
from kernels.speculative import Mode, verify_chain
from shared.model.kv_cache import CacheLength
from verifier_service.rounds import Session
from verifier_service.rounds import greedy_verdict
from verifier_service.sampled_rounds import Chain, own_tokens, process_targets, verdicts

VOCAB = 50
PARAMS = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.2, top_k=10, max_support=8),
          SamplingParams(temperature=0.0)]


@pytest.fixture
def session(request_spec):
    """session(i, params, length=12): a Session of `length` tokens sampling with params."""

    def session(i: int, params: SamplingParams, length: int = 12) -> Session:
        request = dataclasses.replace(request_spec([1, 2, 3], temperature=1.0, seed=1000 + i, request_id=str(i)),
                                      sampling=params)
        return Session(spec=request, cache=CacheLength(64), token_ids=list(range(length)))

    return session


def test_a_batch_s_verdicts_are_each_chain_s_verdict_alone():
    rng = random.Random(4)
    generator = torch.Generator().manual_seed(4)
    chains = []
    for i in range(40):
        params = PARAMS[i % 2]
        num_drafts = rng.randrange(0, 6)
        target = process_logits(torch.randn(num_drafts + 1, VOCAB, generator=generator) * 2, params)
        q_rows = None
        if rng.random() < 0.5:
            q_rows = process_logits(torch.randn(num_drafts, VOCAB, generator=generator) * 2, PARAMS[rng.randrange(2)])
        # drafts: p's likeliest token mostly, so chains accept and reject
        drafts = [int(target.token_ids[j, target.probs[j].argmax()]) if rng.random() < 0.7 else rng.randrange(VOCAB)
                  for j in range(num_drafts)]
        mode = Mode.EXACT if i % 3 else Mode.PROBABILISTIC
        chains.append(Chain(target, drafts, q_rows, mode, seed=rng.randrange(2**64), accept_seed=rng.randrange(2**64),
                            base_position=rng.randrange(10, 500)))
    together = verdicts(chains)
    for chain, (emitted, accepted) in zip(chains, together):
        alone = verify_chain(chain.target, chain.drafts, chain.q_rows, mode=chain.mode, seed=chain.seed,
                             base_position=chain.base_position, accept_seed=chain.accept_seed)
        assert (emitted, accepted) == (alone.emitted(), int(alone.num_accepted[0]))
    num_accepted = [a for _, a in together]
    assert 0 < sum(num_accepted) < sum(len(c.drafts) for c in chains)


def test_plain_rounds_draw_what_each_session_draws_alone(session):
    sessions = [session(i, PARAMS[i % 3], length=10 + i) for i in range(9)]
    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(1)) * 3  # 3 spare rows (a padded bucket)
    positions = [len(s.token_ids) for s in sessions]
    tokens = own_tokens(sessions, [1] * 9, logits, logits.argmax(-1), positions).tolist()
    for i, s in enumerate(sessions):
        expected = draw(process_logits(logits[i : i + 1], s.spec.sampling), s.spec.seed, torch.tensor([positions[i]]))
        assert tokens[i] == int(expected)
    assert own_tokens([sessions[2]], [1], logits, logits.argmax(-1), positions[2:3]) is None  # greedy only


@pytest.mark.parametrize("way", ["native", "torch"])
@pytest.mark.parametrize("given", [True, False], ids=["drafts given", "drafts not given"])
@pytest.mark.parametrize("mode", list(Mode))
def test_exact_windows_verdicts_follow_from_their_own_tokens(mode, given, way, session, monkeypatch):
    """A window's own tokens drawn where its logits are: in exact mode greedy_verdict over them
    is verify_chain's verdict — with the drafts given (the engine's call: on the CPU a window's
    rows are drawn up to the first it rejects) or not (every row drawn), natively (the CPU's
    draws) or by torch ops (the GPU's way, and the CPU's without the native module);
    probabilistic windows with drafts keep their greedy ids (their p rows are verified on the
    host), plain ones are drawn."""
    if way == "torch":
        monkeypatch.setattr(sampling_module.cpu_rows, "native", lambda: None)
    rng = random.Random(3)
    sessions, num_rows = [], []
    for i in range(12):
        s = session(i, PARAMS[i % 3], length=20 + i)
        sessions.append(dataclasses.replace(s, spec=dataclasses.replace(s.spec, mode=mode)))
        num_rows.append(rng.randrange(1, 6))
    logits = torch.randn(sum(num_rows), VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    greedy = logits.argmax(-1)
    positions = [len(s.token_ids) for s in sessions]
    starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
    # drafts: the likeliest tokens, one in three replaced, so windows accept and reject
    drafts = [[int(t) if rng.random() < 0.67 else rng.randrange(VOCAB) for t in logits[start : start + n].argmax(-1)[: n - 1]]
              for start, n in zip(starts, num_rows)]
    tokens = own_tokens(sessions, num_rows, logits, greedy, positions, drafts if given else None).tolist()
    rejected = []  # (exact mode's drawn windows with drafts: whether one was rejected)
    for i, (s, n, start) in enumerate(zip(sessions, num_rows, starts)):
        rows = logits[start : start + n]
        target = process_logits(rows, s.spec.sampling)
        mine = tokens[start : start + n]
        if s.spec.sampling.greedy or (mode is Mode.PROBABILISTIC and drafts[i]):
            assert mine == greedy[start : start + n].tolist()
        else:
            alone = verify_chain(target, drafts[i], None, mode=mode, seed=s.spec.seed, base_position=positions[i])
            assert greedy_verdict(drafts[i], mine) == (alone.emitted(), int(alone.num_accepted[0]))
            if drafts[i]:
                rejected.append(int(alone.num_accepted[0]) < len(drafts[i]))
    if mode is Mode.EXACT:  # windows that reject a draft, and windows that accept every one
        assert any(rejected) and not all(rejected)


def test_grouped_processing_gives_each_window_its_own_rows(session):
    # probabilistic windows with drafts are processed (two sampling groups); greedy ones,
    # exact-mode ones and plain rounds are drawn where their logits are instead
    sessions = [session(i, PARAMS[i % 3]) for i in range(9)]
    sessions = [dataclasses.replace(s, spec=dataclasses.replace(s.spec, mode=Mode.PROBABILISTIC if i < 7 else Mode.EXACT))
                for i, s in enumerate(sessions)]
    num_rows = [1, 3, 2, 5, 1, 4, 2, 3, 3]
    logits = torch.randn(sum(num_rows) + 2, VOCAB, generator=torch.Generator().manual_seed(2))
    processed = process_targets(sessions, num_rows, logits)
    got: dict[int, SparseRows] = {}
    for rows, parts in processed:
        for i, span in parts:
            got[i] = rows[span]
    assert len(processed) == 2 and sorted(got) == [1, 3, 6]  # 0, 4: plain; 2, 5, 8: greedy; 7: exact
    start = 0
    for i, n in enumerate(num_rows):
        if i in got:
            alone = process_logits(logits[start : start + n], sessions[i].spec.sampling)
            assert torch.equal(got[i].token_ids, alone.token_ids) and torch.equal(got[i].probs, alone.probs)
        start += n


@pytest.mark.parametrize("mode", list(Mode))
def test_a_chain_without_q_rows_beside_chains_with_them_is_verified_as_point_masses(mode):
    generator = torch.Generator().manual_seed(9)
    target = process_logits(torch.randn(4, VOCAB, generator=generator), PARAMS[0])
    drafts = [int(t) for t in target.token_ids[:3, 0]]
    with_q = Chain(target, drafts, process_logits(torch.randn(3, VOCAB, generator=generator), PARAMS[0]), mode,
                   seed=5, accept_seed=6, base_position=20)
    for seed in range(30):
        bare = Chain(target, drafts, None, mode, seed=seed, accept_seed=seed + 1, base_position=40)
        alone = verify_chain(target, drafts, None, mode=mode, seed=seed, base_position=40, accept_seed=seed + 1)
        assert verdicts([with_q, bare])[1] == (alone.emitted(), int(alone.num_accepted[0]))
