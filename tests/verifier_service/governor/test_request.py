"""The speculation governor's decisions (DESIGN §9), on a scripted clock: when a request
detaches its drafter, when it probes (the server's budget), what it learns from the server,
and the bound on what a drafter that never pays can cost."""

from __future__ import annotations

import pytest

from verifier_service.governor import CostWindow, Governor, GovernorSettings, Ledgers, Load

from .conftest import ALONE, SETTINGS, fast_drafter, round_robin, run, runs, slow_drafter


def test_a_drafter_that_does_not_pay_is_detached_and_probed_within_the_budget():
    ledgers = Ledgers(SETTINGS)
    governor = Governor(SETTINGS, ledgers)
    clock = [0.0]
    kinds = run(governor, 3000, slow_drafter, clock)
    shape = runs(kinds)
    # 5 speculative rounds, 5 plain ones to calibrate (nothing plain was known), then detached
    assert shape[0] == (True, 5) and not shape[1][0] and shape[1][1] > 5
    assert governor.detaches >= 2 and governor.probes == governor.detaches - 1
    # A probe loses 5 x (40 ms - 3 x 5 ms) = 125 ms against plain; the budget earns 5% of
    # each plain round (0.25 ms): a probe every 500 plain rounds or so, not before.
    holds = [n for kind, n in shape[1:] if not kind]
    assert all(n >= 490 for n in holds[1:-1]) and len(holds) >= 4
    # The bound: time lost against decoding all 3000 rounds' tokens plainly
    tokens = sum(3 if k else 1 for k in kinds)
    lost = clock[0] - tokens * 0.005
    plain_time = sum(0.005 for k in kinds if not k)
    assert lost <= 0.05 * plain_time + 2 * 0.125 + 0.2  # share of the plain time + a probe + the first judgement


def test_the_budget_is_the_server_s_a_probe_spends_it_for_every_request():
    ledgers = Ledgers(SETTINGS)
    first, second = Governor(SETTINGS, ledgers), Governor(SETTINGS, ledgers)
    clocks = [0.0], [0.0]
    run(first, 20, slow_drafter, clocks[0])
    run(second, 20, slow_drafter, clocks[1])
    ledgers[ALONE, False].credit_s = 0.126  # one probe's worth (5 x 25 ms)
    run(first, 10, slow_drafter, clocks[0])
    run(second, 10, slow_drafter, clocks[1])
    assert first.probes + second.probes == 1


def test_a_drafter_that_pays_is_kept():
    governor = Governor(SETTINGS, Ledgers(SETTINGS))
    kinds = run(governor, 100, fast_drafter)
    # one calibration of the plain cost after the first judgement, speculation ever after
    assert runs(kinds) == [(True, 5), (False, 5), (True, 90)]
    assert governor.detaches == 0


def test_a_drafter_that_pays_the_request_but_not_its_batch_is_detached():
    """In a batch the round's drafts also cost the other lanes (RoundOutcome.cost_to_others_s):
    8 ms for 3 tokens pays against 5 ms a token alone, not with 10 ms more of the others'."""
    governor = Governor(SETTINGS, Ledgers(SETTINGS))
    clock = [0.0]
    kinds = []
    for _ in range(20):
        speculative = governor.begin(clock[0])
        seconds, tokens = fast_drafter(speculative)
        clock[0] += seconds
        governor.end(tokens, cost_to_others_s=0.010 if speculative else 0.0)
        kinds.append(speculative)
    assert runs(kinds) == [(True, 5), (False, 15)] and governor.detaches == 1  # calibrated, then detached
    assert governor.speculative.per_token() == pytest.approx(0.018 / 3)  # own time and the others' together
    # the same rounds with a small cost to the others (a GPU's nearly free rows) keep speculating
    kept = Governor(SETTINGS, Ledgers(SETTINGS))
    clock = [0.0]
    for _ in range(20):
        speculative = kept.begin(clock[0])
        seconds, tokens = fast_drafter(speculative)
        clock[0] += seconds
        kept.end(tokens, cost_to_others_s=0.002 if speculative else 0.0)
    assert kept.detaches == 0 and kept.next_speculates


def test_a_plain_cost_measured_beside_drafting_lanes_is_the_plain_step_s():
    """A plain round in a step widened by the other lanes' drafts is refunded them
    (RoundOutcome.cost_from_others_s): a request calibrating its plain cost beside drafting
    lanes measures a plain step, and the drafter that does not pay its batch is detached. Without
    the refund the same rounds make plain look 4x dearer and speculation stays on."""
    def calibrate(refund: bool) -> Governor:
        governor = Governor(SETTINGS, Ledgers(SETTINGS))
        clock = [0.0]
        for _ in range(20):
            speculative = governor.begin(clock[0])
            seconds, tokens = fast_drafter(speculative)
            others = 0.0 if speculative else 0.015  # plain: a 5 ms step made 20 ms by the others' draft rows
            clock[0] += seconds + others
            governor.end(tokens, cost_to_others_s=0.010 if speculative else 0.0,
                         cost_from_others_s=others if refund else 0.0)
        return governor

    refunded = calibrate(True)
    assert refunded.plain.per_token() == pytest.approx(0.005) and refunded.detaches == 1
    assert not calibrate(False).detaches  # (20 ms a plain token: 18 ms for 3 speculative ones looks cheap)


def test_a_known_plain_cost_skips_the_calibration():
    ledgers = Ledgers(SETTINGS)
    run(Governor(SETTINGS, ledgers, drafting=False), 10, slow_drafter)  # a request without drafts
    assert len(ledgers[ALONE, False].plain) == 8 and len(ledgers[ALONE, False].speculative) == 0  # (its first round is not measured)
    governor = Governor(SETTINGS, ledgers)
    kinds = run(governor, 10, slow_drafter)
    assert runs(kinds) == [(True, 5), (False, 5)]  # detached at the first judgement (no budget to probe yet)
    assert governor.detaches == 1 and not governor.calibrating


def test_the_first_round_of_a_phase_is_not_measured():
    governor = Governor(SETTINGS, Ledgers(SETTINGS))
    first = [True]

    def cost(speculative: bool) -> tuple[float, int]:
        if speculative and first[0]:  # the first chain waits for the drafter's catch-up
            first[0] = False
            return 1.0, 1
        return (0.004, 2) if speculative else (0.003, 1)

    clock = [0.0]
    kinds = run(governor, 5, cost, clock)
    assert governor.speculative.per_token() == pytest.approx(0.002)  # rounds 2-4 only
    kinds += run(governor, 25, cost, clock)
    # counted, the 1 s round would make speculation (144 ms/token) look slower than plain (3)
    assert runs(kinds) == [(True, 5), (False, 5), (True, 20)] and governor.detaches == 0


def test_a_new_request_starts_plain_when_the_server_says_speculation_does_not_pay():
    ledgers = Ledgers(SETTINGS)
    for _ in range(3):
        run(Governor(SETTINGS, ledgers), 40, slow_drafter)
    assert ledgers[ALONE, False].pays() is False
    governor = Governor(SETTINGS, ledgers)
    assert not governor.next_speculates
    ledgers[ALONE, False].credit_s = 10.0  # plenty: it probes after its hold, then detaches again
    kinds = run(governor, 10, slow_drafter)
    assert runs(kinds) == [(False, 4), (True, 5), (False, 1)]
    # a server where it pays starts speculating at once
    paying = Ledgers(SETTINGS)
    for _ in range(3):
        run(Governor(SETTINGS, paying), 40, fast_drafter)
    assert paying[ALONE, False].pays() is True and Governor(SETTINGS, paying).next_speculates


def test_a_probe_that_pays_reattaches_and_is_refunded():
    governor = Governor(SETTINGS, Ledgers(SETTINGS))
    drafter, clock = [slow_drafter], [0.0]
    run(governor, 10, lambda s: drafter[0](s), clock)
    assert governor.detaches == 1
    governor.ledger.credit_s = 0.2
    drafter[0] = fast_drafter  # the drafter recovers (load went away)
    later = run(governor, 60, lambda s: drafter[0](s), clock)
    assert runs(later)[-1] == (True, 60 - later.index(True)) and governor.probes == 1
    # it gained against plain (8 ms for 3 tokens vs 15): more credit than it started with
    assert governor.ledger.credit_s > 0.2


def test_the_estimates_are_per_token_over_a_window():
    window = CostWindow(3)
    assert window.per_token() is None
    for seconds, tokens in [(9.0, 1), (1.0, 1), (2.0, 2), (3.0, 1)]:
        window.add(seconds, tokens)
    assert window.per_token() == pytest.approx(6.0 / 4)  # the oldest round left the window


@pytest.mark.parametrize("kwargs", [dict(judge_rounds=1), dict(min_hold=0), dict(probe_share=0.0),
                                    dict(probe_share=float("nan")), dict(margin=1.0), dict(confidence_z=-1.0), dict(window=0), dict(server_window=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="governor"):
        GovernorSettings(**kwargs)


def test_requests_that_never_draft_do_not_fund_probes_and_openings_count_in_a_probe_s_cost():
    ledgers = Ledgers(SETTINGS)
    run(Governor(SETTINGS, ledgers, drafting=False), 50, slow_drafter)
    assert ledgers[ALONE, False].credit_s == 0.0 and len(ledgers[ALONE, False].plain) == 8
    governor = Governor(SETTINGS, ledgers)
    first = [True]

    def cost(speculative: bool) -> tuple[float, int]:
        if speculative and first[0]:  # opening the drafter: 100 ms for one token
            first[0] = False
            return 0.100, 1
        return slow_drafter(speculative)

    run(governor, 10, cost)
    assert governor.detaches == 1
    assert ledgers[ALONE, False].opening_excess_s == pytest.approx(0.25 * 0.095)  # one opening seen, EMA 0.25
    # (judge_rounds - 1) rounds of 25 ms, plus the opening
    assert governor._expected_probe_loss() == pytest.approx(4 * 0.025 + 0.25 * 0.095)


def chain_tokens(rng, alpha: float = 0.8, k: int = 4) -> int:
    """Tokens a round commits with k drafts each accepted with probability alpha (1 to k + 1)."""
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted + 1


@pytest.mark.parametrize("round_ms,paying", [(6.1, True), (20.0, False)])
def test_noisy_rounds_are_judged_by_their_trend_not_their_luck(round_ms, paying):
    """Seeded simulation (2,000 rounds, default settings): alpha 0.8, 4 drafts (3.36 tokens a
    round on average, 1 to 5), plain 3.3 ms a token. At 6.1 ms a round speculation pays (1.8
    ms a token: no detach, plain only to recheck its cost); at 20 ms it does not (6 ms a token:
    detached, probes only)."""
    import random
    rng = random.Random(7)
    settings = GovernorSettings()
    governor = Governor(settings, Ledgers(settings))
    kinds = run(governor, 2000, lambda s: (round_ms / 1e3, chain_tokens(rng)) if s else (0.0033, 1))
    if paying:
        assert governor.detaches == 0 and sum(kinds) / len(kinds) > 0.98  # (4 plain rounds every 256: 0.985)
    else:
        assert governor.detaches >= 1 and sum(kinds) / len(kinds) < 0.05


@pytest.mark.parametrize("round_ms", [10.5, 12.0, 14.0, 20.0])
def test_throughput_stays_within_the_probe_budget_of_the_better_of_the_two(round_ms):
    """Seeded simulation, 3,000 rounds, 4 seeds: tokens per second against the better of plain
    decoding and always speculating (speculation is worth 3.36 x 3.3 ms = 11.1 ms a round).
    Measured (default settings): 0.99 of it at 10.5 ms (near break-even), 0.957-0.968 beyond.
    Bar: >= 0.94 on every seed, i.e. the 3% probe budget plus the noise of judging."""
    import random
    for seed in range(4):
        rng = random.Random(seed)
        settings = GovernorSettings()
        governor = Governor(settings, Ledgers(settings))
        clock, tokens = [0.0], [0]

        def cost(speculative: bool) -> tuple[float, int]:
            seconds, committed = (round_ms / 1e3, chain_tokens(rng)) if speculative else (0.0033, 1)
            tokens[0] += committed
            return seconds, committed

        run(governor, 3000, cost, clock)
        best = max(1 / 0.0033, 3.36 / (round_ms / 1e3))
        assert tokens[0] / clock[0] / best >= 0.94, seed


def test_a_detach_against_the_server_s_evidence_probes_again_early():
    settings = GovernorSettings(judge_rounds=5, min_hold=8, probe_share=0.05, window=8, server_window=64)
    ledgers = Ledgers(settings)
    for _ in range(3):
        run(Governor(settings, ledgers), 40, fast_drafter)  # the server's rounds: speculation pays
    governor = Governor(settings, ledgers)
    luck = iter([(0.008, 3)] + [(0.040, 1)] * 4)  # this request's rounds 2-5 commit one token each
    kinds = run(governor, 20, lambda s: next(luck, fast_drafter(s)) if s else fast_drafter(s))
    # detached at the first judgement, probed again after min_hold // 4 = 2 plain rounds (not 8)
    assert runs(kinds)[:3] == [(True, 5), (False, 2), (True, 13)]
    assert governor.detaches == 1 and governor.probes == 1


def test_the_server_s_verdict_follows_the_same_noise_rule():
    """64 noisy rounds that pay on average (alpha 0.8, 6.1 ms a round: 1.8 ms a token against
    3.3) never make the server start requests plain, on any of 20 seeds."""
    import random
    for seed in range(20):
        rng = random.Random(seed)
        settings = GovernorSettings()
        ledgers = Ledgers(settings)
        for _ in range(64):
            ledgers[ALONE, False].speculative.add(0.0061, chain_tokens(rng))
            ledgers[ALONE, False].plain.add(0.0033, 1)
        assert ledgers[ALONE, False].pays() is True, seed


@pytest.mark.parametrize("paying", [False, True])
def test_requests_arriving_together_send_two_explorers_and_the_rest_follow_the_verdict(paying):
    """8 requests on a fresh server: 2 speculate to find out (max_explorers), 6 start plain and
    look at the server's verdict every verdict_rounds rounds. A drafter that does not pay is
    then paid for by the 2 alone; one that pays has every request speculating within two looks."""
    ledgers = Ledgers(SETTINGS)
    governors = [Governor(SETTINGS, ledgers) for _ in range(8)]
    assert [g.next_speculates for g in governors] == [True] * 2 + [False] * 6
    kinds = round_robin(governors, 40, fast_drafter if paying else slow_drafter)
    waiting = kinds[2:]
    if paying:
        assert ledgers[ALONE, False].pays() is True
        assert all(seen.index(True) <= 2 * SETTINGS.verdict_rounds for seen in waiting)
        assert all(all(seen[2 * SETTINGS.verdict_rounds:]) for seen in waiting)  # and they stay
    else:
        assert ledgers[ALONE, False].pays() is False
        assert not any(any(seen) for seen in waiting)  # (the budget holds no probe yet)
        assert sum(g.detaches for g in governors) == 2
    assert ledgers[ALONE, False].explorers == 0  # both explorers judged: their places are free again


def test_an_explorer_that_ends_before_judging_gives_its_place_back():
    ledgers = Ledgers(SETTINGS)
    first, second = Governor(SETTINGS, ledgers), Governor(SETTINGS, ledgers)
    third = Governor(SETTINGS, ledgers)
    assert (first.next_speculates, second.next_speculates, third.next_speculates) == (True, True, False)
    run(first, 2, slow_drafter)
    first.close()  # the request ended (or was cancelled) before its judgement
    first.close()  # (twice is once)
    assert ledgers[ALONE, False].explorers == 1
    assert Governor(SETTINGS, ledgers).next_speculates
    assert ledgers[ALONE, False].explorers == 2
    # a waiting request takes a place freed while it waits, at its next look
    second.close()
    kinds = run(third, SETTINGS.verdict_rounds + 1, slow_drafter)
    assert kinds == [False] * SETTINGS.verdict_rounds + [True] and third.exploring


@pytest.mark.parametrize("seed", range(6))
def test_rounds_promised_plain_are_plain(seed):
    """plain_ahead() is what the engine loop runs without asking the request (verifier_service.loop):
    every round it promises after the current one must begin plain, through detaches, probes,
    calibration, verdict looks and explorers (8 requests, random paying and non-paying costs)."""
    import random

    rng = random.Random(seed)
    settings = GovernorSettings(judge_rounds=3, min_hold=4, probe_share=0.2, window=4, server_window=8,
                                max_explorers=1, verdict_rounds=2)
    ledgers = Ledgers(settings)
    governors = [Governor(settings, ledgers, drafting=i != 7) for i in range(8)]
    promised = [0] * 8  # rounds still promised plain, per request
    clock = [0.0] * 8
    checked = 0
    load = ALONE
    for _ in range(300):
        if rng.random() < 0.05:  # (the other lanes come and go: each request's load changes)
            load = Load.SHARED if load == ALONE else ALONE
        for i, governor in enumerate(governors):
            speculative = governor.begin(clock[i], load)
            if promised[i]:
                assert not speculative, (seed, i)
                promised[i] -= 1
                checked += 1
            ahead = governor.plain_ahead()
            if ahead is None:
                assert not governor.drafting
                ahead = 10
            promised[i] = max(promised[i], ahead)
            paying = rng.random() < 0.5
            clock[i] += (0.004 if paying else 0.030) if speculative else 0.005
            governor.end(rng.randint(1, 4) if speculative else 1)
        if rng.random() < 0.02:  # a request ends; a new one takes its place
            j = rng.randrange(7)
            governors[j].close()
            governors[j], promised[j] = Governor(settings, ledgers), 0
    assert checked > 500  # (the promises were exercised)
    assert sum(g.detaches + g.probes for g in governors) > 0
    assert sum(g.load_changes for g in governors) > 0


def server_ledgers(plain_s: float, speculative_s: float, opening_s: float) -> Ledgers:
    """Ledgers whose alone greedy rounds say: plain costs `plain_s` a token, a speculative round
    commits 3 tokens in `speculative_s`, opening the drafter loses `opening_s`."""
    ledgers = Ledgers(SETTINGS)
    ledger = ledgers[ALONE, False]
    for _ in range(8):
        ledger.plain.add(plain_s, 1)
        ledger.speculative.add(speculative_s, 3)
    ledger.opening_excess_s = opening_s
    return ledgers


def test_a_request_too_short_to_repay_the_drafter_s_opening_starts_plain():
    """Speculation pays 0.5 ms a token (2.5 against 3) and opening the drafter loses 20 ms: a
    request of 64 tokens repays it (32 ms), one of 30 cannot (15 ms) and starts plain; one with
    no bound known speculates as before."""
    ledgers = server_ledgers(0.003, 0.0075, 0.020)
    assert ledgers[ALONE, False].pays()
    assert Governor(SETTINGS, ledgers, max_tokens=64).next_speculates
    assert not Governor(SETTINGS, ledgers, max_tokens=30).next_speculates
    assert Governor(SETTINGS, ledgers).next_speculates
    # drafts that only tie (3 ms a token either way) count as paying, yet repay no opening at all
    tie = server_ledgers(0.003, 0.009, 0.001)
    assert tie[ALONE, False].pays() and not Governor(SETTINGS, tie, max_tokens=4096).next_speculates
    tie[ALONE, False].opening_excess_s = 0.0  # no opening cost seen: a tie speculates as before
    assert Governor(SETTINGS, tie, max_tokens=4096).next_speculates


def test_the_tokens_left_decide_as_the_request_goes_on():
    """The bound is the tokens the request has left, not those it started with."""
    governor = Governor(SETTINGS, server_ledgers(0.003, 0.0075, 0.020), max_tokens=100)
    assert governor._repays_opening()  # 50 ms >= 20
    run(governor, 1, lambda speculative: (0.0075, 70) if speculative else (0.003, 70))  # a round of 70 tokens
    assert governor.committed == 70 and not governor._repays_opening()  # 15 ms < 20
