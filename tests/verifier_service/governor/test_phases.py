"""Why each phase of a request's rounds began (`Governor.phases`, the verifier's
tandem_verifier_governor_phases metric and its debug log line)."""

from __future__ import annotations

from collections import Counter

import pytest

from verifier_service.governor import Governor, Ledgers, Phase

from .conftest import SETTINGS, fast_drafter, round_robin, slow_drafter


def test_every_phase_is_counted_by_why_it_began():
    """`Governor.phases` (the verifier's tandem_verifier_governor_phases metric): a fresh server's
    first requests explore or await, a drafter slower than plain detaches them and then the
    server's verdict starts the next request plain; a fast drafter's verdict starts it speculating."""
    ledgers = Ledgers(SETTINGS)
    governors = [Governor(SETTINGS, ledgers) for _ in range(SETTINGS.max_explorers + 1)]
    assert [g.phases for g in governors] == [Counter({Phase.EXPLORE: 1})] * SETTINGS.max_explorers + [Counter({Phase.AWAIT: 1})]
    round_robin(governors, 40, slow_drafter)
    explorer, awaiting = governors[0], governors[-1]
    assert explorer.phases[Phase.DETACH] >= 1 and explorer.phases[Phase.DETACH] == explorer.detaches
    assert awaiting.phases[Phase.VERDICT_PLAIN] >= 1 and Phase.DETACH not in awaiting.phases  # (it never speculated)
    assert Governor(SETTINGS, ledgers).phases == Counter({Phase.VERDICT_PLAIN: 1})
    assert Governor(SETTINGS, ledgers, drafting=False).phases == Counter({Phase.NOT_DRAFTING: 1})

    fast = Ledgers(SETTINGS)
    round_robin([Governor(SETTINGS, fast) for _ in range(2)], 40, fast_drafter)
    assert Governor(SETTINGS, fast).phases == Counter({Phase.VERDICT: 1})


def test_a_phase_s_debug_line_says_what_its_decision_saw():
    """The `governor phase` debug line (TANDEM_LOG_LEVEL=debug): why, the estimates it judged by,
    and what the rounds since the phase before cost the other lanes and were refunded."""
    from structlog.testing import capture_logs
    with capture_logs() as lines:
        governor = Governor(SETTINGS, Ledgers(SETTINGS))
        clock = [0.0]
        for _ in range(SETTINGS.judge_rounds - 1):  # speculative rounds that charge the others 1 ms each
            governor.begin(clock[0])
            clock[0] += 0.040
            governor.end(3, cost_to_others_s=0.001, cost_from_others_s=0.0005)
        governor.begin(clock[0])  # its last round begins: the judgement (no plain cost known: it calibrates)
    explore, calibrate = (line for line in lines if line["event"] == "governor phase")
    assert explore["why"] == "explore" and explore["charged_s"] == 0.0
    assert calibrate["why"] == "calibrate" and not calibrate["speculating"]
    assert calibrate["charged_s"] == pytest.approx(0.001 * (SETTINGS.judge_rounds - 1))
    assert calibrate["refunded_s"] == pytest.approx(0.0005 * (SETTINGS.judge_rounds - 1))
    assert calibrate["own"][1] is None and calibrate["own"][0] == pytest.approx((0.040 + 0.001 - 0.0005) / 3)
    assert governor.charged_s == 0.0  # (counted afresh for the next phase)
