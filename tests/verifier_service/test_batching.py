"""Batched rounds (Engine.run_rounds): sessions verified in one ragged forward commit exactly
what each commits alone, whatever else shares the batch.

The fused path runs its torch reference ops here (the Triton interpreter is switched off for
these tests: it would take seconds per batched step; tests/kernels runs the kernels
themselves on ragged batches).
"""

import dataclasses
import random

import pytest

from kernels.sampling import SparseRows
from verifier_service.engine import Engine
from verifier_service.rounds import RoundRequest


@pytest.fixture(autouse=True)
def torch_reference_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def drafts_for(plain: list[int], prompt_length: int, corrupt_every: int):
    """Drafts from a session's own plain continuation, every corrupt_every-th token changed, so
    rounds accept some drafts and reject others; a function of the committed tokens only."""

    def drafts_of(committed: list[int], limit: int) -> list[int]:
        done = len(committed) - prompt_length
        ahead = plain[done : done + limit]
        return [t if (done + j) % corrupt_every else (t + 1) % 97 for j, t in enumerate(ahead)]

    return drafts_of


def run_alone(engine, request, drafts_of):
    session = engine.open(request)
    emitted = []
    try:
        while len(emitted) < request.max_new_tokens:
            drafts = drafts_of(session.token_ids, min(4, session.capacity_left)) if drafts_of else []
            emitted.extend(engine.run_round(session, drafts, None).emitted)
    finally:
        engine.close(session)
    return emitted[: request.max_new_tokens]


def run_together(engine, requests, drafts_ofs):
    sessions = [engine.open(r) for r in requests]
    emitted = [[] for _ in requests]
    sizes = []
    try:
        while True:
            live = [i for i, r in enumerate(requests) if len(emitted[i]) < r.max_new_tokens]
            if not live:
                break
            rounds = []
            for i in live:
                s, drafts_of = sessions[i], drafts_ofs[i]
                drafts = drafts_of(s.token_ids, min(4, s.capacity_left)) if drafts_of else []
                rounds.append(RoundRequest(s, drafts, None))
            sizes.append(len(rounds))
            for i, outcome in zip(live, engine.run_rounds(rounds), strict=True):
                emitted[i].extend(outcome.emitted)
    finally:
        for s in sessions:
            engine.close(s)
    return [e[: r.max_new_tokens] for e, r in zip(emitted, requests)], sizes


@pytest.mark.parametrize("max_batch_rows", [64, 7])  # 7: the batch is split over several forwards
def test_sessions_batched_commit_what_they_commit_alone(tiny_mtp_model, max_batch_rows, request_spec):
    engine = Engine(tiny_mtp_model, max_context=128, prefill_chunk=5, fused="on", max_sessions=6, max_window=5,
                    max_batch_rows=max_batch_rows)
    rng = random.Random(3)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (3, 9, 14, 6, 11, 5)]
    temperatures = [0.0, 0.0, 0.8, 1.0, 0.0, 0.7]
    lengths = [12, 7, 12, 10, 12, 9]  # sessions leave the batch at different steps
    requests = [request_spec(p, temperature=t, seed=10 + i, max_new_tokens=n, request_id=str(i))
                for i, (p, t, n) in enumerate(zip(prompts, temperatures, lengths))]
    plain = [run_alone(engine, r, None) for r in requests]
    drafts_ofs = [drafts_for(plain[i], len(prompts[i]), 3) if i % 2 else None for i in range(len(requests))]
    alone = [run_alone(engine, r, d) for r, d in zip(requests, drafts_ofs)]
    together, sizes = run_together(engine, requests, drafts_ofs)
    assert together == alone
    for i in range(0, len(requests), 2):  # plain sessions: the same tokens as their plain run
        assert together[i] == plain[i]
    assert max(sizes) == len(requests) and sizes[-1] < len(requests)
    assert engine.free_slots == 6  # every slot returned


def test_a_batch_holds_one_round_per_session(tiny_mtp_model, request_spec):
    engine = Engine(tiny_mtp_model, max_context=64, prefill_chunk=8, fused="on", max_sessions=2, max_window=5)
    session = engine.open(request_spec([1, 2, 3], temperature=0.0))
    try:
        with pytest.raises(ValueError, match="one round per session"):
            engine.run_rounds([RoundRequest(session, []), RoundRequest(session, [])])
    finally:
        engine.close(session)


def test_probabilistic_rounds_batch_like_alone(tiny_mtp_model, request_spec):
    """Sparse q rows ride along per session: probabilistic verification in a batch draws the
    same accept/residual decisions as alone (the draws are keyed by seed and position)."""
    from kernels.speculative import Mode

    engine = Engine(tiny_mtp_model, max_context=128, prefill_chunk=8, fused="on", max_sessions=3, max_window=5)
    requests = []
    for i in range(3):
        r = request_spec([5 + i, 17, 42, 8], temperature=0.9, seed=30 + i, max_new_tokens=10, request_id=f"p{i}")
        requests.append(dataclasses.replace(r, mode=Mode.PROBABILISTIC))
    q = SparseRows.from_dicts([{t: 1.0 / 4 for t in (3, 9, 27, 81)}] * 3)
    outcomes = {}
    for together in (False, True):
        sessions = [engine.open(r) for r in requests]
        out = []
        for _ in range(4):
            rounds = [RoundRequest(s, [3, 9, 27], q) for s in sessions]
            if together:
                out.append([o.emitted for o in engine.run_rounds(rounds)])
            else:
                out.append([engine.run_round(r.session, r.drafts, r.q_rows).emitted for r in rounds])
        for s in sessions:
            engine.close(s)
        outcomes[together] = out
    assert outcomes[True] == outcomes[False]


@pytest.mark.parametrize("temperatures", [(0.0,) * 4, (0.8,) * 4, (0.0, 0.8, 0.8, 1.1)],
                         ids=["greedy", "sampled", "mixed"])
def test_decode_batches_ahead_commit_what_each_commits_alone(tiny_mtp_model, temperatures, request_spec):
    """Decode batches with decode-ahead (each step enqueues the next, fed on the device by the
    greedy ids or the draws made there): the same tokens as each session alone on the reference
    path (draws by verify_chain on the host), also when the batch's order changes, when a
    session leaves (the step ahead is dropped) and when one joins; sessions sampling alike
    share one processing of their rows."""
    engine = Engine(tiny_mtp_model, max_context=64, prefill_chunk=8, fused="on", max_sessions=4, max_window=5)
    engine.runner.can_run_ahead = True  # (the GPU's decode-ahead, run here)
    reference = Engine(tiny_mtp_model, max_context=64, prefill_chunk=8, fused="off")
    prompts = [[5, 17, 42], [9, 1, 60, 33, 2], [11, 12, 13, 14], [70, 71]]
    lengths = [10, 6, 10, 8]
    requests = [request_spec(p, temperature=t, max_new_tokens=n, request_id=str(i), seed=40 + i)
                for i, (p, n, t) in enumerate(zip(prompts, lengths, temperatures))]
    alone = [run_alone(reference, r, None) for r in requests]
    sessions = {i: engine.open(r) for i, r in enumerate(requests[:3])}  # the fourth joins later
    emitted = {i: [] for i in range(4)}
    launched = []  # decode batches launched from the host (the others were computed ahead)
    run = engine.runner.run
    engine.runner.run = lambda windows: launched.append(len(windows)) or run(windows)
    step = batched_steps = 0
    while sessions:
        live = sorted(sessions)
        if step % 2:
            live.reverse()  # the batch order changes from step to step
        rounds = [RoundRequest(sessions[i], [], None, decode_ahead=True) for i in live]
        batched_steps += len(rounds) > 1
        for i, outcome in zip(live, engine.run_rounds(rounds), strict=True):
            emitted[i].extend(outcome.emitted)
            if len(emitted[i]) >= lengths[i]:
                engine.close(sessions.pop(i))
        step += 1
        if step == 3:
            sessions[3] = engine.open(requests[3])
    assert [emitted[i][: lengths[i]] for i in range(4)] == alone
    assert len(launched) < batched_steps / 2  # most batch steps were computed ahead
    assert len(launched) >= 3  # start, the join, the leaves: each batch change launches anew
    assert engine.free_slots == 4
