"""The load gate's decisions (verifier_service/load_gate.py), on a fake clock."""

from __future__ import annotations

import random

import pytest

from verifier_service.load_gate import LoadGate, LoadGateSettings, bucket

SETTINGS = LoadGateSettings(epoch_s=1.0, settle_s=0.2, min_epochs=3, window=6, probe_every=4, margin=0.05)
TOP = len(SETTINGS.caps)  # the rung without a cap


def peaked(best: int, base: float = 1000.0, step: float = 0.12) -> dict[int | None, float]:
    """Tokens/s by cap: highest at rung `best` (TOP: uncapped), falling by `step` a rung away."""
    caps = list(SETTINGS.caps) + [None]
    return {cap: base * (1.3 - step * abs(rung - best)) for rung, cap in enumerate(caps)}


class Server:
    """Rounds of `sessions` sessions against a gate: each round takes `round_s` and commits
    tokens at a rate that depends on the cap the round ran under."""

    def __init__(self, gate: LoadGate, rates: dict, sessions: int = 8, round_s: float = 0.01,
                 now: float = 0.0) -> None:
        self.gate, self.rates, self.sessions, self.round_s = gate, rates, sessions, round_s
        self.now = now
        self.tokens = 0.0
        self.caps: list[int | None] = []  # the cap of every epoch started

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            epoch = (self.gate.epoch_bucket, self.gate.started)
            cap = self.gate.open(self.now, self.sessions)
            if self.gate.epoch_bucket is not None and (self.gate.epoch_bucket, self.gate.started) != epoch:
                self.caps.append(cap)  # an epoch started
            self.now += self.round_s
            committed = self.rates[cap] * self.round_s
            self.tokens += committed
            self.gate.record(self.now, committed)


def test_buckets_keep_the_usual_concurrencies_off_their_edges():
    assert [bucket(n) for n in (1, 2, 3, 5, 6, 8, 11, 12, 16, 23, 24, 32, 47, 48, 64)] == \
        [0, 1, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6]


def test_one_session_is_never_gated_and_runs_no_epochs():
    gate = LoadGate(SETTINGS)
    server = Server(gate, {None: 100.0, 0: 1000.0}, sessions=1)
    server.run(20.0)
    assert server.caps == [] and not gate.buckets


def test_a_bucket_alternates_with_the_next_shorter_cap_and_climbs_down_while_it_is_no_worse():
    gate = LoadGate(SETTINGS)
    server = Server(gate, peaked(best=2))
    server.run(80.0)
    # uncapped and the next shorter cap in turn: 3 pairs of neighbours, (U, 4), (4, U), (U, 4)
    assert server.caps[:4] == [None, 4, None, 4]
    assert gate.verdict(bucket(8)) == 2
    settled = server.caps[-30:]
    assert settled.count(2) >= len(settled) - len(settled) // SETTINGS.probe_every - 1  # probes only
    assert {1, 3} <= set(server.caps[-60:])  # it probes both neighbours now and then


@pytest.mark.parametrize("best", range(TOP + 1))
def test_every_rung_of_the_ladder_is_found(best):
    gate = LoadGate(SETTINGS)
    Server(gate, peaked(best)).run(120.0)
    assert gate.verdict(bucket(8)) == (SETTINGS.caps + (None,))[best]


def test_a_longer_cap_within_the_margin_is_not_worth_it():
    gate = LoadGate(SETTINGS)
    rates = {cap: 1040.0 for cap in SETTINGS.caps + (None,)} | {0: 1000.0}  # speculation +4%, margin 5%
    Server(gate, rates).run(120.0)
    assert gate.verdict(bucket(8)) == 0


def test_a_bucket_moves_when_a_probe_finds_the_load_changed():
    gate = LoadGate(SETTINGS)
    server = Server(gate, peaked(best=3))
    server.run(80.0)
    assert gate.verdict(bucket(8)) == 3
    server.rates = peaked(best=1)  # e.g. the requests' drafts got worse
    server.run(160.0)
    assert gate.verdict(bucket(8)) == 1


def test_an_epoch_s_rate_leaves_out_its_settling_time():
    gate = LoadGate(SETTINGS)  # settle: 0.2 s and 1 round per session (8)
    assert gate.open(0.0, 8) is None  # a bucket starts uncapped
    for i in range(7):
        gate.record(0.25 + i * 0.01, 50)  # past settle_s, but fewer rounds than sessions: not counted
    gate.record(0.4, 50)  # the 8th round settles the epoch (it ran across the start: not counted)
    for i in range(40):
        gate.record(0.45 + i * 0.01, 2)
    assert gate.open(1.2, 8) == SETTINGS.caps[-1]  # closes it (80 tokens over 0.8 s); the challenger next
    assert gate.buckets[bucket(8)].last == (1, TOP, pytest.approx(100.0))


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
    assert gate.buckets[bucket(4)].last == (1, TOP, pytest.approx(12 / 1.8))


def test_an_epoch_during_which_the_load_changed_bucket_is_dropped():
    gate = LoadGate(SETTINGS)
    gate.open(0.0, 8)
    gate.record(0.5, 100)
    gate.open(0.6, 30)  # the load moved to another bucket
    gate.open(1.0, 8)  # the epoch closes unmeasured; a new one starts
    assert gate.buckets[bucket(8)].last is None
    gate.open(0.7, 1)  # (a lone session also moves it)
    assert gate.moved


def test_an_epoch_without_rounds_of_requests_with_a_drafter_is_dropped():
    gate = LoadGate(SETTINGS)
    gate.open(0.0, 8)
    gate.record(0.5, 100)
    gate.record(5.0, 10_000)  # plain requests decoding while no request with a drafter asked
    gate.open(5.1, 8)  # idle for more than idle_s (2 s)
    assert gate.buckets[bucket(8)].last is None and gate.epoch_number == 2


@pytest.mark.parametrize("best", [0, 3])
def test_pairs_see_through_a_load_that_drifts(best):
    # The load's rate swings 5x over the run (prompts prefilling, requests ending), far more
    # than the caps' effect (20% a rung; it moves an epoch's rate by up to 12% from its
    # neighbour's); neighbouring epochs share the swing, so the climb ends on the best cap.
    import math

    class Drifting(dict):
        def __init__(self, server_clock):
            super().__init__(peaked(best, step=0.2))
            self.clock = server_clock

        def __getitem__(self, cap):
            swing = 1.5 + math.sin(self.clock() / 7.0)  # 0.5 .. 2.5, a period of ~44 s
            return dict.__getitem__(self, cap) * swing

    gate = LoadGate(SETTINGS)
    server = Server(gate, {})
    server.rates = Drifting(lambda: server.now)
    server.run(100.0)
    for _ in range(6):
        assert gate.verdict(bucket(8)) == SETTINGS.caps[best]
        server.run(10.0)


def test_buckets_learn_separately():
    gate = LoadGate(SETTINGS)
    Server(gate, peaked(best=TOP), sessions=4).run(60.0)
    Server(gate, peaked(best=0), sessions=32, now=60.0).run(120.0)
    assert gate.verdict(bucket(4)) is None and gate.verdict(bucket(32)) == 0


@pytest.mark.parametrize("best", [0, 3, TOP])
def test_throughput_stays_near_the_best_cap_with_noisy_rates(best):
    # Rates vary ±10% per round. Once the climb is over (60 s), the server delivers at least
    # the best cap's rate less what the probes cost (one epoch of a neighbour in probe_every + 1,
    # a neighbour 12% worse), with 3% slack for the noise.
    rng = random.Random(0)

    class Noisy(dict):
        def __getitem__(self, cap):
            return dict.__getitem__(self, cap) * rng.uniform(0.9, 1.1)

    gate = LoadGate(SETTINGS)
    rates = peaked(best)
    server = Server(gate, Noisy(rates))
    server.run(60.0)
    tokens, start = server.tokens, server.now
    server.run(200.0)
    best_rate = max(rates.values())
    bound = best_rate - 0.12 * 1000.0 / (SETTINGS.probe_every + 1)
    assert (server.tokens - tokens) / (server.now - start) >= 0.97 * bound


@pytest.mark.parametrize("kwargs", [dict(epoch_s=0), dict(settle_s=1.0, epoch_s=1.0), dict(min_epochs=0),
                                    dict(idle_s=0), dict(epoch_rounds=0), dict(settle_rounds=4, epoch_rounds=4),
                                    dict(window=2, min_epochs=3), dict(margin=1.0), dict(probe_every=0),
                                    dict(epoch_s=float("nan")), dict(caps=()), dict(caps=(1, 2)),
                                    dict(caps=(0, 2, 2))])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        LoadGateSettings(**kwargs)


# Through the service: the gate caps rounds or holds them plain while others speculate, and tokens
# stay the same.


async def test_rounds_the_gate_caps_change_no_token_and_the_drafter_hears_every_commit(servers, tiny_model):
    import asyncio
    import itertools

    from .conftest import ScriptedDrafter, chain, generate, request
    from .test_speculation import greedy_continuation

    drafter = ScriptedDrafter(lambda s: chain(s, greedy_continuation(tiny_model, s.tokens, 2)))
    stub = await servers.start(tiny_model, drafter=drafter, load_gate=True, load_gate_epoch_ms=1.0,
                               max_draft_tokens=2, max_sessions=8)
    service = servers.verifier.service
    rungs = itertools.cycle([3, 0, 1])  # caps (0, 1, 2), then none: uncapped, plain, 1 draft
    service.gate.choose = lambda b: next(rungs)  # a new cap at every epoch (1 ms: about every round)
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
              for regime in ("uncapped", "cap_1", "cap_2", "plain") for outcome in ("measured", "moved", "idle", "short")]
    assert sum(e or 0 for e in epochs) > 0  # the service's gate counts its epochs
    assert len(drafter.sessions) == len(reqs)
    num_capped = 0
    for (tokens, _, rounds), req, state in zip(outs, reqs, sorted(drafter.sessions, key=lambda s: s.tokens[:5][-1])):
        # every committed token reached the drafter once, in order (held rounds as one commit)
        assert state.tokens == (list(req.prompt_ids.ids) + tokens)[: len(state.tokens)]
        # a commit tells the drafter the next round's cap, and that round verifies no more (the
        # scripted drafter ignores it and sends 2)
        retained = {r.round_id: r.retained for r in rounds}
        capped = [c.round_id + 1 for c in state.commits if c.max_draft_tokens == 1]
        assert all(retained.get(r, 0) <= 1 for r in capped)
        num_capped += sum(r in retained for r in capped)
    assert num_capped > 0 and max(r.retained for _, _, rounds in outs for r in rounds) == 2
