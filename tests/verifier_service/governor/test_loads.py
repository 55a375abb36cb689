"""The governor under changing load (DESIGN §9): a ledger per load, a request whose load
changed starts over under it, and the promise that a drafter that never pays is left however
the load moves."""

from __future__ import annotations

import pytest

from verifier_service.governor import Governor, Ledgers, Load

from .conftest import ALONE, SETTINGS, fast_drafter, round_robin, run, slow_drafter


def test_a_verdict_learnt_under_one_load_does_not_decide_for_the_other():
    """8 requests together learn that their drafts cost the batch more than they save (on a CPU a
    step costs about its rows); a request alone later must find out for itself — here its drafter
    pays — and the verdict it learns must not send the next batch speculating."""
    ledgers = Ledgers(SETTINGS)
    round_robin([Governor(SETTINGS, ledgers, load=Load.SHARED) for _ in range(8)], 40, slow_drafter, load=Load.SHARED)
    assert ledgers[Load.SHARED, False].pays() is False and ledgers[ALONE, False].pays() is None
    alone = Governor(SETTINGS, ledgers)  # no verdict alone: it explores
    assert alone.next_speculates and alone.exploring
    kinds = run(alone, 30, fast_drafter)
    assert kinds[:5] == [True] * 5 and alone.detaches == 0 and sum(kinds) >= 30 - 5 - 1
    assert ledgers[ALONE, False].pays() is True and ledgers[Load.SHARED, False].pays() is False
    assert Governor(SETTINGS, ledgers).next_speculates  # the next request alone speculates at once
    assert not Governor(SETTINGS, ledgers, load=Load.SHARED).next_speculates  # one in a batch does not


def test_a_request_whose_load_changes_starts_over_under_the_new_one():
    """Once `judge_rounds` rounds in a row began under the other load: speculating, at once (no
    round is promised plain); plain, at the end of its phase (the engine loop runs its promised
    rounds without asking). Its own estimates stay with the old load."""
    ledgers = Ledgers(SETTINGS)
    round_robin([Governor(SETTINGS, ledgers, load=Load.SHARED) for _ in range(2)], 40, slow_drafter,
                load=Load.SHARED)  # under load speculation does not pay
    run(Governor(SETTINGS, ledgers), 30, fast_drafter)  # alone it does
    assert ledgers[Load.SHARED, False].pays() is False and ledgers[ALONE, False].pays() is True
    governor = Governor(SETTINGS, ledgers)
    clock = [0.0]
    run(governor, 1, fast_drafter, clock)
    kinds = run(governor, SETTINGS.judge_rounds - 1, fast_drafter, clock, Load.SHARED)
    assert all(kinds) and governor.load_changes == 0 and governor.next_speculates  # (not yet a change)
    assert run(governor, 1, fast_drafter, clock, Load.SHARED) == [True]  # (decided before: it speculates)
    assert governor.load_changes == 1 and governor.load == Load.SHARED
    assert not governor.next_speculates and governor.plain_ahead() == SETTINGS.min_hold
    assert len(governor.speculative) == 0 and len(governor.plain) == 0
    # plain under load, promised min_hold rounds; alone again, it keeps them, then starts over
    kinds = run(governor, SETTINGS.judge_rounds - 1, fast_drafter, clock)
    assert kinds == [False] * (SETTINGS.judge_rounds - 1) and governor.load_changes == 1
    run(governor, 1, fast_drafter, clock)
    assert governor.load_changes == 2 and governor.load == ALONE and governor.next_speculates


def test_a_round_counts_under_the_load_it_began_with():
    ledgers = Ledgers(SETTINGS)
    governor = Governor(SETTINGS, ledgers, drafting=False)  # (plain rounds only: every one would count)
    clock = [0.0]
    run(governor, 4, slow_drafter, clock)  # 2 closed and counted: the first round of a phase is not, the 4th is open
    assert len(ledgers[ALONE, False].plain) == 2
    run(governor, 4, slow_drafter, clock, load=Load.SHARED)  # the 4th alone round (ended shared) counts alone
    assert len(ledgers[ALONE, False].plain) == 3 and len(ledgers[Load.SHARED, False].plain) == 3
    run(governor, 1, slow_drafter, clock)
    assert len(ledgers[Load.SHARED, False].plain) == 4 and len(ledgers[ALONE, False].plain) == 3



@pytest.mark.parametrize("every", [1, 3, 7, 9, 20])
def test_a_drafter_that_never_pays_is_left_even_when_the_load_changes_all_the_time(every):
    """Loads flipping every `every` rounds (2 requests, a drafter slower than plain in every
    round): each load's ledger reaches its verdict and speculation stops. Were a request to start
    over at every flip (or rounds spanning a flip left uncounted), its phases would never end and
    its explorers would speculate on for ever."""
    ledgers = Ledgers(SETTINGS)
    governors = [Governor(SETTINGS, ledgers) for _ in range(2)]
    clocks = [[0.0], [0.0]]
    kinds: list[bool] = []
    for n in range(600):
        load = Load.SHARED if (n // every) % 2 else ALONE
        for governor, clock in zip(governors, clocks):
            kinds.extend(run(governor, 1, slow_drafter, clock, load))
    assert ledgers[ALONE, False].pays() is False and ledgers[Load.SHARED, False].pays() is False
    assert sum(kinds[200:]) <= 0.1 * len(kinds[200:]), sum(kinds[200:])  # (probes aside)
