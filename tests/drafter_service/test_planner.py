"""The planner: expected-tokens-per-cost choice, learning, and request-initial snapshots."""

import copy
import itertools
import random

import pytest

from drafter_service.planner import (
    BUCKETS,
    EXPLORE_EVERY,
    PRIOR,
    Estimates,
    Plan,
    Planner,
    choose,
    suffix_bucket,
)
from drafter_service.proposers.suffix import SuffixIndex
from drafter_service.session import DraftSession
from kernels.retention import RetentionPolicy
from kernels.sampling import SamplingParams
from kernels.speculative import Gate, Mode

STEPS = 8


def set_acceptance(estimates, source, bucket, step, value, n=1000.0):
    """Counts that give acceptance(source, bucket, step) == value (prior included)."""
    a, b = PRIOR[source]
    estimates.tried[(source, bucket, step)] = n - (a + b)
    estimates.accepted[(source, bucket, step)] = value * n - a
    assert estimates.acceptance(source, bucket, step) == pytest.approx(value)


def flat_acceptance(estimates, source, bucket, value, steps=STEPS + 1):
    for step in range(steps):
        set_acceptance(estimates, source, bucket, step, value)


def linear_cost(estimates, base=10.0):
    estimates.verify_ms = {1: base}  # other rows: base * (1 + 0.2 (rows - 1))


def flat_cost(estimates, value=10.0, rows=40):
    estimates.verify_ms = {r: value for r in range(1, rows + 1)}


def run_choose(estimates, limit=STEPS, mtp=True, suffix_length=None, suffix_tokens=0, **extra):
    return choose(
        estimates,
        limit=limit,
        mtp_available=mtp,
        suffix_length=suffix_length,
        suffix_tokens=suffix_tokens,
        **extra,
    )


# --- suffix_bucket -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, bucket",
    [
        (1, 4),
        (2, 4),
        (3, 0),
        (4, 1),
        (7, 1),
        (8, 2),
        (15, 2),
        (16, 3),
        (31, 3),
        (32, 3),
        (33, 3),
        (1000, 3),
    ],
)
def test_suffix_bucket_boundaries(length, bucket):
    assert suffix_bucket(length) == bucket


def test_buckets_cover_match_lengths_without_gaps():
    ordered = sorted(BUCKETS)  # the short-match bucket comes last by index, first by length
    assert ordered[0][0] == 1 and ordered[-1][1] == 32
    for (_, high), (low, _) in itertools.pairwise(ordered):
        assert low == high + 1
    assert [suffix_bucket(n) for n in range(3, 33)] == sorted(suffix_bucket(n) for n in range(3, 33))
    assert all(BUCKETS[suffix_bucket(n)][0] <= n <= BUCKETS[suffix_bucket(n)][1] for n in range(1, 33))


# --- Estimates ---------------------------------------------------------------------------


def test_acceptance_prior_and_counts():
    e = Estimates()
    assert e.acceptance("MTP", 0, 0) == pytest.approx(0.5)  # Beta(2, 2)
    assert e.acceptance("SUFFIX", 2, 5) == pytest.approx(0.75)  # Beta(3, 1)
    e.tried[("MTP", 0, 1)] = 6
    e.accepted[("MTP", 0, 1)] = 6
    assert e.acceptance("MTP", 0, 1) == pytest.approx(8 / 10)
    assert e.acceptance("MTP", 0, 0) == pytest.approx(0.5)  # other steps untouched


def test_verify_cost_measured_else_linear_from_one_row():
    e = Estimates()
    assert e.verify_cost(1) == pytest.approx(1.0)
    assert e.verify_cost(6) == pytest.approx(2.0)
    e.verify_ms = {1: 10.0, 3: 50.0}
    assert e.verify_cost(3) == 50.0
    assert e.verify_cost(2) == pytest.approx(12.0)
    assert e.verify_cost(4) == pytest.approx(16.0)


# --- choose ------------------------------------------------------------------------------


def test_none_when_acceptance_is_poor_and_verify_cost_rises_steeply():
    e = Estimates()
    flat_acceptance(e, "MTP", 0, 0.05)
    for bucket in range(len(BUCKETS)):
        flat_acceptance(e, "SUFFIX", bucket, 0.05)
    e.verify_ms = {r: 10.0 * r * r for r in range(1, 20)}
    e.mtp_step_ms = 1.0
    plan = run_choose(e, suffix_length=5, suffix_tokens=8)
    assert plan == Plan("NONE", 0, 0, 1.0)


def test_none_when_nothing_is_available():
    e = Estimates()
    assert run_choose(e, mtp=False) == Plan("NONE", 0)
    assert run_choose(e, mtp=False, suffix_length=5, suffix_tokens=0) == Plan("NONE", 0)
    assert run_choose(e, limit=0, suffix_length=5, suffix_tokens=4) == Plan("NONE", 0)


def test_longer_mtp_chains_as_acceptance_rises():
    lengths = []
    for a in (0.3, 0.6, 0.8, 0.9, 0.95, 0.99):
        e = Estimates()
        linear_cost(e)
        e.mtp_step_ms = 1.0
        flat_acceptance(e, "MTP", 0, a)
        plan = run_choose(e)
        assert plan.source in ("MTP", "NONE")
        lengths.append(plan.num_drafts)
    assert lengths == sorted(lengths), lengths
    assert lengths[0] == 0  # 1.3 / 13 does not beat 1 / 10
    assert lengths[-1] == STEPS
    assert len(set(lengths)) >= 4, lengths


def test_suffix_chosen_over_mtp_when_its_bucket_is_good():
    e = Estimates()
    linear_cost(e)
    e.mtp_step_ms = 1.0
    flat_acceptance(e, "MTP", 0, 0.6)
    flat_acceptance(e, "SUFFIX", 2, 0.95)  # match lengths 8..15
    flat_acceptance(e, "SUFFIX", 0, 0.2)  # match length 3
    plan = run_choose(e, suffix_length=10, suffix_tokens=8)
    assert plan.source == "SUFFIX" and plan.bucket == 2 and plan.num_drafts >= 4
    # The same facts with a short (poor-bucket) match: MTP.
    plan = run_choose(e, suffix_length=3, suffix_tokens=8)
    assert plan.source == "MTP" and plan.bucket == 0


def test_limit_and_suffix_tokens_bound_k():
    e = Estimates()
    flat_cost(e)
    flat_acceptance(e, "SUFFIX", 1, 0.99, steps=40)
    flat_acceptance(e, "MTP", 0, 0.99, steps=40)
    assert run_choose(e, limit=8, mtp=False, suffix_length=5, suffix_tokens=3) == Plan(
        "SUFFIX", 3, 1, pytest.approx(1 + 0.99 + 0.99**2 + 0.99**3)
    )
    assert run_choose(e, limit=5, mtp=False, suffix_length=5, suffix_tokens=20).num_drafts == 5
    assert run_choose(e, limit=4, mtp=True).num_drafts == 4
    for limit, tokens in itertools.product(range(10), range(10)):
        plan = run_choose(e, limit=limit, suffix_length=5, suffix_tokens=tokens)
        assert plan.num_drafts <= limit
        if plan.source == "SUFFIX":
            assert plan.num_drafts <= tokens


def test_expected_tokens_hand_computed():
    e = Estimates()
    flat_cost(e)  # every window costs the same: the longest chain wins
    # SUFFIX prior Beta(3, 1): (accepted + 3) / (tried + 4).
    e.tried[("SUFFIX", 0, 0)], e.accepted[("SUFFIX", 0, 0)] = 6, 5  # 8/10 = 0.8
    e.tried[("SUFFIX", 0, 1)], e.accepted[("SUFFIX", 0, 1)] = 6, 2  # 5/10 = 0.5
    e.tried[("SUFFIX", 0, 2)], e.accepted[("SUFFIX", 0, 2)] = 8, 0  # 3/12 = 0.25
    kwargs = {"mtp_available": False, "suffix_length": 3, "suffix_tokens": 10}
    assert choose(e, limit=1, **kwargs) == Plan("SUFFIX", 1, 0, pytest.approx(1.8))
    assert choose(e, limit=2, **kwargs) == Plan("SUFFIX", 2, 0, pytest.approx(1 + 0.8 + 0.4))
    assert choose(e, limit=3, **kwargs) == Plan("SUFFIX", 3, 0, pytest.approx(1 + 0.8 + 0.4 + 0.1))
    # Step 3 falls back to the prior 0.75.
    assert choose(e, limit=4, **kwargs) == Plan("SUFFIX", 4, 0, pytest.approx(2.3 + 0.1 * 0.75))


def test_rate_includes_mtp_draft_cost():
    e = Estimates()
    flat_cost(e, 10.0)
    flat_acceptance(e, "MTP", 0, 0.5)
    # R_1 = 1.5 over 10 + draft: beats 1/10 only while the draft step costs under 5 ms.
    e.mtp_step_ms = 4.9
    assert run_choose(e, limit=1).source == "MTP"
    e.mtp_step_ms = 5.1
    assert run_choose(e, limit=1).source == "NONE"


def test_choose_is_a_pure_function_of_its_inputs():
    rng = random.Random(0)
    e = Estimates()
    for source, buckets in (("MTP", [0]), ("SUFFIX", range(len(BUCKETS)))):
        for bucket in buckets:
            for step in range(STEPS):
                set_acceptance(e, source, bucket, step, rng.uniform(0.2, 0.98))
    e.verify_ms = {r: 8.0 + rng.uniform(0, 3) * r for r in range(1, 6)}
    e.mtp_step_ms = 0.7
    frozen = copy.deepcopy(e)
    cases = list(
        itertools.product(
            range(9),
            (False, True),
            (None, 3, 5, 9, 20, 32),
            (0, 1, 4, 8),
            (1, EXPLORE_EVERY),
            ("adaptive", "mtp", "suffix"),
        )
    )

    def call(case):
        *facts, round_id, policy = case
        return run_choose(e, *facts, round_id=round_id, policy=policy)

    first = {case: call(case) for case in cases}
    for _ in range(5):
        for case in rng.sample(cases, len(cases)):
            assert call(case) == first[case]
    assert e == frozen  # choose does not touch its snapshot
    assert {plan.source for plan in first.values()} >= {"MTP", "SUFFIX", "NONE"}


def test_draft_cost_ignored_until_verify_costs_are_measured():
    e = Estimates()
    flat_acceptance(e, "MTP", 0, 0.9)
    e.mtp_step_ms = 1000.0  # ms, while the unmeasured verify model is unitless
    assert run_choose(e).source == "MTP"
    e.verify_ms = {1: 10.0}
    assert run_choose(e).source == "NONE"


def test_adaptive_explores_one_mtp_draft_on_schedule():
    e = Estimates()
    flat_acceptance(e, "MTP", 0, 0.05)
    linear_cost(e)
    e.mtp_step_ms = 1.0
    for round_id in range(4 * EXPLORE_EVERY):
        plan = run_choose(e, round_id=round_id)
        if round_id % EXPLORE_EVERY == 0:
            assert plan == Plan("MTP", 1, 0, pytest.approx(1.05))
        else:
            assert plan == Plan("NONE", 0)
    # Nothing to explore with: no MTP, or no drafts allowed.
    assert run_choose(e, mtp=False, round_id=EXPLORE_EVERY) == Plan("NONE", 0)
    assert run_choose(e, limit=0, round_id=EXPLORE_EVERY) == Plan("NONE", 0)
    # Exploration never overrides a profitable plan.
    flat_acceptance(e, "SUFFIX", 1, 0.99)
    plan = run_choose(e, suffix_length=5, suffix_tokens=6, round_id=EXPLORE_EVERY)
    assert plan == run_choose(e, suffix_length=5, suffix_tokens=6, round_id=1)
    assert plan.source == "SUFFIX"


def test_fixed_policies_ignore_estimates():
    e = Estimates()
    flat_acceptance(e, "MTP", 0, 0.01)
    flat_acceptance(e, "SUFFIX", 2, 0.01)
    e.verify_ms = {r: 10.0 * r * r for r in range(1, 20)}
    assert run_choose(e, limit=6, policy="mtp", suffix_length=9, suffix_tokens=8) == Plan("MTP", 6)
    assert run_choose(e, limit=6, mtp=False, policy="mtp") == Plan("NONE", 0)
    assert run_choose(e, limit=0, policy="mtp") == Plan("NONE", 0)
    assert run_choose(e, limit=6, policy="suffix", suffix_length=9, suffix_tokens=8) == Plan("SUFFIX", 6, 2)
    assert run_choose(e, limit=6, policy="suffix", suffix_length=9, suffix_tokens=4) == Plan("SUFFIX", 4, 2)
    assert run_choose(e, limit=6, policy="suffix", suffix_length=None, suffix_tokens=0) == Plan("NONE", 0)
    assert run_choose(e, limit=6, policy="suffix", suffix_length=9, suffix_tokens=0) == Plan("NONE", 0)


# --- Planner.learn -----------------------------------------------------------------------


def test_learn_counts_steps_up_to_the_first_rejection():
    p = Planner()
    p.learn("MTP", 0, verified=5, accepted=2, verify_ms=12.0, rows=6)
    e = p.live
    assert {k: v for k, v in e.tried.items()} == {
        ("MTP", 0, 0): 1,
        ("MTP", 0, 1): 1,
        ("MTP", 0, 2): 1,
    }
    assert {k: v for k, v in e.accepted.items()} == {("MTP", 0, 0): 1, ("MTP", 0, 1): 1}
    # Steps past accepted + 1 were never judged.
    assert ("MTP", 0, 3) not in e.tried and ("MTP", 0, 4) not in e.tried


def test_learn_all_accepted_and_none_verified():
    p = Planner()
    p.learn("SUFFIX", 2, verified=3, accepted=3, verify_ms=0.0, rows=4)
    assert p.live.tried == {("SUFFIX", 2, s): 1 for s in range(3)}
    assert p.live.accepted == {("SUFFIX", 2, s): 1 for s in range(3)}
    p.learn("SUFFIX", 2, verified=0, accepted=0, verify_ms=0.0, rows=1)
    p.learn("SUFFIX", 2, verified=4, accepted=0, verify_ms=0.0, rows=5)
    assert p.live.tried == {
        ("SUFFIX", 2, 0): 2,
        ("SUFFIX", 2, 1): 1,
        ("SUFFIX", 2, 2): 1,
    }
    assert p.live.accepted == {("SUFFIX", 2, s): 1 for s in range(3)}
    assert p.live.verify_ms == {}  # verify_ms 0: no cost learned
    assert p.live.acceptance("SUFFIX", 2, 0) == pytest.approx((1 + 3) / (2 + 4))


def test_learn_keys_by_source_and_bucket():
    p = Planner()
    p.learn("SUFFIX", 1, verified=2, accepted=1, verify_ms=0.0, rows=3)
    assert p.live.acceptance("SUFFIX", 0, 0) == pytest.approx(0.75)
    assert p.live.acceptance("MTP", 1, 0) == pytest.approx(0.5)
    assert p.live.acceptance("SUFFIX", 1, 0) == pytest.approx(4 / 5)
    assert p.live.acceptance("SUFFIX", 1, 1) == pytest.approx(3 / 5)


def test_verify_cost_ema_per_window_rows():
    p = Planner(ema=0.1)
    p.learn("MTP", 0, 2, 1, verify_ms=10.0, rows=3)
    assert p.live.verify_ms == {3: 10.0}
    p.learn("MTP", 0, 2, 1, verify_ms=20.0, rows=3)
    assert p.live.verify_ms[3] == pytest.approx(11.0)
    p.learn("MTP", 0, 0, 0, verify_ms=5.0, rows=1)
    assert p.live.verify_ms[1] == 5.0 and p.live.verify_ms[3] == pytest.approx(11.0)
    p.learn("MTP", 0, 2, 1, verify_ms=-1.0, rows=3)  # no measurement
    assert p.live.verify_ms[3] == pytest.approx(11.0)
    assert 2 not in p.live.verify_ms


def test_draft_cost_ema():
    p = Planner(ema=0.5)
    p.learn_draft_cost(4.0)
    assert p.live.mtp_step_ms == 4.0
    p.learn_draft_cost(8.0)
    assert p.live.mtp_step_ms == pytest.approx(6.0)


# --- snapshots (seed 002) ----------------------------------------------------------------


def test_snapshot_is_a_deep_copy():
    p = Planner()
    p.learn("MTP", 0, 3, 1, verify_ms=10.0, rows=4)
    p.learn_draft_cost(2.0)
    snap = p.snapshot()
    assert snap == p.live and snap is not p.live
    frozen = copy.deepcopy(snap)
    for _ in range(50):
        p.learn("MTP", 0, 3, 3, verify_ms=40.0, rows=4)
        p.learn("SUFFIX", 1, 2, 0, verify_ms=30.0, rows=3)
        p.learn_draft_cost(9.0)
    assert snap == frozen
    assert p.live != frozen
    # And the other way: editing a snapshot does not reach the live policy.
    live = copy.deepcopy(p.live)
    snap.tried[("MTP", 0, 0)] = 1e9
    snap.verify_ms[1] = 1e9
    assert p.live == live


def make_session(snapshot):
    return DraftSession(
        session_id="s",
        sampling=SamplingParams(),
        seed=1,
        mode=Mode.PROBABILISTIC,
        gate=Gate.TOP,
        coupled=False,
        policy=RetentionPolicy(),
        max_drafts=STEPS,
        snapshot=snapshot,
        suffix=SuffixIndex(),
        mtp=None,
        round_id=0,
    )


def test_session_choice_fixed_while_live_policy_learns():
    p = Planner()
    for _ in range(30):  # suffix looks great, MTP mediocre, verification cheap
        p.learn("SUFFIX", 1, 6, 6, verify_ms=10.0, rows=7)
        p.learn("MTP", 0, 4, 1, verify_ms=10.0, rows=5)
    p.learn("MTP", 0, 0, 0, verify_ms=10.0, rows=1)
    p.learn_draft_cost(1.0)
    session = make_session(p.snapshot())
    facts = {
        "limit": STEPS,
        "mtp_available": True,
        "suffix_length": 5,
        "suffix_tokens": 6,
    }
    before = choose(session.snapshot, **facts)
    assert before.source == "SUFFIX"
    for _ in range(200):  # the live policy turns against suffix drafts and long windows
        p.learn("SUFFIX", 1, 6, 0, verify_ms=80.0, rows=7)
        p.learn("MTP", 0, 4, 0, verify_ms=80.0, rows=5)
        p.learn_draft_cost(20.0)
    assert choose(p.snapshot(), **facts) != before  # the live policy did change its mind
    assert choose(session.snapshot, **facts) == before  # the open session did not
