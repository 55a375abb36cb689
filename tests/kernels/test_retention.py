"""DESIGN §4: step-aware retention — schedule, cumulative floor, parsing."""

import math

import pytest

from kernels.retention import MAX_SCHEDULE_STEPS, RetentionPolicy

HALVES = (0.5, 0.5, 0.5)


def keep(schedule=None, min_cum=None, min_p=0.0, confidences=HALVES):
    return RetentionPolicy.parse(schedule, min_cum, min_p=min_p).keep(confidences)


# The examples of DESIGN §4.
def test_flat_floor_keeps_all_three():
    assert keep(min_p=0.35) == 3


def test_cumulative_floor_keeps_two():
    assert keep(min_cum=0.2) == 2  # prefix products 0.5, 0.25, 0.125


def test_schedule_keeps_two():
    assert keep("0.10, 0.35, 0.55") == 2


def test_cheap_first_schedule_passes_a_low_first_step_that_a_flat_floor_cuts():
    assert keep(min_p=0.35, confidences=(0.2,)) == 0
    assert keep("0.10,0.35,0.55", confidences=(0.2,)) == 1


def test_schedule_overrides_the_caller_min_p():
    assert keep("0.1", min_p=0.9) == 3
    assert keep(None, min_p=0.9) == 0


def test_a_schedule_of_zero_uses_only_the_cumulative_floor():
    assert keep("0", "0.2", min_p=0.9) == 2


def test_both_floors_compose_by_and():
    # schedule passes all three; cumulative 0.2 cuts the third
    assert keep("0.1", 0.2) == 2
    # cumulative passes (0.9*0.9=0.81) but the schedule's second floor cuts
    assert keep("0.1,0.95", 0.5, confidences=(0.9, 0.9)) == 1


def test_equality_passes():
    assert keep("0.5") == 3
    assert keep(min_p=0.5) == 3
    assert keep(min_cum=0.125) == 3  # 0.5**3 is exact in float64
    assert keep(min_cum=0.25) == 2


def test_last_threshold_repeats():
    assert keep("0.1,0.6", confidences=(0.9, 0.7, 0.65, 0.59)) == 3
    assert RetentionPolicy.parse("0.1,0.6", None, min_p=0).threshold(7) == 0.6


def test_first_failure_ends_the_chain_even_if_later_steps_would_pass():
    assert keep(min_p=0.4, confidences=(0.9, 0.3, 0.9, 0.9)) == 1


def test_cumulative_product_is_float64_and_reset_each_call():
    policy = RetentionPolicy.parse(None, 0.3, min_p=0.0)
    assert policy.keep((0.6, 0.6)) == 2  # 0.36
    assert policy.keep((0.6, 0.6)) == 2  # no carry-over between rounds
    # 1 - 1e-9 rounds to 1.0 in float32, which would keep all three steps.
    assert RetentionPolicy.parse(None, 1 - 2.5e-9, min_p=0).keep((1 - 1e-9,) * 3) == 2


def test_zero_cumulative_floor_disables_it():
    assert keep(min_cum=0, confidences=(0.01, 0.01, 0.01)) == 3
    assert keep(min_cum="0", confidences=(0.01, 0.01, 0.01)) == 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -0.1, 1.5])
def test_non_finite_or_out_of_range_confidences_fail_closed(bad):
    assert keep(min_p=0.0, confidences=(0.9, bad, 0.9)) == 1
    assert keep("0", confidences=(bad,)) == 0


def test_empty_chain():
    assert keep(min_p=0.3, confidences=()) == 0


@pytest.mark.parametrize(
    "schedule,fragment",
    [
        ("", "''"),
        ("   ", "empty"),
        ("0.1,,0.3", "threshold 2 is empty"),
        ("0.1,", "threshold 2 is empty"),
        (",0.1", "threshold 1 is empty"),
        ("abc", "'abc' is not a number"),
        ("0.1;0.2", "'0.1;0.2' is not a number"),
        ("nan", "'nan' is not finite"),
        ("inf", "'inf' is not finite"),
        ("-inf", "'-inf' is not finite"),
        ("1.01", "'1.01' is outside [0, 1]"),
        ("-0.01", "'-0.01' is outside [0, 1]"),
        (",".join(["0.1"] * (MAX_SCHEDULE_STEPS + 1)), "9 thresholds"),
    ],
)
def test_malformed_schedules_are_rejected_naming_the_value(schedule, fragment):
    with pytest.raises(ValueError) as error:
        RetentionPolicy.parse(schedule, None, min_p=0.0)
    assert fragment in str(error.value)
    assert "retention schedule" in str(error.value)


@pytest.mark.parametrize(
    "min_cum,fragment",
    [("", "empty"), ("x", "'x' is not a number"), ("nan", "not finite"), (float("inf"), "not finite"),
     (1.5, "outside [0, 1]"), ("-0.2", "outside [0, 1]"), (True, "must be a number"), ([0.1], "must be a number")],
)
def test_malformed_cumulative_floors_are_rejected_naming_the_value(min_cum, fragment):
    with pytest.raises(ValueError) as error:
        RetentionPolicy.parse(None, min_cum, min_p=0.0)
    assert fragment in str(error.value)
    assert "min_cum" in str(error.value)


@pytest.mark.parametrize("min_p", [-0.1, 1.1, float("nan")])
def test_bad_caller_min_p_is_rejected(min_p):
    with pytest.raises(ValueError, match="min_p"):
        RetentionPolicy.parse(None, None, min_p=min_p)


def test_a_bad_item_rejects_the_whole_configuration():
    with pytest.raises(ValueError):
        RetentionPolicy.parse("0.1,0.2,bad", 0.2, min_p=0.0)


def test_whitespace_and_eight_steps_are_allowed():
    policy = RetentionPolicy.parse(" 0.1 ,0.2,  0.3,0.4,0.5,0.6,0.7,0.8 ", " 0.05 ", min_p=0.0)
    assert policy.schedule == (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    assert policy.min_cum == 0.05


def test_direct_construction_validates_too():
    with pytest.raises(ValueError):
        RetentionPolicy(schedule=())
    with pytest.raises(ValueError):
        RetentionPolicy(schedule=(math.nan,))
    with pytest.raises(ValueError):
        RetentionPolicy(min_cum=2.0)
