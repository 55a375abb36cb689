"""DESIGN §3: verification modes, admission gates, and the output law they produce.

Two kinds of evidence:
- exact enumeration (`output_law`): every draft draw × admission × accept × residual branch,
  compared with the target law to 1e-12 — no sampling noise;
- Monte Carlo through the real sampler (drafter draws on the draft stream, admission
  confidences, RetentionPolicy.keep, verify_chains with Philox draws, plain decoding to
  complete the horizon) over N = 200,000 seeds per case, chi-square against the exact law
  at alpha = 1e-3. Seeds are fixed (0..N-1), so each test's outcome is deterministic.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from kernels.retention import RetentionPolicy
from kernels.sampling import SparseRows, draw
from kernels.speculative import (
    Gate,
    Mode,
    admission_confidences,
    chain_law,
    law_distance,
    output_law,
    target_law,
    verify_chain,
    verify_chains,
)

MC_DRAWS = 200_000
ALPHA = 1e-3
LAW_TOLERANCE = 1e-12
BASE = 17  # position of the first drafted token


# ---------------------------------------------------------------------------------------
# Prefix-dependent toy models: dense tables keyed by the tokens since the round started.
# ---------------------------------------------------------------------------------------


class Table:
    """A distribution for every prefix of length < depth over a small vocabulary."""

    def __init__(self, rows: dict[tuple[int, ...], list[float]], vocab: int):
        self.rows = rows
        self.vocab = vocab
        self._stacked = {}

    def __call__(self, prefix):
        return self.rows[tuple(prefix)]

    @staticmethod
    def random(rng, vocab, depth, *, concentration=0.6, sparse=False, point_mass=False):
        rows = {}
        for length in range(depth):
            for prefix in itertools.product(range(vocab), repeat=length):
                if point_mass:
                    row = [0.0] * vocab
                    row[int(rng.integers(vocab))] = 1.0
                else:
                    row = rng.dirichlet([concentration] * vocab)
                    if sparse and vocab > 2:  # holes in the support exercise sparse rows
                        row[int(rng.integers(vocab))] = 0.0
                        row = row / row.sum()
                    row = [float(x) for x in row]
                rows[prefix] = row
        return Table(rows, vocab)

    def dense(self, prefixes):
        """[n, vocab] float64 rows for a [n, length] tensor of prefixes (vectorised lookup)."""
        length = prefixes.shape[1]
        if length not in self._stacked:
            keys = list(itertools.product(range(self.vocab), repeat=length))
            self._stacked[length] = torch.tensor([self.rows[k] for k in keys], dtype=torch.float64)
        code = torch.zeros(prefixes.shape[0], dtype=torch.int64)
        for i in range(length):  # base-vocab number, first token most significant
            code = code * self.vocab + prefixes[:, i]
        return self._stacked[length][code]


def dense_rows(probs):
    n, vocab = probs.shape
    return SparseRows(torch.arange(vocab, dtype=torch.int64).expand(n, vocab).contiguous(), probs)


def simulate(p, q, *, mode, gate, policy, num_drafts, horizon, seeds, point_mass=False, coupled=False):
    """The real sampler pipeline over a batch of seeds; returns [n, horizon] token ids."""
    n = seeds.shape[0]
    positions = torch.full((n,), BASE, dtype=torch.int64)
    drafts = torch.zeros((n, num_drafts), dtype=torch.int64)
    q_dense = []
    for step in range(num_drafts):
        rows = q.dense(drafts[:, :step])
        q_dense.append(rows)
        stream = "pick" if coupled else "draft"
        drafts[:, step] = draw(dense_rows(rows), seeds, positions + step, stream=stream)
    q_rows = dense_rows(torch.stack(q_dense, dim=1).reshape(n * num_drafts, -1))
    confidences = admission_confidences(
        drafts.reshape(-1), None if point_mass else q_rows, mode=mode, gate=gate
    ).view(n, num_drafts)
    kept = torch.tensor([policy.keep(c) for c in confidences.tolist()], dtype=torch.int64)
    target = torch.stack([p.dense(drafts[:, :step]) for step in range(num_drafts + 1)], dim=1)
    verdict = verify_chains(
        dense_rows(target.reshape(n * (num_drafts + 1), -1)),
        drafts,
        kept,
        None if point_mass else q_rows,
        mode=mode,
        seed=seeds,
        base_positions=positions,
    )
    tokens = torch.full((n, horizon), -1, dtype=torch.int64)
    width = min(horizon, num_drafts + 1)
    tokens[:, :width] = verdict.emitted_ids[:, :width]
    for t in range(horizon):  # plain decoding after the round
        todo = verdict.num_emitted <= t
        if bool(todo.any()):
            rows = dense_rows(p.dense(tokens[todo, :t]))
            tokens[todo, t] = draw(rows, seeds[todo], positions[todo] + t)
    return tokens, verdict


def plain_decode(p, horizon, seeds):
    n = seeds.shape[0]
    tokens = torch.zeros((n, horizon), dtype=torch.int64)
    for t in range(horizon):
        tokens[:, t] = draw(dense_rows(p.dense(tokens[:, :t])), seeds, torch.full((n,), BASE + t, dtype=torch.int64))
    return tokens


def chi_square_p_value(tokens, law):
    counts = {}
    for row in tokens.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    n = tokens.shape[0]
    assert set(counts) <= {k for k, v in law.items() if v > 0}, "an outcome the law gives probability 0"
    observed, expected, rest_obs, rest_exp = [], [], 0, 0.0
    for key, prob in law.items():
        if n * prob >= 5:
            observed.append(counts.get(key, 0))
            expected.append(n * prob)
        else:  # pool sparse cells
            rest_obs += counts.get(key, 0)
            rest_exp += n * prob
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    expected = np.array(expected) * (sum(observed) / sum(expected))
    return stats.chisquare(observed, expected).pvalue


# ---------------------------------------------------------------------------------------
# Exact enumeration
# ---------------------------------------------------------------------------------------

SWEEP_THRESHOLDS = [0.0, 0.25, 0.5, 0.75, 0.95]
SWEEP_TABLES = 30


def sweep_cases():
    for vocab in (2, 3, 4):
        for num_drafts in (1, 2):
            for threshold in SWEEP_THRESHOLDS:
                yield vocab, num_drafts, threshold


def test_top_gate_law_equals_target_law_over_900_cases():
    rng = np.random.default_rng(20261129)
    cases = 0
    pick_biased = 0
    for vocab, num_drafts, threshold in sweep_cases():
        for _ in range(SWEEP_TABLES):
            p = Table.random(rng, vocab, num_drafts + 1, sparse=True)
            q = Table.random(rng, vocab, num_drafts, concentration=0.4)
            policy = RetentionPolicy(schedule=(threshold,))
            horizon = num_drafts + 1
            law = output_law(p, q, num_drafts=num_drafts, mode=Mode.PROBABILISTIC, gate=Gate.TOP, policy=policy, horizon=horizon)
            target = target_law(p, horizon)
            assert law_distance(law, target) < LAW_TOLERANCE, (vocab, num_drafts, threshold, p.rows, q.rows)
            assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
            pick = output_law(p, q, num_drafts=num_drafts, mode=Mode.PROBABILISTIC, gate=Gate.PICK, policy=policy, horizon=horizon)
            pick_biased += law_distance(pick, target) > 1e-6
            cases += 1
    assert cases == 900
    # The sweep has power: the own-draw gate moves the law in many of the same cases.
    assert pick_biased > 300


def test_point_mass_drafts_law_equals_target_law():
    rng = np.random.default_rng(7)
    cases = 0
    for vocab, num_drafts, threshold in sweep_cases():
        for _ in range(6):
            p = Table.random(rng, vocab, num_drafts + 1, sparse=True)
            q = Table.random(rng, vocab, num_drafts, point_mass=True)
            law = output_law(
                p, q, num_drafts=num_drafts, mode=Mode.PROBABILISTIC, gate=Gate.TOP,
                policy=RetentionPolicy(schedule=(threshold,)), horizon=num_drafts + 1, point_mass=True,
            )
            assert law_distance(law, target_law(p, num_drafts + 1)) < LAW_TOLERANCE
            cases += 1
    assert cases == 180


def test_cumulative_floor_and_schedule_keep_the_law():
    rng = np.random.default_rng(11)
    policies = [RetentionPolicy(schedule=(0.1, 0.6)), RetentionPolicy(min_cum=0.3, min_p=0.2), RetentionPolicy(schedule=(0.9, 0.0), min_cum=0.5)]
    for policy in policies:
        for _ in range(20):
            p = Table.random(rng, 3, 3)
            q = Table.random(rng, 3, 2, concentration=0.3)
            law = output_law(p, q, num_drafts=2, mode=Mode.PROBABILISTIC, gate=Gate.TOP, policy=policy, horizon=3)
            assert law_distance(law, target_law(p, 3)) < LAW_TOLERANCE


def test_exact_mode_law_is_the_target_law_whatever_the_gate():
    rng = np.random.default_rng(3)
    for gate in Gate:
        for _ in range(30):
            p = Table.random(rng, 3, 3)
            q = Table.random(rng, 3, 2)
            law = output_law(p, q, num_drafts=2, mode=Mode.EXACT, gate=gate, policy=RetentionPolicy(schedule=(0.5,)), horizon=3)
            assert law_distance(law, target_law(p, 3)) < LAW_TOLERANCE


def worked_case():
    p = Table({(): [0.5, 0.5], (0,): [0.5, 0.5], (1,): [0.5, 0.5]}, 2)
    q = Table({(): [0.875, 0.125]}, 2)
    return p, q


def test_pick_gate_reproduces_the_worked_case():
    """DESIGN §3: p(A)=p(B)=0.5, q(A)=0.875, threshold 0.5: pick gives P(A)=0.5625, top 0.5."""
    p, q = worked_case()
    policy = RetentionPolicy(schedule=(0.5,))
    kwargs = dict(num_drafts=1, mode=Mode.PROBABILISTIC, policy=policy, horizon=1)
    assert output_law(p, q, gate=Gate.PICK, **kwargs)[(0,)] == pytest.approx(0.5625, abs=1e-15)
    assert output_law(p, q, gate=Gate.TOP, **kwargs)[(0,)] == pytest.approx(0.5, abs=1e-15)


def test_choosing_the_source_by_the_sampled_draft_biases_the_law():
    """Seed 002's table: use suffix lookup only when its token matches the sampled MTP token."""
    p, q = worked_case()
    mtp_q = q(())
    suffix_token = 0  # suffix lookup proposes A as a point mass

    def law_of(choose_suffix):
        law = {}
        for d, qd in enumerate(mtp_q):  # the MTP draw
            if choose_suffix(d):
                branch = chain_law(p, [suffix_token], None, mode=Mode.PROBABILISTIC)
            else:
                branch = chain_law(p, [d], [mtp_q], mode=Mode.PROBABILISTIC)
            for tokens, prob in branch.items():
                law[tokens[:1]] = law.get(tokens[:1], 0.0) + qd * prob
        return law

    biased = law_of(lambda d: d == suffix_token)
    assert biased[(0,)] == pytest.approx(0.4375, abs=1e-15)
    for fixed_choice in (True, False):  # a choice made without looking at the draw
        assert law_of(lambda d, c=fixed_choice: c)[(0,)] == pytest.approx(0.5, abs=1e-15)


# ---------------------------------------------------------------------------------------
# Monte Carlo through the real sampler
# ---------------------------------------------------------------------------------------

SEEDS = torch.arange(MC_DRAWS, dtype=torch.int64)


@pytest.mark.parametrize(
    "vocab,policy,point_mass,table_seed",
    [
        (3, RetentionPolicy(schedule=(0.5,)), False, 1),
        (4, RetentionPolicy(min_cum=0.3, min_p=0.2), False, 2),
        (3, RetentionPolicy(), True, 3),
    ],
    ids=["top-threshold-0.5", "top-cumulative", "point-mass"],
)
def test_sampler_matches_target_law_by_chi_square(vocab, policy, point_mass, table_seed):
    rng = np.random.default_rng(table_seed)
    p = Table.random(rng, vocab, 3)
    q = Table.random(rng, vocab, 2, concentration=0.3, point_mass=point_mass)
    tokens, verdict = simulate(
        p, q, mode=Mode.PROBABILISTIC, gate=Gate.TOP, policy=policy, num_drafts=2, horizon=3,
        seeds=SEEDS, point_mass=point_mass,
    )
    assert 0 < float(verdict.num_accepted.float().mean()) < 2  # both branches exercised
    assert chi_square_p_value(tokens, target_law(p, 3)) > ALPHA


def test_sampler_with_pick_gate_follows_its_biased_law():
    p, q = worked_case()
    policy = RetentionPolicy(schedule=(0.5,))
    tokens, _ = simulate(p, q, mode=Mode.PROBABILISTIC, gate=Gate.PICK, policy=policy, num_drafts=1, horizon=1, seeds=SEEDS)
    pick_law = output_law(p, q, num_drafts=1, mode=Mode.PROBABILISTIC, gate=Gate.PICK, policy=policy, horizon=1)
    assert chi_square_p_value(tokens, pick_law) > ALPHA
    assert chi_square_p_value(tokens, target_law(p, 1)) < 1e-12  # and the bias is visible


@pytest.mark.parametrize("coupled", [False, True], ids=["independent-drafts", "coupled-drafts"])
def test_exact_mode_is_token_identical_to_plain_sampling(coupled):
    rng = np.random.default_rng(5)
    p = Table.random(rng, 4, 4)
    q = Table.random(rng, 4, 3, concentration=2.0)
    tokens, verdict = simulate(
        p, q, mode=Mode.EXACT, gate=Gate.TOP, policy=RetentionPolicy(), num_drafts=3, horizon=4,
        seeds=SEEDS, coupled=coupled,
    )
    assert torch.equal(tokens, plain_decode(p, 4, SEEDS))
    accepted = float(verdict.num_accepted.float().mean())
    assert accepted > 0.2
    if coupled:  # same u_pick on both sides: drafts agree far more often
        independent = simulate(p, q, mode=Mode.EXACT, gate=Gate.TOP, policy=RetentionPolicy(), num_drafts=3, horizon=4, seeds=SEEDS)[1]
        assert accepted > float(independent.num_accepted.float().mean()) + 0.2


def test_greedy_exact_mode_accepts_matching_prefix_then_corrects():
    target = SparseRows.from_dicts([{4: 1.0}, {2: 1.0}, {9: 1.0}, {1: 1.0}])
    verdict = verify_chain(target, [4, 2, 7], None, mode=Mode.EXACT, seed=0, base_position=3)
    assert verdict.emitted() == [4, 2, 9]
    assert verdict.accepted[0].tolist() == [True, True, False]
    verdict = verify_chain(target, [4, 2, 9], None, mode=Mode.EXACT, seed=0, base_position=3)
    assert verdict.emitted() == [4, 2, 9, 1]  # bonus token
    assert int(verdict.num_accepted[0]) == 3


def test_fewer_retained_drafts_than_chain_slots():
    target = SparseRows.from_dicts([{4: 1.0}, {2: 1.0}, {9: 1.0}])
    verdict = verify_chains(
        target, torch.tensor([[4, 2]]), torch.tensor([1]), None, mode=Mode.EXACT, seed=1, base_positions=torch.tensor([0])
    )
    assert verdict.emitted() == [4, 2]  # one accepted draft, then the bonus from p_1
    assert verdict.accepted[0].tolist() == [True, False]


def test_zero_drafts_is_plain_decoding():
    logits_rows = SparseRows.from_dicts([{0: 0.2, 5: 0.8}])
    for seed in range(50):
        for mode in Mode:
            verdict = verify_chain(logits_rows, [], None, mode=mode, seed=seed, base_position=9)
            assert verdict.emitted() == draw(logits_rows, seed, torch.tensor([9])).tolist()


def test_point_mass_rejection_samples_p_without_the_draft():
    target = SparseRows.from_dicts([{0: 0.5, 1: 0.3, 2: 0.2}, {0: 1.0}])
    seen = set()
    for seed in range(400):
        verdict = verify_chain(target, [0], None, mode=Mode.PROBABILISTIC, seed=seed, base_position=0)
        if not bool(verdict.accepted[0, 0]):
            seen.add(verdict.emitted()[0])
    assert seen == {1, 2}


def test_admission_confidences():
    q = SparseRows.from_dicts([{0: 0.875, 1: 0.125}, {0: 0.3, 2: 0.7}])
    drafts = torch.tensor([1, 0])
    top = admission_confidences(drafts, q, mode=Mode.PROBABILISTIC, gate=Gate.TOP)
    pick = admission_confidences(drafts, q, mode=Mode.PROBABILISTIC, gate=Gate.PICK)
    exact = admission_confidences(drafts, q, mode=Mode.EXACT, gate=Gate.TOP)
    assert top.tolist() == [0.875, 0.7]
    assert pick.tolist() == [0.125, 0.3] == exact.tolist()
    assert admission_confidences(drafts, None, mode=Mode.PROBABILISTIC).tolist() == [1.0, 1.0]


def test_shape_errors_name_the_problem():
    target = SparseRows.from_dicts([{0: 1.0}])
    with pytest.raises(ValueError, match="target has 1 rows"):
        verify_chain(target, [0], None, mode=Mode.EXACT, seed=0, base_position=0)


def test_acceptance_rate_matches_theory():
    """P(accept) = sum_x min(p(x), q(x)) for one probabilistic step (N = 200k, 6-sigma band)."""
    p = SparseRows.from_dicts([{0: 0.6, 1: 0.3, 2: 0.1}] * 2)
    q_probs = {0: 0.2, 1: 0.5, 2: 0.3}
    n = MC_DRAWS
    q = SparseRows.from_dicts([q_probs])
    q_batch = SparseRows(q.token_ids.expand(n, -1).contiguous(), q.probs.expand(n, -1).contiguous())
    drafts = draw(q_batch, SEEDS, torch.full((n,), BASE, dtype=torch.int64), stream="draft")
    target = SparseRows(p.token_ids.repeat(n, 1), p.probs.repeat(n, 1))
    verdict = verify_chains(
        target, drafts.unsqueeze(-1), torch.ones(n, dtype=torch.int64), q_batch,
        mode=Mode.PROBABILISTIC, seed=SEEDS, base_positions=torch.full((n,), BASE, dtype=torch.int64),
    )
    expected = 0.2 + 0.3 + 0.1
    rate = float(verdict.num_accepted.double().mean())
    assert abs(rate - expected) < 6 * math.sqrt(expected * (1 - expected) / n)


@pytest.mark.parametrize("mode, sampler", [(Mode.EXACT, "inverse_cdf"), (Mode.EXACT, "gumbel"),
                                           (Mode.PROBABILISTIC, "inverse_cdf")])  # (gumbel: exact mode only)
def test_a_chain_s_verdict_does_not_depend_on_its_batch(mode, sampler):
    """verify_chains over 24 chains (per-chain seeds, 0..4 retained drafts, q rows or point
    masses) gives each chain the verdict verify_chain gives it alone."""
    generator = torch.Generator().manual_seed(11)
    batch, k, vocab = 24, 4, 7
    from kernels.sampling import SamplingParams, process_logits

    target = process_logits(torch.randn(batch * (k + 1), vocab, generator=generator), SamplingParams(temperature=1.0))
    q = process_logits(torch.randn(batch * k, vocab, generator=generator) * 2, SamplingParams(temperature=1.0))
    # drafts: mostly q's likely tokens, so chains accept and reject
    draft_ids = q.token_ids.gather(-1, q.probs.argmax(-1, keepdim=True)).view(batch, k)
    draft_ids = torch.where(torch.rand(batch, k, generator=generator) < 0.3, torch.randint(0, vocab, (batch, k), generator=generator), draft_ids)
    num_drafts = torch.randint(0, k + 1, (batch,), generator=generator)
    seeds = torch.randint(0, 2**62, (batch,), generator=generator)
    bases = torch.randint(0, 1000, (batch,), generator=generator)
    for q_rows in (q, None):
        together = verify_chains(target, draft_ids, num_drafts, q_rows, mode=mode, seed=seeds, base_positions=bases,
                                 sampler=sampler, accept_seed=seeds ^ 0x5A5A)
        for i in range(batch):
            n = int(num_drafts[i])
            alone = verify_chain(target[i * (k + 1) : i * (k + 1) + n + 1], draft_ids[i, :n].tolist(),
                                 None if q_rows is None else q_rows[i * k : i * k + n], mode=mode, seed=int(seeds[i]),
                                 base_position=int(bases[i]), sampler=sampler, accept_seed=int(seeds[i] ^ 0x5A5A))
            assert together.emitted(i) == alone.emitted(), (i, q_rows is None)
            assert together.accepted[i, :n].tolist() == alone.accepted[0].tolist()
        assert 0 < int(together.num_accepted.sum()) < int(num_drafts.sum())  # accepts and rejects
