"""kernels.routing against an independent slow reference written straight from the rule.

The reference shares only the softmax primitive with the kernel (torch.softmax in float32);
selection and weights are re-derived here with Python loops over rows and ranks and float32
numpy arithmetic, so scores are the same float32 products and argmax ties (lowest id) agree.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from kernels.routing import PromptRouting, route_prompt_topk, route_topk, unpack_prompt_value

F32 = np.float32
FLOOR = F32(2.0**-14)
BASE_SCALES = (0.5, 1.0, 2.0, 4.0, math.exp(0.85))
R1_SCALES = (0.5, 1.0, 2.0, 4.0, math.exp(0.4))
PROTECTS = tuple(range(11))
TIE_VALUES = (-1.0, 0.0, 0.5, 2.0)  # log-ratios 0.5..3 stay far from every log-multiplier
NUM_ROWS = 5
DRAFT_PATTERN = (False, True, False, True, True)


# --- reference -----------------------------------------------------------------------------


def ref_probs(logits: np.ndarray) -> np.ndarray:
    return torch.softmax(torch.as_tensor(logits, dtype=torch.float32), dim=-1).numpy()


def ref_mult(rank: int, *, draft: bool, b: float, r: float, protect: int) -> np.float32:
    b32, r32 = F32(b), F32(r)
    if draft:
        m, p, r1_active = F32(b32 * b32), 1, False
    else:
        m, p, r1_active = b32, protect, bool(r32 > 1) and protect > 1
    if rank >= p and m > 1:
        return m
    if rank >= 1 and r1_active:
        return r32
    return F32(1.0)


def ref_renorm(chosen: np.ndarray, normalize: bool = True) -> np.ndarray:
    if not normalize:
        return chosen.astype(F32)
    total = F32(0.0)
    for p in chosen:
        total = F32(total + p)
    return (chosen / max(total, FLOOR)).astype(F32)


def ref_route(logits, k, *, resident=None, b=1.0, r=1.0, protect=0, draft=None, normalize=True):
    probs = ref_probs(logits)
    num_rows, num_experts = probs.shape
    ids = np.zeros((num_rows, k), dtype=np.int64)
    weights = np.zeros((num_rows, k), dtype=F32)
    for t in range(num_rows):
        taken = np.zeros(num_experts, dtype=bool)
        for rank in range(k):
            if resident is None:
                scores = probs[t].copy()
            else:
                mult = ref_mult(rank, draft=bool(draft is not None and draft[t]), b=b, r=r, protect=protect)
                scores = (probs[t] * np.where(resident, mult, F32(1.0))).astype(F32)
            scores[taken] = -np.inf
            ids[t, rank] = int(np.argmax(scores))  # first maximum = lowest id
            taken[ids[t, rank]] = True
        weights[t] = ref_renorm(probs[t, ids[t]], normalize)
    return ids, weights


def ref_prompt(logits, k, *, resident, packed, normalize=True):
    probs = ref_probs(logits)
    logits32 = np.asarray(logits, dtype=F32)
    n, num_experts = probs.shape
    ids = np.zeros((n, k), dtype=np.int64)
    weights = np.zeros((n, k), dtype=F32)
    tail = protect = skip = 0
    bonus = tau = 0.0
    if packed >= 0:
        tail = int(packed) // 10000
        rem = packed - 10000 * tail
        protect = int(rem) // 100
        bonus = min(rem - 100 * protect, 40.0)
    else:
        skip = int(-packed)
        tau = -packed - skip
    for t in range(n):
        exact = resident is None or (tail > 0 and t + tail >= n)
        taken = np.zeros(num_experts, dtype=bool)
        for rank in range(k):
            if exact or rank < protect:
                scores = probs[t].copy()
            else:
                scores = np.where(resident, logits32[t] + F32(bonus), logits32[t]).astype(F32)
            scores[taken] = -np.inf
            ids[t, rank] = int(np.argmax(scores))
            taken[ids[t, rank]] = True
        chosen = probs[t, ids[t]].copy()
        if resident is not None and tau > 0 and t < n - skip:
            renormed = ref_renorm(chosen)
            for rank in range(3, k):
                if not resident[ids[t, rank]] and renormed[rank] < F32(tau):
                    ids[t, rank] = -1
                    chosen[rank] = F32(0.0)
        weights[t] = ref_renorm(chosen, normalize)
    return ids, weights


# --- inputs --------------------------------------------------------------------------------


def make_logits(rng: np.random.Generator, num_rows: int, num_experts: int, tied: bool) -> np.ndarray:
    if tied:
        return rng.choice(np.array(TIE_VALUES, dtype=F32), size=(num_rows, num_experts))
    return rng.standard_normal((num_rows, num_experts)).astype(F32)


def make_resident(rng: np.random.Generator, num_experts: int, kind: str) -> np.ndarray | None:
    if kind == "none":
        return None
    if kind == "all_miss":
        return np.zeros(num_experts, dtype=bool)
    if kind == "all_hit":
        return np.ones(num_experts, dtype=bool)
    return rng.random(num_experts) < 0.4


def run_kernel(logits, k, *, resident=None, b=1.0, r=1.0, protect=0, draft=None, normalize=True, device="cpu"):
    ids, weights = route_topk(
        torch.as_tensor(logits, device=device),
        k,
        resident=None if resident is None else torch.as_tensor(resident, device=device),
        scale=b,
        r1_scale=r,
        protect=protect,
        draft_rows=None if draft is None else torch.as_tensor(np.array(draft, dtype=bool), device=device),
        normalize=normalize,
    )
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    return ids.cpu().numpy(), weights.cpu().numpy()


def assert_same(got, want, context=""):
    np.testing.assert_array_equal(got[0], want[0], err_msg=context)
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=2e-7, err_msg=context)


# --- route_topk vs reference ---------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("residency", ["none", "all_miss", "all_hit", "mixed"])
@pytest.mark.parametrize("num_experts", [32, 256, 512])
def test_route_topk_matches_reference_full_grid(num_experts, residency, tied):
    """Every base scale × rank-1 scale × protection at k = 10, draft flags mixed within a call."""
    rng = np.random.default_rng([num_experts, len(residency), tied])
    for i, (b, r, protect) in enumerate(itertools.product(BASE_SCALES, R1_SCALES, PROTECTS)):
        logits = make_logits(rng, NUM_ROWS, num_experts, tied)
        resident = make_resident(rng, num_experts, residency)
        draft = None if i % 4 == 3 else DRAFT_PATTERN
        kwargs = dict(resident=resident, b=b, r=r, protect=protect, draft=draft)
        assert_same(run_kernel(logits, 10, **kwargs), ref_route(logits, 10, **kwargs), f"b={b} r={r} P={protect}")


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_experts", [32, 256, 512])
def test_route_topk_matches_reference_small_k(num_experts, top_k):
    """A seeded sample of the grid at smaller k, incl. normalize=False."""
    rng = np.random.default_rng([num_experts, top_k])
    grid = list(itertools.product(BASE_SCALES, R1_SCALES, PROTECTS, ["none", "all_miss", "all_hit", "mixed"]))
    for index in rng.choice(len(grid), size=60, replace=False):
        b, r, protect, residency = grid[index]
        tied = bool(rng.random() < 0.5)
        normalize = bool(rng.random() < 0.8)
        logits = make_logits(rng, NUM_ROWS, num_experts, tied)
        kwargs = dict(resident=make_resident(rng, num_experts, residency), b=b, r=r, protect=protect,
                      draft=DRAFT_PATTERN, normalize=normalize)
        assert_same(run_kernel(logits, top_k, **kwargs), ref_route(logits, top_k, **kwargs), str(grid[index]))


@pytest.mark.parametrize("b", [0.5, 1.0])
@pytest.mark.parametrize("r", [2.0, 4.0, math.exp(0.4)])
@pytest.mark.parametrize("protect", [2, 3, 6])
def test_m_at_most_one_ranks_past_protect_keep_r1_multiplier(b, r, protect):
    """m <= 1, r > 1, P > 1: ranks >= P still select with multiplier r; weights stay unboosted."""
    num_experts, k = 16, 8
    # Non-resident experts 0..7 (logit 3) are each slightly more likely than every resident
    # expert 8..15 (logits 2.9 down to 2.83), so a resident expert can win a rank only through r.
    logits = np.zeros((1, num_experts), dtype=F32)
    logits[0, :8] = 3.0
    logits[0, 8:] = F32(2.9) - F32(0.01) * np.arange(8, dtype=F32)
    resident = np.arange(num_experts) >= 8
    ids, weights = run_kernel(logits, k, resident=resident, b=b, r=r, protect=protect)
    assert_same((ids, weights), ref_route(logits, k, resident=resident, b=b, r=r, protect=protect))
    # Rank 0 is unboosted; every later rank, those >= P included, picks a resident through r.
    assert ids[0].tolist() == [0, 8, 9, 10, 11, 12, 13, 14]
    plain_ids, _ = run_kernel(logits, k, resident=resident, b=b, r=1.0, protect=protect)
    assert plain_ids[0].tolist() == list(range(8))
    probs = ref_probs(logits)[0]
    np.testing.assert_allclose(weights[0], probs[ids[0]] / probs[ids[0]].sum(), rtol=0, atol=2e-7)


@pytest.mark.parametrize("b", BASE_SCALES)
@pytest.mark.parametrize("protect", [0, 1, 3, 10])
def test_draft_rows_never_affected_by_r1_scale(b, protect):
    rng = np.random.default_rng([int(b * 100), protect])
    for tied in (False, True):
        logits = make_logits(rng, 6, 64, tied)
        resident = make_resident(rng, 64, "mixed")
        draft = (True, True, False, True, False, True)
        results = [run_kernel(logits, 10, resident=resident, b=b, r=r, protect=protect, draft=draft) for r in R1_SCALES]
        rows = np.array(draft)
        for ids, weights in results[1:]:
            np.testing.assert_array_equal(ids[rows], results[0][0][rows])
            np.testing.assert_array_equal(weights[rows], results[0][1][rows])
        # A draft row is routed like a non-draft row with m = b·b, P = 1 and r = 1.
        ids, weights = results[-1]
        alone = run_kernel(logits[rows], 10, resident=resident, b=float(F32(b) * F32(b)), r=1.0, protect=1)
        np.testing.assert_array_equal(ids[rows], alone[0])


def test_protect_zero_with_m_above_one_boosts_rank_zero():
    logits = np.array([[2.0, 1.6, 0.0, 0.0]], dtype=F32)  # p0 / p1 = e^0.4 < 2
    resident = np.array([False, True, False, False])
    ids, _ = run_kernel(logits, 2, resident=resident, b=2.0, protect=0)
    assert ids[0].tolist() == [1, 0]
    ids, _ = run_kernel(logits, 2, resident=resident, b=2.0, protect=1)
    assert ids[0].tolist() == [0, 1]


def test_ties_break_to_lowest_id_and_no_residency_is_plain_topk():
    logits = np.array([[1.0, 3.0, 3.0, 1.0, 3.0, 0.0]], dtype=F32)
    ids, _ = run_kernel(logits, 5)
    assert ids[0].tolist() == [1, 2, 4, 0, 3]
    # Boosting an equal-prob expert moves it ahead of its lower-id peers.
    ids, _ = run_kernel(logits, 3, resident=np.array([0, 0, 0, 0, 1, 0], dtype=bool), b=2.0)
    assert ids[0].tolist() == [4, 1, 2]
    rng = np.random.default_rng(7)
    logits = make_logits(rng, 8, 128, tied=False)
    ids, weights = run_kernel(logits, 8, b=4.0, r=4.0, protect=3, draft=(True,) * 8)
    top = torch.topk(torch.softmax(torch.as_tensor(logits), -1), 8)
    np.testing.assert_array_equal(ids, top.indices.numpy())
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)


def test_weights_are_unboosted_and_normalize_false_gives_raw_probs():
    rng = np.random.default_rng(3)
    logits = make_logits(rng, 4, 32, tied=False)
    resident = make_resident(rng, 32, "mixed")
    ids, weights = run_kernel(logits, 6, resident=resident, b=4.0, protect=0)
    ids_raw, raw = run_kernel(logits, 6, resident=resident, b=4.0, protect=0, normalize=False)
    probs = ref_probs(logits)
    np.testing.assert_array_equal(ids, ids_raw)
    np.testing.assert_array_equal(raw, np.take_along_axis(probs, ids, axis=1))
    np.testing.assert_allclose(weights, raw / raw.sum(-1, keepdims=True), rtol=0, atol=2e-7)


def test_low_precision_logits_are_routed_in_float32():
    rng = np.random.default_rng(5)
    logits = torch.as_tensor(make_logits(rng, 4, 64, tied=False)).to(torch.bfloat16)
    ids, weights = route_topk(logits, 4, resident=torch.ones(64, dtype=torch.bool), scale=2.0)
    want = ref_route(logits.float().numpy(), 4, resident=np.ones(64, dtype=bool), b=2.0)
    assert_same((ids.numpy(), weights.numpy()), want)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(router_logits=torch.zeros(4)), "router_logits"),
        (dict(router_logits=torch.zeros(2, 4, dtype=torch.int64)), "router_logits"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=9), "top_k"),
        (dict(resident=torch.ones(7, dtype=torch.bool)), "resident"),
        (dict(resident=torch.ones(8)), "resident"),
        (dict(draft_rows=torch.ones(3, dtype=torch.bool)), "draft_rows"),
        (dict(protect=-1), "protect"),
        (dict(scale=0.0), "scale"),
        (dict(scale=math.inf), "scale"),
        (dict(r1_scale=-1.0), "r1_scale"),
        (dict(r1_scale=math.nan), "r1_scale"),
    ],
)
def test_route_topk_rejects_bad_arguments(kwargs, match):
    args = dict(router_logits=torch.zeros(2, 8), top_k=2) | kwargs
    with pytest.raises(ValueError, match=match):
        route_topk(args.pop("router_logits"), args.pop("top_k"), **args)


# --- packed prompt values ------------------------------------------------------------------


def test_unpack_prompt_value_examples():
    got = unpack_prompt_value(300.85)
    assert (got.tail, got.protect, got.dropout_skip, got.dropout_tau) == (0, 3, 0, 0.0)
    assert got.bonus == pytest.approx(0.85)
    assert unpack_prompt_value(320335) == PromptRouting(tail=32, protect=3, bonus=35.0, dropout_skip=0, dropout_tau=0.0)
    assert unpack_prompt_value(0) == PromptRouting(0, 0, 0.0, 0, 0.0)
    assert unpack_prompt_value(99.5).bonus == 40.0  # capped
    got = unpack_prompt_value(-0.05)
    assert (got.tail, got.protect, got.bonus, got.dropout_skip) == (0, 0, 0.0, 0)
    assert got.dropout_tau == pytest.approx(0.05)
    got = unpack_prompt_value(-32.05)
    assert got.dropout_skip == 32 and got.dropout_tau == pytest.approx(0.05)
    assert unpack_prompt_value(-32) == PromptRouting(0, 0, 0.0, 32, 0.0)


@pytest.mark.parametrize("packed", [math.nan, math.inf, -math.inf, "1", None])
def test_non_finite_packed_value_rejected(packed):
    with pytest.raises(ValueError, match="packed"):
        unpack_prompt_value(packed)
    with pytest.raises(ValueError, match="packed"):
        route_prompt_topk(torch.zeros(2, 8), 2, resident=None, packed=packed)


PACKED_VALUES = (0.0, 300.85, 320335.0, 335.0, 1.5, 0.85, 200.0, 1000.4, 20100.7, 99.5,
                 -0.05, -32.05, -3.2, -32.0, -1.0, -0.2, -0.001)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("residency", ["none", "all_miss", "all_hit", "mixed"])
@pytest.mark.parametrize("num_experts, top_k", [(32, 8), (256, 10), (512, 10)])
def test_route_prompt_topk_matches_reference(num_experts, top_k, residency, normalize):
    rng = np.random.default_rng([num_experts, len(residency), normalize])
    for packed in PACKED_VALUES:
        tied = bool(rng.random() < 0.5)
        logits = make_logits(rng, 40, num_experts, tied)
        resident = make_resident(rng, num_experts, residency)
        ids, weights = route_prompt_topk(
            torch.as_tensor(logits), top_k, resident=None if resident is None else torch.as_tensor(resident),
            packed=packed, normalize=normalize,
        )
        want = ref_prompt(logits, top_k, resident=resident, packed=packed, normalize=normalize)
        assert_same((ids.numpy(), weights.numpy()), want, f"packed={packed} tied={tied}")


def _prompt_case(seed: int, n: int = 40, num_experts: int = 64, k: int = 8):
    rng = np.random.default_rng(seed)
    logits = torch.as_tensor(make_logits(rng, n, num_experts, tied=False))
    resident = torch.as_tensor(rng.random(num_experts) < 0.3)
    plain = route_topk(logits, k)
    return logits, resident, plain


def test_prompt_tail_rows_and_protected_ranks_are_exact():
    logits, resident, (plain_ids, plain_w) = _prompt_case(11)
    ids, weights = route_prompt_topk(logits, 8, resident=resident, packed=320335)  # tail 32, P 3, bonus 35
    assert torch.equal(ids[8:], plain_ids[8:]) and torch.equal(weights[8:], plain_w[8:])
    assert torch.equal(ids[:, :3], plain_ids[:, :3])
    assert not torch.equal(ids[:8], plain_ids[:8])
    ids, _ = route_prompt_topk(logits, 8, resident=resident, packed=300.85)  # no tail
    assert torch.equal(ids[:, :3], plain_ids[:, :3])


def test_prompt_bonus_moves_later_ranks_toward_resident_experts():
    logits, resident, (plain_ids, _) = _prompt_case(12)
    ids, weights = route_prompt_topk(logits, 8, resident=resident, packed=335)  # P 3, bonus 35
    assert bool(resident[ids[:, 3:]].all())  # 35 nats beats any non-resident expert
    for packed in (300.85, 301.5):
        ids_b, _ = route_prompt_topk(logits, 8, resident=resident, packed=packed)
        assert int(resident[ids_b[:, 3:]].sum()) > int(resident[plain_ids[:, 3:]].sum())
    probs = torch.softmax(logits, -1).gather(1, ids)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True), rtol=0, atol=2e-7)


def test_prompt_bonus_never_repeats_an_expert_with_masked_logits():
    logits = torch.full((3, 16), -math.inf)
    logits[:, :4] = torch.tensor([1.0, 0.5, 0.2, 0.1])
    resident = torch.zeros(16, dtype=torch.bool)
    resident[[2, 9]] = True
    ids, weights = route_prompt_topk(logits, 6, resident=resident, packed=105)  # P 1, bonus 5
    # Expert 9 is resident but masked (-inf + 5 stays hopeless); once the finite experts are
    # used up, the masked ones follow by lowest id and never repeat a chosen expert.
    assert ids.tolist() == [[0, 2, 1, 3, 4, 5]] * 3
    assert bool((weights[:, 4:] == 0).all())


def test_prompt_dropout_drops_weak_non_resident_experts_at_ranks_from_three():
    logits, resident, (plain_ids, _) = _prompt_case(13, k=10)
    ids, weights = route_prompt_topk(logits, 10, resident=resident, packed=-0.05)
    dropped = ids == -1
    assert bool(dropped.any())
    assert not bool(dropped[:, :3].any())
    probs = torch.softmax(logits, -1).gather(1, plain_ids)
    renormed = probs / probs.sum(-1, keepdim=True)
    should_drop = (renormed < 0.05) & ~resident[plain_ids]
    should_drop[:, :3] = False
    assert torch.equal(dropped, should_drop)
    assert torch.equal(ids[~dropped], plain_ids[~dropped])
    kept = probs.masked_fill(dropped, 0.0)
    torch.testing.assert_close(weights, kept / kept.sum(-1, keepdim=True), rtol=0, atol=2e-7)
    assert bool((weights[dropped] == 0).all())
    # normalize=False: kept weights stay the raw probabilities.
    _, raw = route_prompt_topk(logits, 10, resident=resident, packed=-0.05, normalize=False)
    assert torch.equal(raw, kept)


def test_prompt_dropout_skips_last_rows_and_integer_negatives_are_inert():
    logits, resident, (plain_ids, plain_w) = _prompt_case(14, k=10)
    ids, weights = route_prompt_topk(logits, 10, resident=resident, packed=-32.05)
    assert torch.equal(ids[8:], plain_ids[8:]) and torch.equal(weights[8:], plain_w[8:])
    assert bool((ids[:8] == -1).any())
    for packed in (-32.0, -1.0, -5.0, -100.0):
        ids, weights = route_prompt_topk(logits, 10, resident=resident, packed=packed)
        assert torch.equal(ids, plain_ids) and torch.equal(weights, plain_w)


@pytest.mark.parametrize("packed", [0.0, 300.85, 320335.0, 335.0, -0.05, -32.05])
def test_prompt_without_residency_is_plain_topk(packed):
    logits, _, (plain_ids, plain_w) = _prompt_case(15, k=10)
    ids, weights = route_prompt_topk(logits, 10, resident=None, packed=packed)
    assert torch.equal(ids, plain_ids) and torch.equal(weights, plain_w)


def test_prompt_zero_value_is_plain_topk():
    logits, resident, (plain_ids, plain_w) = _prompt_case(16)
    for packed in (0.0, 300.0, 320300.0):
        ids, weights = route_prompt_topk(logits, 8, resident=resident, packed=packed)
        assert torch.equal(ids, plain_ids) and torch.equal(weights, plain_w)


# --- devices -------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    rng = np.random.default_rng(99)
    for num_experts, (b, r, protect), tied in itertools.product(
        (32, 512), [(math.exp(0.85), math.exp(0.4), 3), (0.5, 2.0, 4), (2.0, 1.0, 0)], (False, True)
    ):
        # Logits on a 0.25 grid: ties stay exact and distinct probs stay far apart on both devices.
        logits = np.round(make_logits(rng, 16, num_experts, tied) * 4) / 4
        resident = make_resident(rng, num_experts, "mixed")
        draft = tuple(bool(x) for x in rng.random(16) < 0.5)
        kwargs = dict(resident=resident, b=b, r=r, protect=protect, draft=draft)
        assert_same(run_kernel(logits, 10, device="cuda", **kwargs), run_kernel(logits, 10, **kwargs))
        for packed in (320335.0, 300.85, -0.05, -8.05):
            got = route_prompt_topk(torch.as_tensor(logits, device="cuda"), 10,
                                    resident=torch.as_tensor(resident, device="cuda"), packed=packed)
            want = route_prompt_topk(torch.as_tensor(logits), 10, resident=torch.as_tensor(resident), packed=packed)
            assert_same((got[0].cpu().numpy(), got[1].cpu().numpy()), (want[0].numpy(), want[1].numpy()))
