"""Probabilistic mode against a dishonest drafter (issue 12, item 1; DESIGN §10): the accept
draws are keyed by a verifier secret, and the honesty audit stops a drafter whose drafts are
not draws from its q rows — after which outputs equal decoding without drafts."""

import random

import pytest
import torch

from kernels.sampling import SparseRows, draw
from shared.protocol import common_pb2
from verifier_service.audit import FALSE_ALARM, FreshPositions, HonestyAudit, accept_key, ks_distance, pit_values

from .conftest import ScriptedDrafter, chain, generate, q_row, request, sampled_chain

PROMPT = [3, 14, 15, 92, 65]
STEERED = 7  # the token the attacker pushes


def test_accept_key_needs_the_secret():
    assert accept_key(b"a", 5) == accept_key(b"a", 5)
    assert len({accept_key(b"a", 5), accept_key(b"b", 5), accept_key(b"a", 6)}) == 3
    assert 0 <= accept_key(b"a", 2**64 - 1) < 2**64


def test_honest_draws_have_uniform_pit_and_pass_the_audit():
    q = SparseRows.from_dicts([{2: 0.5, 5: 0.3, 9: 0.2}])
    audit = HonestyAudit()
    values = []
    for position in range(4000):  # 4,000 honest draws on the draft stream, PIT keyed by the secret
        token = int(draw(q, 11, torch.tensor([position]), stream="draft")[0])
        values += pit_values([token], q, accept_key(b"secret", 11), position)
    assert ks_distance(values) < 0.05  # DKW: P(D > 0.05) <= 2 exp(-2 * 4000 * 0.0025) = 9e-9
    assert not audit.observe(values) and audit.rejected is None


def test_a_drafter_ignoring_its_q_rows_is_rejected_within_64_draws():
    q = SparseRows.from_dicts([{STEERED: 1e-9, 8: 1.0 - 1e-9}])
    audit = HonestyAudit()
    for position in range(64):
        if audit.observe(pit_values([STEERED], q, accept_key(b"s", 1), position)):
            break
    assert audit.rejected is not None and "not draws from its q rows" in audit.rejected
    assert position + 1 <= 64


def test_the_false_alarm_budget_is_spent_at_most_once_over_a_drafter_life():
    audit = HonestyAudit()
    rng = random.Random(0)
    for _ in range(300):  # 300 x 1000 honest uniforms: well past many checkpoints
        assert not audit.observe([rng.random() for _ in range(1000)])
    assert audit.threshold <= FALSE_ALARM / 2 / 17


def test_fresh_positions_match_a_set_of_seen_pairs():
    fresh, seen = FreshPositions(), set()
    rng = random.Random(1)
    for _ in range(3000):
        seed, start = rng.randrange(3), rng.randrange(200)
        stop = start + rng.randrange(8)
        expected = [p for p in range(start, stop) if (seed, p) not in seen]
        seen.update((seed, p) for p in range(start, stop))
        assert fresh.claim(seed, start, stop) == expected
        ranges = fresh._ranges[seed]
        assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))  # sorted, disjoint, merged


def test_fresh_positions_forget_the_least_recently_used_seed():
    fresh = FreshPositions(max_seeds=2)
    assert fresh.claim(1, 0, 4) == [0, 1, 2, 3]
    fresh.claim(2, 0, 1)
    fresh.claim(1, 9, 9)  # seed 1 used again: seed 2 is now the oldest
    fresh.claim(3, 0, 1)
    assert fresh.claim(1, 0, 4) == [] and fresh.claim(2, 0, 1) == [0]
    with pytest.raises(ValueError, match="max_seeds"):
        FreshPositions(max_seeds=0)


def test_redrafted_positions_and_repeated_seeds_do_not_reject_an_honest_drafter():
    """An honest drafter at low acceptance redrafts each position up to k times, and requests
    without a seed all use seed 0: the same draft-stream uniform and the same v come back.
    Sample: 40 identical requests (seed 0, positions 5..36, k = 3, nothing accepted). Counted
    every time, the repeats reject the drafter (the CI failure of 2026-12-01); counted once per
    (seed, position), the audit sees 32 independent uniforms and keeps it (false alarm <= 1e-6)."""
    q = SparseRows.from_dicts([{1: 0.4, 2: 0.35, 3: 0.25}] * 3)
    key = accept_key(b"secret", 0)
    audit, naive = HonestyAudit(), HonestyAudit()
    for _ in range(40):
        for base in range(5, 35):
            drafts = [int(draw(SparseRows.from_dicts([{1: 0.4, 2: 0.35, 3: 0.25}]), 0, torch.tensor([base + j]),
                               stream="draft")[0]) for j in range(3)]
            audit.observe_drafts(0, key, base, drafts, q)
            naive.observe(pit_values(drafts, q, key, base))
    assert naive.rejected is not None  # so the duplicates matter and this test can fail
    assert audit.rejected is None and len(audit.values) == 32


def steering(state):
    """Always proposes STEERED, declaring q(STEERED) = 1e-9: accepted almost surely if trusted."""
    return chain(state, [STEERED], [q_row({STEERED: 1e-9, 8: 1.0 - 1e-9})])


async def test_the_steering_attack_is_stopped(servers, tiny_model):
    """Sample: 24 requests x 12 tokens at T = 1 (seeds 0..23). Each request runs with the
    attacker and, for comparison, without drafts. Before the audit rejects the drafter the
    steered token is accepted at ~every round; after, outputs equal decoding without drafts
    token for token, so the attack moves the output law only during detection (at most 64
    audited drafts, each able to add one steered token)."""
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(steering), max_draft_tokens=1,
                               probabilistic_drafters="any")  # trusted: the audit is what stops it
    audit = servers.verifier.service.audit
    steered_before = steered_after = plain_count = 0
    rejected_at = None
    for seed in range(24):
        req = request(PROMPT, 12, temperature=1.0, seed=seed, mode=common_pb2.MODE_PROBABILISTIC)
        tokens, final, _ = await generate(stub, req)
        req.speculation.disable = True
        plain, _, _ = await generate(stub, req)
        plain_count += plain.count(STEERED)
        if audit.rejected is None or rejected_at is None:
            steered_before += tokens.count(STEERED)
            if audit.rejected is not None:
                rejected_at = seed
        else:
            steered_after += tokens.count(STEERED)
            assert tokens == plain, f"seed {seed}: a rejected drafter still changed the output"
    assert rejected_at is not None and rejected_at <= 6  # 12 audited drafts per request: <= 64 draws
    assert steered_before >= 10  # the attack did work until detected (so this test can fail)
    assert steered_after <= plain_count


async def test_an_honest_drafter_keeps_drafting_in_probabilistic_mode(servers, tiny_model):
    q = {1: 0.4, 2: 0.35, 3: 0.25}
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(lambda s: sampled_chain(s, q, 3)), max_draft_tokens=3,
                               probabilistic_drafters="any")
    for seed in range(12):  # seeds repeat (0..5 twice): the audit must count a draw once (FreshPositions)
        req = request(PROMPT, 16, temperature=1.0, seed=seed % 6, mode=common_pb2.MODE_PROBABILISTIC)
        _, final, _ = await generate(stub, req)
        assert final.stats.retained > 0
    assert servers.verifier.service.audit.rejected is None
    assert len(servers.verifier.service.audit.values) >= 64  # audited (16 and 32, 64 checks passed)


@pytest.mark.parametrize("configured", [False, True])
async def test_probabilistic_mode_can_trust_authenticated_drafters_only(servers, tiny_model, configured):
    """`authenticated`: with a drafter token the probabilistic rule verifies the drafts (the
    output then differs from decoding without drafts for some seed); without one the same
    drafts are verified by the exact rule: every output equals decoding without drafts."""
    q = {1: 0.5, 2: 0.5}
    extra = {"drafter_token": "t"} if configured else {}
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(lambda s: sampled_chain(s, q, 2)),
                               max_draft_tokens=2, probabilistic_drafters="authenticated", **extra)
    differing = 0
    for seed in range(6):
        req = request(PROMPT, 8, temperature=1.0, seed=seed, mode=common_pb2.MODE_PROBABILISTIC)
        tokens, final, _ = await generate(stub, req)
        assert final.stats.proposed > 0  # drafts verified either way
        req.speculation.disable = True
        plain, _, _ = await generate(stub, req)
        differing += tokens != plain
    assert (differing > 0) == configured


async def test_by_default_no_drafter_moves_a_probabilistic_request(servers, tiny_model):
    """The default trusts no drafter: the steering attacker's chains (drafts it chose, q rows
    that would make the probabilistic rule accept them) are verified by the coupled exact
    rule, so each of 16 probabilistic requests at T = 1 (seeds 0..15) gives exactly the
    tokens of decoding without drafts; and the chains were verified, not dropped. With the
    attacker trusted instead (`any`, before the audit notices) the steered token takes over
    (checked in test_the_steering_attack_is_stopped)."""
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(steering), max_draft_tokens=1)
    proposed = 0
    for seed in range(16):
        req = request(PROMPT, 12, temperature=1.0, seed=seed, mode=common_pb2.MODE_PROBABILISTIC)
        tokens, final, _ = await generate(stub, req)
        proposed += final.stats.proposed
        req.speculation.disable = True
        plain, _, _ = await generate(stub, req)
        assert tokens == plain, f"seed {seed}"
    assert proposed >= 16 * 6
    assert servers.verifier.service.audit.rejected is None  # nothing to audit: no draft was taken at its word


def test_the_trust_setting_is_checked_and_safe_by_default():
    from verifier_service.settings import VerifierSettings

    assert VerifierSettings().probabilistic_drafters == "none"
    for value in ("none", "authenticated", "any"):
        VerifierSettings(probabilistic_drafters=value)
    with pytest.raises(ValueError, match="probabilistic_drafters 'all' must be none, authenticated or any"):
        VerifierSettings(probabilistic_drafters="all")
