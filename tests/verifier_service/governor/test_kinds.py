"""Greedy and sampled requests learn apart (DESIGN §9): their drafts are accepted at very
different rates, so a verdict learnt from one kind does not decide for the other."""

from __future__ import annotations

from verifier_service.governor import Governor, GovernorSettings, Ledgers

from .conftest import ALONE, SETTINGS, fast_drafter, run, slow_drafter


def sequence(ledgers: Ledgers, settings: GovernorSettings, kinds_and_costs, rounds: int) -> list[list[bool]]:
    """Requests one after another, each `rounds` rounds: (sampled, cost) per request."""
    return [run(Governor(settings, ledgers, sampled=sampled), rounds, cost) for sampled, cost in kinds_and_costs]


def test_greedy_requests_speculate_where_it_pays_them_though_it_costs_sampled_ones():
    """Greedy and sampled requests take turns; the drafter pays the greedy ones (2.7 ms a token
    against 5) and costs the sampled ones (13.3). One verdict for both read the sampled
    requests' detaches as the server's and started greedy requests plain; apart, each kind
    starts the way that pays it."""
    ledgers = Ledgers(SETTINGS)
    kinds = sequence(ledgers, SETTINGS, [(False, fast_drafter), (True, slow_drafter)] * 20, 40)
    greedy, sampled = kinds[0::2], kinds[1::2]
    assert ledgers[ALONE, False].pays() is True and ledgers[ALONE, True].pays() is False
    assert all(seen[0] for seen in greedy[1:])  # every greedy request after the first starts speculating
    assert sum(map(sum, greedy[1:])) >= 0.9 * sum(map(len, greedy[1:]))
    assert sum(map(sum, sampled[2:])) <= 0.15 * sum(map(len, sampled[2:]))  # (probes aside)
