"""The verifier engine's fused path (KV pool slots, fused kernels, the window runner) commits
the same tokens as the reference path, and greedy verification by token ids equals
verify_chain's verdict."""

import random

import pytest
import torch

from kernels.sampling import SamplingParams, process_logits
from kernels.speculative import Mode, verify_chain
from verifier_service.engine import Engine
from verifier_service.rounds import greedy_verdict


def decode(engine, request, drafts_of):
    """Run rounds until max_new_tokens, proposing drafts_of(committed) each round."""
    session = engine.open(request)
    emitted = []
    try:
        while len(emitted) < request.max_new_tokens:
            drafts = drafts_of(session.token_ids)[: min(4, session.capacity_left)]
            outcome = engine.run_round(session, drafts, None)
            assert outcome.hidden_rows.shape == (outcome.num_accepted + 1, engine.model.config.hidden_size)
            emitted.extend(outcome.emitted)
    finally:
        engine.close(session)
    return emitted[: request.max_new_tokens]


@pytest.fixture
def torch_reference_ops(monkeypatch):
    """The fused ops' torch code (the Triton interpreter takes seconds per step; the kernels
    themselves: tests/kernels, and the greedy case below)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_fused_engine_commits_the_reference_tokens(tiny_mtp_model, temperature, request, request_spec):
    if temperature:
        request.getfixturevalue("torch_reference_ops")
    # (greedy runs the kernels in Triton's interpreter, seconds a step: fewer tokens)
    new_tokens = 24 if temperature else 12
    reference = Engine(tiny_mtp_model, max_context=128, prefill_chunk=5, fused="off")
    fused = Engine(tiny_mtp_model, max_context=128, prefill_chunk=5, fused="on", max_sessions=2, max_window=5,
                   row_invariant=False)  # batched windows (the CPU's one-row windows: test_exact_rounds_...)
    assert reference.path == "reference" and fused.path == "fused"
    rng = random.Random(0)
    prompt = [rng.randrange(97) for _ in range(13)]
    plain = decode(reference, request_spec(prompt, temperature=temperature, max_new_tokens=new_tokens), lambda ids: [])
    # drafts: the plain continuation with some tokens corrupted, so rounds accept and reject
    def drafts_of(committed):
        done = len(committed) - len(prompt)
        return [t if rng.random() < 0.7 else (t + 1) % 97 for t in plain[done : done + 4]]

    for engine in (reference, fused):
        assert decode(engine, request_spec(prompt, temperature=temperature, max_new_tokens=new_tokens),
                      drafts_of) == plain
    # the fused path's plain rounds: the token drawn on the device (sampled) or the argmax
    assert decode(fused, request_spec(prompt, temperature=temperature, max_new_tokens=new_tokens),
                  lambda ids: []) == plain
    assert fused.free_slots == 2  # every slot returned


def test_fused_engine_refuses_models_it_cannot_run(tiny_mtp_model):
    from shared.model import ModelConfig, load_model

    raw = tiny_mtp_model.config.to_dict() | {"attention_bias": True}
    biased = load_model(config=ModelConfig.from_dict(raw), random_weights=True)
    with pytest.raises(ValueError, match="fused = on, but attention_bias"):
        Engine(biased, max_context=64, prefill_chunk=8, fused="on")
    assert Engine(biased, max_context=64, prefill_chunk=8, fused="auto").path == "reference"


@pytest.mark.parametrize("seed", range(30))
def test_greedy_verdict_equals_verify_chain(seed):
    rng = random.Random(seed)
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(seed))
    target = process_logits(logits, SamplingParams(temperature=0.0))
    greedy = logits.argmax(-1).tolist()
    drafts = [g if rng.random() < 0.6 else rng.randrange(11) for g in greedy[:4]]
    for mode in Mode:
        verdict = verify_chain(target, drafts, None, mode=mode, seed=seed, base_position=3)
        assert greedy_verdict(drafts, greedy) == (verdict.emitted(), int(verdict.num_accepted[0]))


@pytest.mark.usefixtures("torch_reference_ops")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_ahead_commits_the_same_tokens_across_interleaved_sessions(tiny_mtp_model, temperature, request_spec):
    """Plain rounds with decode-ahead: the step enqueued for a session's next round is used only
    when that round comes next; another session's round or a drafted round drops it. Sampled:
    the step ahead decodes the token drawn on the device, the one verify_chain would emit."""
    reference = Engine(tiny_mtp_model, max_context=128, prefill_chunk=5, fused="off")
    fused = Engine(tiny_mtp_model, max_context=128, prefill_chunk=5, fused="on", max_sessions=2, max_window=5)
    fused.runner.can_run_ahead = True  # (the GPU's decode-ahead, run here)
    prompts = [[3, 14, 15, 92, 65, 35], [27, 18, 28, 18, 28]]
    expected = [decode(reference, request_spec(p, temperature=temperature, max_new_tokens=12), lambda ids: [])
                for p in prompts]
    sessions = [fused.open(request_spec(p, temperature=temperature, max_new_tokens=12, request_id=str(i)))
                for i, p in enumerate(prompts)]
    got = [[], []]
    used = 0
    schedule = [0, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0, 1, 0, 1]
    for turn, which in enumerate(schedule):
        session = sessions[which]
        if len(got[which]) >= 12:
            continue
        ahead = fused.ahead
        drafts = expected[which][len(got[which]) : len(got[which]) + 2] if turn % 7 == 6 else []
        outcome = fused.run_round(session, drafts, None, decode_ahead=True)
        used += ahead is not None and ahead.sessions == [session] and not drafts
        got[which].extend(outcome.emitted)
        assert session.cache.length == len(session.token_ids) - 1  # the head's row is never cached
    for session in sessions:
        fused.close(session)
    assert [g[:12] for g in got] == expected
    assert used >= 5 and fused.ahead is None and fused.free_slots == 2


def test_prefill_warm_up_touches_no_session_and_gives_its_blocks_back(tiny_mtp_model, monkeypatch, request_spec):
    # The start-up warm-up (run where graphs are captured, on CUDA) prefills into a slot of its
    # own: a session's KV rows stay untouched, the blocks it took return to the pool, and
    # decoding afterwards commits the same tokens.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (torch_reference_ops)
    engine = Engine(tiny_mtp_model, max_context=128, prefill_chunk=40, fused="on", max_sessions=2, max_window=5,
                    kv_block_size=8)
    pool = engine.runner.pool
    request = request_spec([3, 9, 27, 81, 17], temperature=0.0)
    session = engine.open(request)
    held = pool.read(session.slot, 4)
    before, free = pool.keys.clone(), (pool.num_free, pool.num_free_blocks)
    messages = []
    engine._warm_prefill(messages.append)
    assert not torch.equal(pool.keys, before) and messages[0].startswith("warmed up prefill")
    assert all(torch.equal(now, then) for now, then in zip(pool.read(session.slot, 4), held))
    assert (pool.num_free, pool.num_free_blocks) == free
    engine.close(session)
    reference = Engine(tiny_mtp_model, max_context=128, prefill_chunk=5, fused="off")
    assert decode(engine, request, lambda ids: []) == decode(reference, request, lambda ids: [])


@pytest.mark.parametrize("fused", ["off", "on"])
def test_exact_rounds_on_the_cpu_give_the_one_row_bits(tiny_mtp_model, fused, request_spec):
    """Exact mode on the CPU (--row-invariant, on by default): a verify round's hidden rows are
    bit-identical to those of the plain one-row rounds that commit the same tokens."""
    prompt = [3, 14, 15, 92, 65, 35, 8]
    request = request_spec(prompt, temperature=0.0, max_new_tokens=5)

    def rows_of(engine, drafts_of):
        session = engine.open(request)
        rows = []
        try:
            while len(session.token_ids) - len(prompt) < 5:
                outcome = engine.run_round(session, drafts_of(session.token_ids)[: session.capacity_left], None)
                rows.append(outcome.hidden_rows)
        finally:
            engine.close(session)
        return torch.cat(rows)

    def engine():
        return Engine(tiny_mtp_model, max_context=64, prefill_chunk=16, fused=fused, max_sessions=1, max_window=5)

    plain_rows = rows_of(engine(), lambda ids: [])
    plain = decode(engine(), request, lambda ids: [])

    def all_accepted(committed):  # the plain continuation: every draft accepted, one 5-row window
        done = len(committed) - len(prompt)
        return plain[done : done + 4]

    spec_rows = rows_of(engine(), all_accepted)
    assert len(spec_rows) == len(plain_rows) == 5  # row i: the position of committed token i
    assert torch.equal(spec_rows, plain_rows)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_offloaded_experts_commit_the_all_resident_tokens(tiny_mtp_model, torch_reference_ops, temperature,
                                                          request_spec):
    """Experts in host memory with 2 of 8 slots a layer (routing memory prefetching, windows
    needing several groups): exact-mode rounds commit what the all-resident engine commits."""
    from shared.model import ModelConfig, load_model
    from tests.conftest import TINY_MTP

    few = load_model(config=ModelConfig.from_dict(TINY_MTP), random_weights=True, seed=2, num_expert_slots=2)
    resident = Engine(tiny_mtp_model, max_context=128, prefill_chunk=5, fused="on", max_window=5)
    offloaded = Engine(few, max_context=128, prefill_chunk=5, fused="on", max_window=5, expert_prefetch=True)
    assert offloaded.path == "fused" and offloaded.runner.fused.offloaded
    rng = random.Random(1)
    prompt = [rng.randrange(97) for _ in range(11)]
    plain = decode(resident, request_spec(prompt, temperature=temperature, max_new_tokens=20), lambda ids: [])

    def drafts_of(committed):
        done = len(committed) - len(prompt)
        return [t if rng.random() < 0.7 else (t + 1) % 97 for t in plain[done : done + 4]]

    assert decode(offloaded, request_spec(prompt, temperature=temperature, max_new_tokens=20), drafts_of) == plain
    assert offloaded.slot_misses() > 0 and offloaded.runner.fused.offload.counters.predicted > 0
