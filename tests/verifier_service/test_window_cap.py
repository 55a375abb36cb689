"""Chains capped by the batch size (verifier_service.window_cap): the cost model, the choice,
and through a real verifier, lossless (exact mode) and absent where it must be."""

import asyncio

import pytest

from shared.protocol import common_pb2
from verifier_service.window_cap import Acceptance, StepCosts, best_drafts, chain_cap, expected_tokens

from .conftest import ScriptedDrafter, chain, generate, request


def step_costs(points: dict[int, float], max_rows: int = 64) -> StepCosts:
    costs = StepCosts(max_rows)
    for rows, ms in points.items():
        costs.observe(rows, ms)
    return costs


def test_costs_interpolate_extrapolate_and_split_large_steps():
    costs = step_costs({8: 8.0, 16: 10.0, 32: 16.0})
    assert costs.cost(8) == 8.0 and costs.cost(4) == 8.0  # no cheaper than the smallest measured
    assert costs.cost(12) == pytest.approx(9.0)
    assert costs.cost(48) == pytest.approx(22.0)  # the last slope, 6 ms per 16 rows
    assert costs.cost(64) == pytest.approx(28.0)
    assert costs.cost(100) == pytest.approx(28.0 + 16.0 + 6.0 * 4 / 16)  # 64 + 36 rows: two forwards
    assert step_costs({8: 8.0}).cost(8) is None  # one point says nothing about the slope
    assert StepCosts(64).cost(8) is None


def test_costs_average_and_ignore_nonsense():
    costs = StepCosts(16, smoothing=0.5)
    costs.observe(4, 10.0)
    costs.observe(4, 20.0)
    costs.observe(0, 5.0)
    costs.observe(17, 5.0)
    costs.observe(8, -1.0)
    assert costs.known() == {4: 15.0}
    with pytest.raises(ValueError, match="smoothing"):
        StepCosts(16, smoothing=0.0)


def test_the_cap_maximises_tokens_per_step_time():
    # Flat to 16 rows, then 0.5 ms a row: alone a chain is nearly free, in a batch it is not.
    costs = step_costs({1: 4.0, 16: 4.0, 64: 28.0})
    a = 0.8

    def brute(batch):
        rates = [expected_tokens(a, k) / costs.cost(batch * (k + 1)) for k in range(5)]
        return max(range(5), key=lambda k: (rates[k], -k))

    caps = [best_drafts(a, batch, 4, costs) for batch in (1, 2, 4, 8, 16, 32)]
    assert caps == [brute(b) for b in (1, 2, 4, 8, 16, 32)]
    assert caps[0] == 4 and caps[-1] == 0  # the whole chain alone, none at 32 sessions
    assert caps == sorted(caps, reverse=True)  # chains shorten as the batch grows
    assert best_drafts(0.95, 8, 4, costs) >= best_drafts(0.5, 8, 4, costs)
    assert expected_tokens(0.5, 3) == 1.875


def test_no_cap_alone_or_without_costs():
    costs = step_costs({1: 4.0, 16: 4.0, 64: 28.0})
    assert chain_cap(0.8, 1, 4, costs) == 4
    assert chain_cap(0.8, 32, 4, None) == 4
    assert chain_cap(0.8, 32, 4, StepCosts(64)) == 4
    assert chain_cap(0.8, 32, 4, costs) == 0
    assert Acceptance().rate == 0.5 and Acceptance(accepted=8, rejected=0).rate == 0.9


class FixedCosts(StepCosts):
    """Step costs a test sets: the engine's own observations are ignored."""

    def observe(self, rows, ms):
        pass


def propose(state):
    last = state.tokens[-1]
    return chain(state, [(last * 7 + j) % 97 for j in range(3)])


@pytest.fixture(autouse=True)
def torch_reference_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("mode", [common_pb2.MODE_EXACT, common_pb2.MODE_PROBABILISTIC])
async def test_batched_exact_rounds_verify_capped_chains_with_the_same_tokens(servers, tiny_model, mode):
    drafter = ScriptedDrafter(propose)
    stub = await servers.start(tiny_model, drafter=drafter, fused="on", max_sessions=4, batch_gather_ms=50.0)
    engine = servers.verifier.service.engine

    def req(seed):
        return request([seed, 2 * seed, 3 * seed], 10, temperature=0.0 if mode == common_pb2.MODE_EXACT else 0.9,
                       seed=seed, mode=mode, max_draft_tokens=3)

    alone = [(await generate(stub, req(seed)))[0] for seed in (1, 2, 3, 4)]
    # From two sessions on, a step costs 1 ms a row: one draft at most pays (any acceptance < 1).
    engine.step_costs = FixedCosts(engine.step_costs.max_rows)
    engine.step_costs._ms = {1: 1.0, 2: 2.0, 64: 64.0}
    drafter.sessions.clear()
    together = await asyncio.gather(*(generate(stub, req(seed)) for seed in (1, 2, 3, 4)))
    assert [tokens for tokens, _, _ in together] == alone
    retained = [r.retained for _, _, rounds in together for r in rounds]
    caps = [c.next_max_drafts for s in drafter.sessions for c in s.commits]
    if mode == common_pb2.MODE_EXACT:
        assert 0 in retained  # rounds that ran in a batch verified no drafts (1 ms a row: none pays)
        assert min(caps) == 0  # and the drafter was told
    else:  # probabilistic chains are never cut by load
        assert set(retained) == {3} and set(caps) == {3}
