"""The speculation governor's decisions (DESIGN §9), on a scripted clock: when a request
detaches its drafter, how long it holds, when it probes, what it learns from the server."""

from __future__ import annotations

import pytest

from verifier_service.governor import CostWindow, Governor, GovernorSettings, Ledger

SETTINGS = GovernorSettings(judge_rounds=5, min_hold=4, max_hold=16, window=8, server_window=8)


def run(governor: Governor, rounds: int, cost, clock: list[float] | None = None) -> list[bool]:
    """Drive `rounds` rounds; cost(speculative) -> (seconds, tokens). Returns each round's kind."""
    clock = clock if clock is not None else [0.0]
    kinds = []
    for _ in range(rounds):
        speculative = governor.begin(clock[0])
        seconds, tokens = cost(speculative)
        clock[0] += seconds
        governor.end(tokens)
        kinds.append(speculative)
    return kinds


def slow_drafter(speculative: bool) -> tuple[float, int]:
    # 3 tokens in 40 ms with drafts (13.3 ms/token) against 1 token in 5 ms without
    return (0.040, 3) if speculative else (0.005, 1)


def fast_drafter(speculative: bool) -> tuple[float, int]:
    return (0.008, 3) if speculative else (0.005, 1)  # 2.7 ms/token against 5


def runs(kinds: list[bool]) -> list[tuple[bool, int]]:
    """Run-length encoding of the round kinds."""
    out: list[tuple[bool, int]] = []
    for kind in kinds:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + 1)
        else:
            out.append((kind, 1))
    return out


def test_a_drafter_that_does_not_pay_is_detached_with_a_doubling_hold_up_to_the_cap():
    ledger = Ledger(SETTINGS)
    governor = Governor(SETTINGS, ledger)
    kinds = run(governor, 120, slow_drafter)
    # 5 speculative rounds, 5 plain ones to calibrate (nothing plain was known), then holds of
    # 4, 8, 16, 16, ... plain rounds, each followed by a probe of 5 speculative rounds.
    expected = [(True, 5), (False, 5 + 4), (True, 5), (False, 8), (True, 5), (False, 16), (True, 5), (False, 16)]
    assert runs(kinds)[: len(expected)] == expected
    assert governor.detaches == len([r for r in runs(kinds) if not r[0]])
    assert governor.probes == governor.detaches - (runs(kinds)[-1][0] is False)
    # what it costs: the speculative share falls towards judge_rounds / (judge_rounds + max_hold)
    assert sum(kinds[60:]) / 60 < 0.3


def test_a_drafter_that_pays_is_kept():
    governor = Governor(SETTINGS, Ledger(SETTINGS))
    kinds = run(governor, 100, fast_drafter)
    # one calibration of the plain cost after the first judgement, speculation ever after
    assert runs(kinds) == [(True, 5), (False, 5), (True, 90)]
    assert governor.detaches == 0


def test_a_known_plain_cost_skips_the_calibration():
    ledger = Ledger(SETTINGS)
    run(Governor(SETTINGS, ledger, drafting=False), 10, slow_drafter)  # a request without drafts
    assert len(ledger.plain) == 8 and len(ledger.speculative) == 0  # (its first round is not measured)
    governor = Governor(SETTINGS, ledger)
    kinds = run(governor, 10, slow_drafter)
    assert runs(kinds) == [(True, 5), (False, 4), (True, 1)]  # detached at the first judgement, then a probe
    assert governor.detaches == 1 and not governor.calibrating


def test_the_first_round_of_a_phase_is_not_measured():
    governor = Governor(SETTINGS, Ledger(SETTINGS))
    first = [True]

    def cost(speculative: bool) -> tuple[float, int]:
        if speculative and first[0]:  # the first chain waits for the drafter's catch-up
            first[0] = False
            return 1.0, 1
        return (0.004, 2) if speculative else (0.003, 1)

    kinds = run(governor, 5, cost)
    assert governor.speculative.per_token() == pytest.approx(0.002)  # rounds 2-4 only
    kinds += run(governor, 25, cost)
    # counted, the 1 s round would make speculation (144 ms/token) look slower than plain (3)
    assert runs(kinds) == [(True, 5), (False, 5), (True, 20)] and governor.detaches == 0


def test_a_new_request_starts_plain_when_the_server_says_speculation_does_not_pay():
    ledger = Ledger(SETTINGS)
    for _ in range(3):
        run(Governor(SETTINGS, ledger), 40, slow_drafter)
    assert ledger.pays() is False
    governor = Governor(SETTINGS, ledger)
    assert not governor.next_speculates
    kinds = run(governor, 10, slow_drafter)
    assert runs(kinds) == [(False, 4), (True, 5), (False, 1)]  # holds, probes, detaches again
    # a server where it pays starts speculating at once
    paying = Ledger(SETTINGS)
    for _ in range(3):
        run(Governor(SETTINGS, paying), 40, fast_drafter)
    assert paying.pays() is True and Governor(SETTINGS, paying).next_speculates


def test_a_change_in_conditions_is_seen_at_the_next_probe():
    governor = Governor(SETTINGS, Ledger(SETTINGS))
    drafter = [slow_drafter]
    kinds = run(governor, 30, lambda s: drafter[0](s))
    assert not kinds[-1] or governor.detaches
    drafter[0] = fast_drafter  # the drafter recovers (load went away)
    later = run(governor, 60, lambda s: drafter[0](s))
    assert all(later[-30:])


def test_the_estimates_are_per_token_over_a_window():
    window = CostWindow(3)
    assert window.per_token() is None
    for seconds, tokens in [(9.0, 1), (1.0, 1), (2.0, 2), (3.0, 1)]:
        window.add(seconds, tokens)
    assert window.per_token() == pytest.approx(6.0 / 4)  # the oldest round left the window


@pytest.mark.parametrize("kwargs", [dict(judge_rounds=1), dict(min_hold=0), dict(min_hold=8, max_hold=4),
                                    dict(window=0), dict(server_window=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="governor"):
        GovernorSettings(**kwargs)
