"""The load gate's decisions (verifier_service/load_gate.py), on a fake clock."""

from __future__ import annotations

import random

import pytest

from verifier_service.load_gate import LoadGate, LoadGateSettings, bucket

SETTINGS = LoadGateSettings(epoch_s=1.0, settle_s=0.2, min_epochs=3, window=6, probe_every=4, margin=0.05)


class Server:
    """Rounds of `sessions` sessions against a gate: each round takes `round_s` and commits
    tokens at a rate that depends on the regime the round ran under."""

    def __init__(self, gate: LoadGate, rates: dict[bool, float], sessions: int = 8, round_s: float = 0.01,
                 now: float = 0.0) -> None:
        self.gate, self.rates, self.sessions, self.round_s = gate, rates, sessions, round_s
        self.now = now
        self.tokens = 0.0
        self.regimes: list[bool] = []  # the regime of every epoch started

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            epoch = (self.gate.epoch_bucket, self.gate.started)
            regime = self.gate.open(self.now, self.sessions)
            if self.gate.epoch_bucket is not None and (self.gate.epoch_bucket, self.gate.started) != epoch:
                self.regimes.append(regime)  # an epoch started
            self.now += self.round_s
            committed = self.rates[regime] * self.round_s
            self.tokens += committed
            self.gate.record(self.now, committed)


def test_buckets_keep_the_usual_concurrencies_off_their_edges():
    assert [bucket(n) for n in (1, 2, 3, 5, 6, 8, 11, 12, 16, 23, 24, 32, 47, 48, 64)] == \
        [0, 1, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6]


def test_one_session_is_never_gated_and_runs_no_epochs():
    gate = LoadGate(SETTINGS)
    server = Server(gate, {True: 100.0, False: 1000.0}, sessions=1)
    server.run(20.0)
    assert server.regimes == [] and not gate.buckets


def test_a_bucket_alternates_until_it_has_enough_pairs_then_keeps_the_better():
    gate = LoadGate(SETTINGS)
    server = Server(gate, {True: 700.0, False: 1000.0})  # speculation delivers 0.7x: hold rounds plain
    server.run(40.0)
    assert server.regimes[:4] == [True, False, True, False]  # 3 pairs of neighbours: (S, P), (P, S), (S, P)
    after = server.regimes[4:]
    assert after.count(True) <= len(after) // SETTINGS.probe_every + 1  # probes only
    assert gate.better(bucket(8)) is False
    assert False in after and True in after  # it probes speculation now and then


def test_speculation_that_pays_is_kept_and_plain_decoding_probed():
    gate = LoadGate(SETTINGS)
    server = Server(gate, {True: 1200.0, False: 1000.0})
    server.run(40.0)
    after = server.regimes[4:]
    assert gate.better(bucket(8)) is True
    assert 0 < after.count(False) <= len(after) // SETTINGS.probe_every + 1


def test_speculation_within_the_margin_is_not_worth_it():
    gate = LoadGate(SETTINGS)
    server = Server(gate, {True: 1040.0, False: 1000.0})  # +4%, margin 5%
    server.run(20.0)
    assert gate.better(bucket(8)) is False


def test_an_epoch_s_rate_leaves_out_its_settling_time():
    gate = LoadGate(SETTINGS)  # settle: 0.2 s and 1 round per session (8)
    assert gate.open(0.0, 8) is True
    for i in range(7):
        gate.record(0.25 + i * 0.01, 50)  # past settle_s, but fewer rounds than sessions: not counted
    gate.record(0.4, 50)  # the 8th round settles the epoch (it ran across the start: not counted)
    for i in range(40):
        gate.record(0.45 + i * 0.01, 2)
    gate.open(1.2, 8)  # closes it: 80 tokens over 0.8 s
    assert list(gate.buckets[bucket(8)].epochs) == [(1, True, pytest.approx(100.0))]


def test_an_epoch_lasts_enough_rounds_per_session_however_long_a_round_takes():
    gate = LoadGate(SETTINGS)  # epoch_s 1.0, 4 rounds per session
    gate.open(0.0, 4)
    for step in range(1, 4):  # batch steps of 4 sessions, 0.6 s each (a CPU's rounds)
        for _ in range(4):
            gate.record(step * 0.6, 1)
        gate.open(step * 0.6, 4)
        assert gate.epoch_number == 1  # past epoch_s, but fewer than 4 rounds per session
    for _ in range(4):
        gate.record(2.4, 1)
    gate.open(2.4, 4)  # 16 rounds; it settled at the 4th (0.6 s): 12 tokens over 1.8 s
    assert gate.epoch_number == 2
    assert list(gate.buckets[bucket(4)].epochs) == [(1, True, pytest.approx(12 / 1.8))]


def test_an_epoch_during_which_the_load_changed_bucket_is_dropped():
    gate = LoadGate(SETTINGS)
    gate.open(0.0, 8)
    gate.record(0.5, 100)
    gate.open(0.6, 30)  # the load moved to another bucket
    gate.open(1.0, 8)  # the epoch closes unmeasured; a new one starts
    assert not gate.buckets[bucket(8)].epochs
    gate.open(0.7, 1)  # (a lone session also moves it)
    assert gate.moved


def test_an_epoch_without_rounds_of_requests_with_a_drafter_is_dropped():
    gate = LoadGate(SETTINGS)
    gate.open(0.0, 8)
    gate.record(0.5, 100)
    gate.record(5.0, 10_000)  # plain requests decoding while no request with a drafter asked
    gate.open(5.1, 8)  # idle for more than idle_s (2 s)
    assert not gate.buckets[bucket(8)].epochs and gate.epoch_number == 2


@pytest.mark.parametrize("spec_share, verdict", [(0.8, False), (1.25, True)])
def test_pairs_see_through_a_load_that_drifts(spec_share, verdict):
    # The load's rate swings 5x over the run (prompts prefilling, requests ending), far more
    # than speculation's effect; neighbouring epochs share the swing, so the verdict holds.
    import math

    class Drifting(dict):
        def __init__(self, server_clock):
            super().__init__()
            self.clock = server_clock

        def __getitem__(self, regime):
            swing = 1.5 + math.sin(self.clock() / 7.0)  # 0.5 .. 2.5, a period of ~44 s
            return 1000.0 * swing * (spec_share if regime else 1.0)

    gate = LoadGate(SETTINGS)
    server = Server(gate, {})
    server.rates = Drifting(lambda: server.now)
    for _ in range(8):
        server.run(10.0)
        if gate.better(bucket(8)) is not None:
            assert gate.better(bucket(8)) is verdict


def test_buckets_learn_separately():
    gate = LoadGate(SETTINGS)
    Server(gate, {True: 1500.0, False: 1000.0}, sessions=4).run(20.0)
    Server(gate, {True: 600.0, False: 1000.0}, sessions=32, now=20.0).run(20.0)
    assert gate.better(bucket(4)) is True and gate.better(bucket(32)) is False


@pytest.mark.parametrize("spec_rate", [400.0, 900.0, 1100.0, 2000.0])
def test_throughput_stays_near_the_better_regime_with_noisy_rates(spec_rate):
    # Rates vary ±10% per round; over 200 epochs the server delivers at least the better
    # regime's rate less what the measuring epochs and the probes cost (6 epochs of
    # alternation, then one in probe_every + 1), with 3% slack for the noise.
    rng = random.Random(0)

    class Noisy(dict):
        def __getitem__(self, regime):
            return dict.__getitem__(self, regime) * rng.uniform(0.9, 1.1)

    gate = LoadGate(SETTINGS)
    rates = {True: spec_rate, False: 1000.0}
    server = Server(gate, Noisy(rates))
    server.run(200.0)
    best, worst = max(rates.values()), min(rates.values())
    probe_share = 1 / (SETTINGS.probe_every + 1)
    bound = best - (best - worst) * (probe_share + 6 / 200)
    assert server.tokens / server.now >= 0.97 * bound


@pytest.mark.parametrize("kwargs", [dict(epoch_s=0), dict(settle_s=1.0, epoch_s=1.0), dict(min_epochs=0),
                                    dict(idle_s=0), dict(epoch_rounds=0), dict(settle_rounds=4, epoch_rounds=4),
                                    dict(window=2, min_epochs=3), dict(margin=1.0), dict(probe_every=0),
                                    dict(epoch_s=float("nan"))])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        LoadGateSettings(**kwargs)


# Through the service: the gate holds rounds plain while others speculate, and tokens stay the same.


async def test_rounds_the_gate_holds_plain_change_no_token_and_the_drafter_hears_every_commit(servers, tiny_model):
    import asyncio
    import itertools

    from .conftest import ScriptedDrafter, chain, generate, request
    from .test_speculation import greedy_continuation

    drafter = ScriptedDrafter(lambda s: chain(s, greedy_continuation(tiny_model, s.tokens, 2)))
    stub = await servers.start(tiny_model, drafter=drafter, load_gate=True, load_gate_epoch_ms=1.0,
                               max_draft_tokens=2, max_sessions=8)
    service = servers.verifier.service
    regimes = itertools.cycle([True, False])
    service.gate.choose = lambda b: next(regimes)  # flip at every epoch (1 ms: about every round)
    prompts = [[3, 14, 15, 92, 65 + i] for i in range(4)]
    reqs = [request(p, 30, temperature=0.0 if i < 3 else 0.9, seed=i) for i, p in enumerate(prompts)]
    plain = []
    for req in reqs:
        req.speculation.disable = True
        plain.append((await generate(stub, req))[0])  # alone: one session, never gated
        req.speculation.disable = False
    assert service.metrics.registry.get_sample_value("tandem_verifier_gated_rounds_total") == 0
    outs = await asyncio.gather(*(generate(stub, req) for req in reqs))
    for (tokens, final, rounds), expected in zip(outs, plain):
        assert tokens == expected
        assert all(r.retained == 0 for r in rounds if not r.speculative)
    gated = service.metrics.registry.get_sample_value("tandem_verifier_gated_rounds_total")
    speculative = sum(final.stats.speculative_rounds for _, final, _ in outs)
    assert gated > 0 and speculative > 0
    epochs = [service.metrics.registry.get_sample_value("tandem_verifier_load_gate_epochs_total",
                                                        {"regime": regime, "outcome": outcome})
              for regime in ("speculative", "plain") for outcome in ("measured", "moved", "idle", "short")]
    assert sum(e or 0 for e in epochs) > 0  # the service's gate counts its epochs
    assert len(drafter.sessions) == len(reqs)
    for (tokens, _, _), req, state in zip(outs, reqs, sorted(drafter.sessions, key=lambda s: s.tokens[:5][-1])):
        # every committed token reached the drafter once, in order (held rounds as one commit)
        assert state.tokens == (list(req.prompt_ids.ids) + tokens)[: len(state.tokens)]
