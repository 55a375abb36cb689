"""The governor's plain rechecks (DESIGN §9): a plain cost measured under another load is
measured again, one request at a time, and the server's window stands until the recheck's
rounds replace it."""

from __future__ import annotations

from collections import Counter

import pytest

from verifier_service.governor import Governor, GovernorSettings, Ledgers, Load, Phase

from .conftest import ALONE, fast_drafter, round_robin, run


def test_a_plain_cost_measured_under_other_load_is_measured_again():
    """Plain rounds measured while the machine was busy (20 ms a token) make a far drafter's
    rounds (24 ms for 3 tokens) look worth it; once the load is gone plain decoding costs 3 ms a
    token, and a request that only speculates never sees it unless it measures plain again.
    It must: within `recheck_rounds` speculative rounds (then `judge_rounds` plain ones), it
    detaches, and stays mostly plain after."""
    settings = GovernorSettings(judge_rounds=5, min_hold=4, probe_share=0.05, window=8, server_window=8,
                                recheck_rounds=40)
    governor = Governor(settings, Ledgers(settings))
    rounds = [0]  # (a recheck is 4 plain rounds: half a judgement's, at least 4)

    def cost(speculative: bool) -> tuple[float, int]:
        rounds[0] += 1
        if speculative:
            return 0.024, 3
        return (0.020 if rounds[0] <= 20 else 0.003), 1

    kinds = run(governor, 400, cost)
    assert kinds[:5] == [True] * 5 and not any(kinds[5:10])  # the first judgement, the calibration (busy)
    first_detach = next(i for i in range(20, 400) if not kinds[i] and not kinds[i + 1])
    assert first_detach <= 20 + 40 + 2 * settings.judge_rounds
    assert governor.detaches >= 1 and sum(kinds[100:]) < 0.2 * 300  # then plain, but for probes


def test_a_drafter_that_pays_keeps_paying_across_plain_rechecks():
    """The recheck costs a drafter that pays little: `judge_rounds` plain rounds every
    `recheck_rounds` speculative ones, never a detach."""
    settings = GovernorSettings(judge_rounds=5, min_hold=4, probe_share=0.05, window=8, server_window=8,
                                recheck_rounds=40)
    governor = Governor(settings, Ledgers(settings))
    kinds = run(governor, 400, fast_drafter)
    assert governor.detaches == 0
    assert sum(not k for k in kinds) <= 5 + (400 // 40 + 1) * 4  # the first calibration, then 4 plain rounds per 40


def test_one_request_rechecks_at_a_time_and_an_ended_one_gives_the_place_back():
    settings = GovernorSettings(judge_rounds=5, min_hold=4, probe_share=0.05, window=8, server_window=8,
                                recheck_rounds=10)
    ledgers = Ledgers(settings)
    first, second = Governor(settings, ledgers), Governor(settings, ledgers)
    # 5 speculative rounds, a 5-round calibration, then speculation: past 10 speculative rounds
    # without a plain one (its 13th measured) its next judgement (its 25th round) takes the recheck
    clock = [0.0]
    run(first, 25, fast_drafter, clock)
    ledger = ledgers[ALONE, False]
    assert first.rechecking and ledger.rechecking and not first.next_speculates
    # the stale window stands until the recheck's first measured round replaces it: a request
    # arriving meanwhile still gets the server's verdict (an empty window left every request
    # arriving after a recheck exploring, and every one judging without a plain cost calibrating)
    stale = list(ledger.plain.rounds)
    assert len(stale) >= settings.recheck_measured and ledger.pays() is True
    assert Governor(settings, ledgers).next_speculates
    run(first, 2, lambda speculative: (0.004, 1), clock)  # the recheck's first round is not measured
    assert list(ledger.plain.rounds) == stale
    run(first, 1, lambda speculative: (0.004, 1), clock)
    assert list(ledger.plain.rounds) == [(pytest.approx(0.004), 1)]
    run(second, 40, fast_drafter)
    assert not second.rechecking  # the place was taken
    first.close()  # the request ended mid-recheck
    assert not ledgers[ALONE, False].rechecking and ledgers[ALONE, False].since_plain == 0
    ledgers[ALONE, False].since_plain = settings.recheck_rounds
    assert ledgers[ALONE, False].take_recheck()


def test_requests_beside_a_recheck_keep_the_servers_plain_cost_and_verdict():
    """8 lanes of a drafter that pays, rechecks every 40 of the server's speculative rounds (every
    5 steps of 8): requests speculating without a plain round of their own judge by the server's
    plain cost, and requests arriving keep getting its verdict — none calibrates or explores
    after the first wave's start (when the recheck emptied the window, every request judging
    during one calibrated: 0.91 speculative rounds at 8 lanes against 0.96 without rechecks)."""
    settings = GovernorSettings(judge_rounds=5, min_hold=4, window=8, server_window=8, recheck_rounds=40)
    ledgers = Ledgers(settings)
    first = [Governor(settings, ledgers, load=Load.SHARED) for _ in range(8)]
    round_robin(first, 12, fast_drafter, load=Load.SHARED)
    for governor in first:
        governor.close()  # (the requests end: a place they hold is given back)
    for wave in range(3):
        governors = [Governor(settings, ledgers, load=Load.SHARED) for _ in range(8)]
        kinds = round_robin(governors, 60, fast_drafter, load=Load.SHARED)
        for governor in governors:
            governor.close()
        phases = sum((g.phases for g in governors), Counter())
        assert phases[Phase.VERDICT] == 8 and phases[Phase.RECHECK] >= 4
        assert not phases.keys() & {Phase.CALIBRATE, Phase.EXPLORE, Phase.AWAIT, Phase.DETACH}
        # (the recheck's plain rounds: 4 every 40 speculative ones)
        assert sum(map(sum, kinds)) >= 0.88 * 8 * 60
