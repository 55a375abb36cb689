"""The governor through the service (DESIGN §9): a drafter that does not pay is detached and
probed again, the rounds it missed reach it as one commit, and the tokens never change."""

from __future__ import annotations

from verifier_service.governor import Load

from .conftest import ScriptedDrafter, chain, generate, request

PROMPT = [3, 14, 15, 92, 65]


async def test_a_slow_drafter_is_detached_then_resumed_and_tokens_stay_the_same(servers, tiny_model,
                                                                                greedy_continuation):
    # Every chain is right (2 greedy drafts) but comes 150 ms late: a plain round here takes a
    # few ms, so speculation cannot pay. Hold 4 rounds after a detach.
    drafter = ScriptedDrafter(lambda s: chain(s, greedy_continuation(tiny_model, s.tokens, 2)), delay_s=0.15)
    stub = await servers.start(tiny_model, drafter=drafter, governor=True, governor_hold=4, max_draft_tokens=2)
    req = request(PROMPT, 60, temperature=0.0, seed=0)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)  # also teaches the server the plain cost
    servers.verifier.service.ledgers[Load.ALONE, False].credit_s = 100.0  # a probe budget for many probes (it is earned slowly)
    req.speculation.disable = False
    tokens, final, rounds = await generate(stub, req)
    assert tokens == plain
    stats = final.stats
    assert stats.drafter_detaches >= 1
    assert 0 < stats.speculative_rounds < stats.rounds
    phases = servers.verifier.service.metrics.registry.get_sample_value  # (counted as the request ended)
    assert phases("tandem_verifier_governor_phases_total", {"why": "detach"}) == stats.drafter_detaches
    assert phases("tandem_verifier_governor_phases_total", {"why": "probe"}) >= 1
    assert stats.speculative_rounds == sum(r.speculative for r in rounds)
    assert all(r.retained == 0 for r in rounds if not r.speculative)  # a plain round asks for nothing
    (session,) = drafter.sessions
    # The drafter heard of every committed token once, in order: the rounds it missed arrived
    # as one commit (num_rounds > 1) just before it was asked again. Rounds after the last
    # commit it got: held for a probe that never came (all plain), or the request's last.
    assert session.tokens == (PROMPT + tokens)[: len(session.tokens)]
    resumes = [c for c in session.commits if c.num_rounds > 1]
    assert resumes and all(c.num_verified == 0 for c in resumes)
    told = sum(max(c.num_rounds, 1) for c in session.commits)
    assert len(session.tokens) == len(PROMPT) + sum(len(c.emitted_token_ids) for c in session.commits)
    assert told < stats.rounds and not any(r.speculative for r in rounds[told + 1:])
    assert all(c.hidden.num_rows == len(c.emitted_token_ids) for c in session.commits)


async def test_with_the_governor_off_every_round_asks_the_drafter(servers, tiny_model, greedy_continuation):
    drafter = ScriptedDrafter(lambda s: chain(s, greedy_continuation(tiny_model, s.tokens, 2)), delay_s=0.03)
    stub = await servers.start(tiny_model, drafter=drafter, governor=False, max_draft_tokens=2)
    _, final, rounds = await generate(stub, request(PROMPT, 24, temperature=0.0, seed=0))
    assert final.stats.speculative_rounds == final.stats.rounds == len(rounds)
    assert final.stats.drafter_detaches == 0


async def test_a_server_that_learnt_speculation_does_not_pay_opens_the_drafter_at_the_first_probe(
        servers, tiny_model, greedy_continuation):
    drafter = ScriptedDrafter(lambda s: chain(s, greedy_continuation(tiny_model, s.tokens, 2)), delay_s=0.15)
    stub = await servers.start(tiny_model, drafter=drafter, governor=True, governor_hold=4, max_draft_tokens=2)
    for _ in range(6):  # 3 measured speculative rounds each: the server's verdict needs 16
        await generate(stub, request(PROMPT, 60, temperature=0.0, seed=0))
    ledger = servers.verifier.service.ledgers[Load.ALONE, False]  # (each request runs alone)
    assert ledger.pays() is False
    ledger.credit_s = 100.0
    opened_before = len(drafter.sessions)
    tokens, final, rounds = await generate(stub, request(PROMPT, 12, temperature=0.0, seed=0))
    assert not rounds[0].speculative and rounds[4].speculative  # plain for the hold, then a probe
    assert len(drafter.sessions) == opened_before + 1
    # opened at the probe with the whole context so far
    assert len(drafter.sessions[-1].tokens) >= len(PROMPT) + 4


async def test_a_request_alone_is_judged_by_what_requests_alone_measured(servers, tiny_model, greedy_continuation):
    """The server's verdict is kept per load (DESIGN §9): what requests together learnt (their
    drafts cost the batch more than they saved) does not keep a request alone from speculating;
    what requests alone learnt does."""
    drafter = ScriptedDrafter(lambda s: chain(s, greedy_continuation(tiny_model, s.tokens, 2)))
    stub = await servers.start(tiny_model, drafter=drafter, governor=True, max_draft_tokens=2)
    ledgers = servers.verifier.service.ledgers

    def learnt_it_does_not_pay(load: Load) -> None:
        ledger = ledgers[load, False]
        ledger.speculative.clear()
        ledger.plain.clear()
        for _ in range(64):  # (a full window: 30 ms a token speculating against 3 ms plain)
            ledger.speculative.add(0.030, 1)
            ledger.plain.add(0.003, 1)
        assert ledger.pays() is False

    learnt_it_does_not_pay(Load.SHARED)
    _, _, rounds = await generate(stub, request(PROMPT, 24, temperature=0.0, seed=0))
    assert all(r.speculative for r in rounds[:4])  # no verdict alone yet: it explores
    learnt_it_does_not_pay(Load.ALONE)
    _, final, rounds = await generate(stub, request(PROMPT, 24, temperature=0.0, seed=1))
    assert final.stats.speculative_rounds == 0 and not any(r.speculative for r in rounds)
