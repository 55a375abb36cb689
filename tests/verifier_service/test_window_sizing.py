"""Window sizing in batches (verifier_service.window_sizing): the draft prefixes that maximise a
batch's expected tokens per ms, the row cost they are priced with, and an engine that cuts
chains and still commits exactly what plain decoding does."""

import itertools
import random

import pytest

from verifier_service.window_sizing import Acceptance, RowCost, plan_drafts


def expected_tokens(rate: float, drafts: int) -> float:
    return sum(rate**j for j in range(drafts + 1))


def cost_of(points: dict[int, float], max_rows: int = 64) -> RowCost:
    cost = RowCost(max_rows=max_rows)
    for rows, ms in points.items():
        cost.record(rows, ms)
    return cost


@pytest.mark.parametrize("seed", range(40))
def test_plan_is_the_optimum_of_every_choice(seed):
    """Against exhaustive enumeration of every prefix choice (up to 4 sessions x 0..4 drafts)."""
    rng = random.Random(seed)
    num = rng.randint(1, 4)
    rates = [rng.choice([0.0, 0.3, 0.6, 0.8, 0.95, 1.0]) for _ in range(num)]
    max_drafts = [rng.randint(0, 4) for _ in range(num)]
    base = rng.uniform(1, 5)
    slope = rng.choice([0.0, 0.05, 0.4, 2.0])
    cost = cost_of({1: base, 20: base + slope * 19}, max_rows=rng.choice([4, 8, 64]))
    plan = plan_drafts(rates, max_drafts, cost)
    assert all(0 <= k <= d for k, d in zip(plan, max_drafts))

    def value(ks):
        return sum(expected_tokens(a, k) for a, k in zip(rates, ks)) / cost(sum(k + 1 for k in ks))

    best = max(value(ks) for ks in itertools.product(*(range(d + 1) for d in max_drafts)))
    assert value(plan) == pytest.approx(best, rel=1e-12)


def test_chains_shorten_as_rows_get_dearer():
    rates, drafts = [0.8] * 8, [4] * 8
    free = cost_of({1: 3.0, 64: 3.0})  # rows cost nothing: verify everything
    assert plan_drafts(rates, drafts, free) == drafts
    h200 = cost_of({8: 5.9, 24: 8.7, 40: 14.6})  # 30B shapes on the H200 (bench/invariance.py)
    cut = plan_drafts(rates, drafts, h200)
    assert 0 < sum(cut) < sum(drafts)
    steep = cost_of({1: 1.0, 2: 10.0})
    assert plan_drafts(rates, drafts, steep) == [0] * 8
    assert plan_drafts([0.0, 0.9], [4, 4], free) == [0, 4]  # a chain that never lands is never verified


def test_row_cost_interpolates_extrapolates_and_splits_forwards():
    cost = cost_of({4: 2.0, 8: 4.0}, max_rows=8)
    assert cost(6) == pytest.approx(3.0)
    assert cost(2) == pytest.approx(2.0)  # never below the smallest seen
    assert cost(16) == pytest.approx(8.0) and cost(12) == pytest.approx(6.0)  # two forwards of <= 8 rows
    cost.record(4, 4.0)  # an average per row count
    assert cost.ms[4] == pytest.approx(2.4)
    with pytest.raises(ValueError, match="two row counts"):
        RowCost(max_rows=8)(3)
    with pytest.raises(ValueError):
        cost.record(0, 1.0)


def test_acceptance_counts_accepted_drafts_against_rejections():
    acceptance = Acceptance()
    assert acceptance.rate == 0.5
    acceptance.record(4, 4)
    acceptance.record(4, 1)
    assert acceptance.rate == pytest.approx((1 + 5) / (1 + 5 + 1 + 1))
    with pytest.raises(ValueError):
        acceptance.record(2, 3)


def test_a_batch_that_cuts_chains_commits_what_plain_decoding_does(tiny_mtp_model):
    """Exact mode through batched rounds whose chains the engine cuts (a steep row cost): every
    session's tokens equal its plain decoding, and each outcome says how many drafts it verified."""
    from tests.verifier_service.test_engine_paths import decode, spec
    from verifier_service.engine import Engine
    from verifier_service.rounds import RoundRequest

    reference = Engine(tiny_mtp_model, max_context=96, prefill_chunk=8, fused="off")
    prompts = [[3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45], [1, 2, 3]]
    requests = [spec(p, temperature=0.8 if i else 0.0, max_new_tokens=12, request_id=str(i), seed=i)
                for i, p in enumerate(prompts)]  # greedy and sampled exact mode
    plain = [decode(reference, r, lambda ids: []) for r in requests]
    engine = Engine(tiny_mtp_model, max_context=96, prefill_chunk=8, fused="on", max_sessions=3, max_window=5,
                    window_sizing=True, row_invariant=False)  # (batched rows: tokens, not bits, are checked)
    engine.row_cost.ms.update({1: 1.0, 3: 1.5, 6: 9.0})
    sessions = [engine.open(r) for r in requests]
    for session in sessions:
        engine.prefill([(session, session.prefill_left)])
    emitted = [[] for _ in prompts]
    verified = []
    while any(len(e) < 12 for e in emitted):
        rounds = []
        for i, session in enumerate(sessions):
            done = len(emitted[i])
            if done < 12:
                rounds.append(RoundRequest(session, plain[i][done : done + 4][: session.capacity_left]))
        for r, outcome in zip(rounds, engine.run_rounds(rounds)):
            i = sessions.index(r.session)
            emitted[i].extend(outcome.emitted)
            verified.append((len(r.drafts), outcome.num_verified))
    assert [e[:12] for e in emitted] == plain
    assert any(v < asked for asked, v in verified)  # chains were cut
    assert all(v <= asked for asked, v in verified)
    for session in sessions:
        engine.close(session)
