"""The engine loop's per-row step cost (verifier_service.step_costs): the slope of a step's
seconds on its rows over the last steps, and what a round's drafts cost the other lanes."""

import random

import pytest

from verifier_service.step_costs import StepCosts


def test_the_per_row_cost_is_the_slope_of_the_steps_seconds_on_their_rows():
    costs = StepCosts(window=64, min_steps=8)
    rng = random.Random(0)
    for _ in range(64):
        rows = rng.randint(1, 40)
        costs.add(rows, 0.002 + 0.0005 * rows + rng.uniform(-1e-5, 1e-5))
    assert costs.per_row_s() == pytest.approx(0.0005, rel=0.02)
    # 4 drafts in a step of 8 lanes: 4 rows more for 7 other rounds
    assert costs.charges(8, 4, 1).to_others_s(4) == pytest.approx(4 * 7 * 0.0005, rel=0.02)
    assert costs.charges(8, 4, 1).to_others_s(0) == 0.0 and costs.charges(1, 4, 1).to_others_s(4) == 0.0


def test_unknown_until_enough_steps_of_different_rows():
    costs = StepCosts(window=16, min_steps=4)
    for _ in range(10):
        costs.add(8, 0.01)
    assert costs.per_row_s() is None and costs.charges(8, 4, 1).to_others_s(4) == 0.0  # one row count: no slope
    costs.add(1, 0.003)
    assert costs.per_row_s() == pytest.approx(0.001)
    fresh = StepCosts(window=16, min_steps=4)
    for rows in (1, 8, 1):
        fresh.add(rows, 0.001 * rows)
    assert fresh.per_row_s() is None  # fewer than min_steps


def test_old_steps_leave_the_window_and_a_falling_line_reads_as_free_rows():
    costs = StepCosts(window=10, min_steps=2)
    for i in range(10):
        costs.add(1 + i % 5, 0.001 * (1 + i % 5))  # 1 ms a row
    for i in range(10):
        costs.add(1 + i % 5, 0.002 + 0.0001 * (1 + i % 5))  # the device got cheaper per row
    assert costs.per_row_s() == pytest.approx(0.0001)
    for i in range(10):
        costs.add(1 + i % 5, 0.01 - 0.001 * (1 + i % 5))  # noise that falls with rows: not a negative cost
    assert costs.per_row_s() == 0.0


@pytest.mark.parametrize("args", [(1, 1), (8, 1), (8, 9)])
def test_bad_windows_are_refused(args):
    with pytest.raises(ValueError):
        StepCosts(*args)


def test_bad_steps_are_refused():
    with pytest.raises(ValueError):
        StepCosts().add(0, 0.1)
    with pytest.raises(ValueError):
        StepCosts().add(3, float("nan"))


def test_what_a_working_drafter_adds_to_a_step_is_fitted_apart_from_the_rows():
    """Steps cost 0.5 ms a row plus 2 ms, and 3 ms more while a drafter works (on a CPU: the
    verifier gave it a core). Drafting steps also have more rows (their drafts), so a slope
    fitted on all steps together would read the drafter's cost as a row cost."""
    costs = StepCosts(window=128, min_steps=8)
    rng = random.Random(1)
    for _ in range(128):
        drafting = rng.random() < 0.5
        lanes = rng.randint(1, 8)
        rows = lanes + (4 * rng.randint(1, lanes) if drafting else 0)
        costs.add(rows, 0.002 + 0.0005 * rows + (0.003 if drafting else 0.0) + rng.uniform(-1e-5, 1e-5), drafting)
    assert costs.per_row_s() == pytest.approx(0.0005, rel=0.02)
    assert costs.drafting_s() == pytest.approx(0.003, rel=0.02)
    # one lane of 8 drafts 4: its rows cost the 7 others 4 rows each, the drafter 3 ms each
    assert costs.charges(8, 4, 1).to_others_s(4) == pytest.approx(4 * 7 * 0.0005 + 7 * 0.003, rel=0.02)
    # 2 of 8 lanes draft: they share what the drafter cost the 6 that did not
    assert costs.charges(8, 8, 2).to_others_s(4) == pytest.approx(4 * 7 * 0.0005 + 6 * 0.003 / 2, rel=0.02)
    # every lane drafts: each one's own rounds measure the drafter's cost; only the rows are charged
    assert costs.charges(8, 32, 8).to_others_s(4) == pytest.approx(4 * 7 * 0.0005, rel=0.02)


def test_a_drafter_s_cost_is_unknown_until_both_kinds_of_step_were_seen():
    costs = StepCosts(window=64, min_steps=4)
    for rows in (1, 2, 3, 4, 5, 6):
        costs.add(rows, 0.001 * rows)
    assert costs.per_row_s() == pytest.approx(0.001) and costs.drafting_s() is None
    for rows in (5, 6, 7):
        costs.add(rows, 0.001 * rows + 0.004, drafting=True)
    assert costs.drafting_s() is None  # (3 drafting steps: fewer than min_steps)
    costs.add(8, 0.012, drafting=True)
    assert costs.drafting_s() == pytest.approx(0.004)
    assert costs.charges(4, 2, 1).to_others_s(2) == pytest.approx(0.001 * 2 * 3 + 0.004 * 3)


def test_what_the_other_lanes_added_is_what_they_are_charged_for_it():
    # 0.5 ms a row, a working drafter adds 3 ms (as in the fit test above): in a step of 8 lanes
    # where lanes with 4 and 2 drafts draft, each lane is refunded the others' rows (and, without
    # drafts, the drafter's addition); over the step the refunds are the charges.
    costs = StepCosts(window=64, min_steps=4)
    for rows in (8, 16, 24, 40, 8, 16, 24, 40):
        costs.add(rows, 0.001 + 0.0005 * rows, drafting=False)
        costs.add(rows, 0.004 + 0.0005 * rows, drafting=True)
    drafts = [4, 2, 0, 0, 0, 0, 0, 0]
    step = costs.charges(8, 6, 2)
    refunds = [step.from_others_s(d) for d in drafts]
    assert refunds[0] == pytest.approx(2 * 0.0005) and refunds[1] == pytest.approx(4 * 0.0005)
    assert refunds[2] == pytest.approx(6 * 0.0005 + 0.003, rel=0.02)
    charges = [step.to_others_s(d) for d in drafts]
    assert sum(refunds) == pytest.approx(sum(charges), rel=0.02)
    assert costs.charges(1, 0, 0).from_others_s(0) == 0.0 and costs.charges(8, 4, 1).from_others_s(4) == 0.0  # (no others' rows)


def test_a_step_s_draft_rows_are_priced_at_the_slope_between_its_plain_rows_and_its_rows():
    """A GPU's mixture-of-experts step (30B shapes on an H100, round figures): its rows route to
    more distinct experts as they grow — 1 row 3 ms, 8 rows 10 ms, 16 rows 12 ms, 40 rows 16 ms.
    Eight lanes' draft rows are priced on the chord from 8 rows to the step's rows, not on a
    line through the steps of lanes joining one at a time (~1 ms a row), which priced two
    explorers beside six plain lanes out of speculating (docs/PERFORMANCE.md, session 43)."""
    costs = StepCosts(window=256, min_steps=8)
    curve = {1: 0.003, 2: 0.004, 3: 0.005, 4: 0.006, 5: 0.007, 6: 0.008, 7: 0.009, 8: 0.010, 12: 0.011,
             16: 0.012, 24: 0.0133, 32: 0.0147, 40: 0.016}
    for rows in range(1, 9):  # a fresh server: lanes join after their prefills, then two explore
        costs.add(rows, curve[rows])
    for _ in range(6):
        for rows in (8, 16, 12):
            costs.add(rows, curve[rows])
    two_explorers = costs.charges(8, 8, 2)  # 6 plain lanes, 2 with 4 drafts: 16 rows
    assert two_explorers.per_row_s == pytest.approx((0.012 - 0.010) / 8, rel=0.1)
    assert costs.per_row_s() > 2 * two_explorers.per_row_s  # (the whole window's line: the joins' steep part)
    for _ in range(20):  # then every lane speculates, now and then one plain
        for rows in (40, 40, 36, 32, 24):
            costs.add(rows, curve.get(rows, 0.0154))
    every_lane = costs.charges(8, 32, 8)  # 40 rows
    assert every_lane.per_row_s == pytest.approx((0.016 - 0.010) / 32, rel=0.15)
    # a range with a single row count in it widens upward until it holds two, never below the
    # step's plain rows (the steep part a batch's drafts do not add to): else unknown
    assert costs.per_row_s(36, 36) == pytest.approx((0.016 - 0.0154) / 4, rel=0.25)
    assert costs.per_row_s(40, 40) is None and costs.charges(40, 0, 0).per_row_s == 0.0
    # a plain step's rows cost the others nothing, whatever the slope
    assert costs.charges(8, 0, 0).per_row_s == 0.0 and costs.charges(8, 0, 0).from_others_s(0) == 0.0


def test_a_range_needs_min_steps_of_its_own_before_its_slope_is_read():
    costs = StepCosts(window=64, min_steps=4)
    for _ in range(8):
        costs.add(1, 0.001)
        costs.add(4, 0.004)  # 1 ms a row from 1 to 4 rows
    costs.add(8, 0.0045)
    costs.add(9, 0.0050)  # two steps only from 8 rows on: too few to price a row there
    assert costs.per_row_s(8, 9) is None and costs.charges(8, 1, 1).to_others_s(1) == 0.0
    assert costs.per_row_s(1, 9) == pytest.approx(costs.per_row_s())  # (from one row: the whole window)
