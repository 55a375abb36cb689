"""The per-round drafter deadline: fixed, or recent p95 + margin; the first chain after an open waits longer."""

import pytest

from verifier_service.drafter_link import DeadlineTracker
from verifier_service.settings import VerifierSettings


def test_adaptive_deadline_is_p95_plus_margin_capped():
    tracker = DeadlineTracker(VerifierSettings(drafter_deadline_margin_ms=5.0, drafter_deadline_max_ms=100.0))
    assert tracker.deadline_s() == 0.1  # no history yet: the upper bound
    for wait in [2.0] * 19 + [40.0]:
        tracker.record(wait)
    assert tracker.deadline_s() == (40.0 + 5.0) / 1e3  # p95 of 20 samples is the largest here
    for wait in [500.0] * 20:
        tracker.record(wait)
    assert tracker.deadline_s() == 0.1  # capped


def test_first_chain_after_open_gets_the_upper_bound():
    tracker = DeadlineTracker(VerifierSettings(drafter_deadline_max_ms=250.0))
    for _ in range(20):
        tracker.record(3.0)
    assert tracker.deadline_s() == 0.008
    assert tracker.deadline_s(after_open=True) == 0.25


def test_fixed_deadline_wins():
    tracker = DeadlineTracker(VerifierSettings(drafter_deadline_ms=30.0))
    for _ in range(20):
        tracker.record(1.0)
    assert tracker.deadline_s() == tracker.deadline_s(after_open=True) == 0.03


async def test_each_commit_says_how_long_its_chain_is_waited_for(servers, tiny_model):
    """DraftCommit.wait_ms carries the deadline the verifier applies to the chain answering it
    (what the drafter sheds MTP drafts by): the upper bound while the stream is young, then
    the recent p95 plus the margin."""
    from tests.verifier_service.conftest import ScriptedDrafter, chain, generate, request

    drafter = ScriptedDrafter(lambda s: chain(s, [1]))
    stub = await servers.start(tiny_model, drafter=drafter, drafter_deadline_ms=0.0, drafter_deadline_max_ms=400.0,
                               drafter_deadline_margin_ms=5.0)
    await generate(stub, request([3, 4, 5], 24, max_draft_tokens=1))
    waits = [c.wait_ms for c in drafter.sessions[0].commits]
    assert len(waits) >= 12
    assert waits[0] == 400.0  # the second chain after the open is still lenient (LENIENT_CHAINS)
    assert all(5.0 < w < 400.0 for w in waits[10:])  # then p95 + 5 ms: a local drafter answers in ms


def test_chains_drafted_without_the_model_do_not_shrink_the_deadline():
    """Suffix and empty chains (what a drafter sends when it sheds MTP drafts) come back at
    once: once MTP chains have set the p95 their waits stay out of it, so they cannot shrink
    the deadline the next MTP chain gets (the loop that made shedding shed more); a drafter
    that never drafts with the model still gets a deadline from its chains' waits."""
    settings = VerifierSettings(drafter_deadline_margin_ms=5.0, drafter_deadline_max_ms=400.0)
    tracker = DeadlineTracker(settings)
    for _ in range(10):
        tracker.record(40.0)  # MTP chains
    for _ in range(64):
        tracker.record(1.0, model_drafted=False)  # shed: empty chains at once
    assert tracker.deadline_s() == pytest.approx(0.045)
    suffix_only = DeadlineTracker(settings)
    for _ in range(10):
        suffix_only.record(1.0, model_drafted=False)
    assert suffix_only.deadline_s() == pytest.approx(0.006)
