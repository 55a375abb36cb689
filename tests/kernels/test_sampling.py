"""DESIGN §2: the processed distribution (temperature → top_k → top_p → min_p → cap) and draws."""

import math

import pytest
import torch

from kernels.rng import uniform, uniform_at
import kernels.sampling as sampling_module
from kernels.sampling import (
    PAD_ID, DrawWindow, SamplingParams, SparseRows, draw, draw_windows, lookup, process_logits, sample, sample_gumbel,
)


def processed(logits, **params):
    return process_logits(torch.tensor([logits], dtype=torch.float32), SamplingParams(**params)).row(0)


def softmax(values):
    exps = [math.exp(v) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


LOGITS = [2.0, 1.0, 0.0, 3.0, -1.0]  # by prob: 3 > 0 > 1 > 2 > 4


def test_plain_softmax_sorted_by_token_id():
    row = processed(LOGITS)
    assert list(row) == [0, 1, 2, 3, 4]
    for token, expected in enumerate(softmax(LOGITS)):
        assert row[token] == pytest.approx(expected, abs=1e-12)


def test_temperature_scales_logits():
    row = processed(LOGITS, temperature=0.5)
    for token, expected in enumerate(softmax([v / 0.5 for v in LOGITS])):
        assert row[token] == pytest.approx(expected, abs=1e-12)


def test_greedy_is_a_point_mass_on_the_argmax():
    assert processed(LOGITS, temperature=0.0) == {3: 1.0}


def test_greedy_ties_go_to_the_lowest_id():
    assert processed([1.0, 5.0, 2.0, 5.0], temperature=0.0) == {1: 1.0}


def test_top_k():
    row = processed(LOGITS, top_k=2)
    e3, e0 = math.exp(3.0), math.exp(2.0)
    assert row == pytest.approx({0: e0 / (e0 + e3), 3: e3 / (e0 + e3)}, abs=1e-12)


def test_top_k_ties_keep_the_lower_id():
    assert set(processed([1.0, 2.0, 2.0, 2.0], top_k=2)) == {1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = softmax(LOGITS)  # [0.2341, 0.0861, 0.0317, 0.6364, 0.0117]
    # 0.6364 < 0.8, 0.6364 + 0.2341 >= 0.8: keep {3, 0}
    row = processed(LOGITS, top_p=0.8)
    assert row == pytest.approx({0: probs[0] / (probs[0] + probs[3]), 3: probs[3] / (probs[0] + probs[3])}, abs=1e-12)
    assert processed(LOGITS, top_p=0.6) == {3: 1.0}


def test_top_p_applies_to_the_renormalised_top_k_distribution():
    # After top_k=3 the kept probs are {3: .6653, 0: .2447, 1: .0900}; top_p=0.9 needs
    # only {3, 0} (0.910). On the unfiltered softmax {3, 0} reach 0.8705 < 0.9, so applying
    # top_p before top_k would keep three tokens: the order of filters matters.
    assert set(processed(LOGITS, top_k=3, top_p=0.9)) == {0, 3}
    assert set(processed(LOGITS, top_p=0.9)) == {0, 1, 3}


def test_min_p_is_relative_to_the_most_likely_token():
    probs = softmax(LOGITS)
    threshold = 0.3 * probs[3]
    expected = {t for t, p in enumerate(probs) if p >= threshold}
    assert set(processed(LOGITS, min_p=0.3)) == expected == {0, 3}


def test_min_p_after_top_p_and_renormalised():
    probs = softmax(LOGITS)
    # top_p 0.97: {3, 0, 1} reach 0.9566 < 0.97, so token 2 is kept too (0.9883); then
    # min_p 0.1 drops token 2 (0.0317 < 0.1 * 0.6364) and the rest is renormalised.
    assert probs[3] + probs[0] + probs[1] < 0.97 <= probs[3] + probs[0] + probs[1] + probs[2]
    assert set(processed(LOGITS, top_p=0.97)) == {0, 1, 2, 3}
    row = processed(LOGITS, top_p=0.97, min_p=0.1)
    kept = probs[0] + probs[1] + probs[3]
    assert row == pytest.approx({0: probs[0] / kept, 1: probs[1] / kept, 3: probs[3] / kept}, abs=1e-12)


def test_cap_keeps_the_max_support_most_likely_tokens():
    row = processed(LOGITS, max_support=2)
    assert set(row) == {0, 3}
    row = processed([0.0] * 10, max_support=3)  # all tied: the three lowest ids
    assert row == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3}, abs=1e-12)


def test_cap_is_applied_last_after_the_other_filters():
    # top_k=3 keeps {3,0,1}; the cap of 2 then keeps {3,0}; renormalised over the two.
    row = processed(LOGITS, top_k=3, max_support=2)
    e3, e0 = math.exp(3.0), math.exp(2.0)
    assert row == pytest.approx({0: e0 / (e0 + e3), 3: e3 / (e0 + e3)}, abs=1e-12)


def test_rows_are_padded_and_fixed_width():
    rows = process_logits(torch.tensor([LOGITS, LOGITS]), SamplingParams(top_k=2, max_support=4))
    assert rows.token_ids.shape == (2, 4)
    assert rows.token_ids[0].tolist() == [0, 3, PAD_ID, PAD_ID]
    assert rows.probs[0, 2:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs,name",
    [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"min_p": -0.01}, "min_p"), ({"min_p": 1.01}, "min_p"), ({"max_support": 0}, "max_support")],
)
def test_params_validate(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_inverse_cdf_walks_token_id_order():
    rows = SparseRows.from_dicts([{7: 0.25, 2: 0.5, 9: 0.25}] * 5)
    u = torch.tensor([0.0001, 0.4999, 0.5001, 0.7499, 0.9999], dtype=torch.float64)
    assert sample(rows, u).tolist() == [2, 2, 7, 7, 9]


def test_inverse_cdf_never_returns_zero_probability_entries():
    rows = SparseRows.from_dicts([{1: 0.5, 2: 0.0, 3: 0.5, 4: 0.0}] * 3)
    assert sample(rows, torch.tensor([0.5, 0.9999999999, 1.0 - 1e-17], dtype=torch.float64)).tolist() == [3, 3, 3]


def test_draw_uses_the_pick_stream_by_default():
    rows = process_logits(torch.randn(16, 50, generator=torch.Generator().manual_seed(0)), SamplingParams())
    positions = torch.arange(100, 116, dtype=torch.int64)
    assert torch.equal(draw(rows, 5, positions), sample(rows, uniform(5, positions, "pick")))
    assert torch.equal(draw(rows, 5, positions, stream="draft"), sample(rows, uniform(5, positions, "draft")))


def test_draw_frequencies_match_the_distribution():
    rows = SparseRows.from_dicts([{0: 0.1, 3: 0.6, 5: 0.3}])
    n = 60_000
    batch = SparseRows(rows.token_ids.expand(n, -1), rows.probs.expand(n, -1))
    for sampler in ("inverse_cdf", "gumbel"):
        tokens = draw(batch, 11, torch.arange(n, dtype=torch.int64), sampler=sampler)
        for token, p in ((0, 0.1), (3, 0.6), (5, 0.3)):
            freq = float((tokens == token).double().mean())
            assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / n), (sampler, token, freq)


def test_gumbel_noise_is_keyed_by_token_so_close_rows_agree():
    n = 20_000
    p = SparseRows.from_dicts([{0: 0.3, 1: 0.4, 2: 0.3}])
    q = SparseRows.from_dicts([{0: 0.25, 1: 0.45, 2: 0.3}])
    positions = torch.arange(n, dtype=torch.int64)
    expand = lambda r: SparseRows(r.token_ids.expand(n, -1), r.probs.expand(n, -1))  # noqa: E731
    agree = float((sample_gumbel(expand(p), 3, positions) == sample_gumbel(expand(q), 3, positions)).double().mean())
    assert agree > 0.9  # coupling: identical noise on identical tokens


def test_draw_rejects_unknown_sampler():
    with pytest.raises(ValueError, match="sampler"):
        draw(SparseRows.from_dicts([{0: 1.0}]), 1, torch.tensor([0]), sampler="bogus")


def test_lookup():
    rows = SparseRows.from_dicts([{1: 0.25, 4: 0.75}, {2: 1.0}])
    assert lookup(rows, torch.tensor([4, 3])).tolist() == [0.75, 0.0]
    assert lookup(rows, torch.tensor([[1, 4, PAD_ID], [2, 2, 0]])).tolist() == [[0.25, 0.75, 0.0], [1.0, 1.0, 0.0]]


def sorted_definition(logits: torch.Tensor, params: SamplingParams) -> SparseRows:
    """DESIGN §2 written out on whole sorted rows (how process_logits computed every row before
    it selected candidates): the oracle the candidate route must agree with."""
    scaled = logits.to(torch.float64) / params.temperature
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    num_rows, vocab_size = scaled.shape
    rank = torch.arange(vocab_size).expand(num_rows, vocab_size)
    keep = torch.ones_like(probs, dtype=torch.bool)

    def renormalise(p):
        kept = torch.where(keep, p, torch.zeros_like(p))
        return kept / kept.sum(dim=-1, keepdim=True)

    if params.top_k:
        keep &= rank < params.top_k
        probs = renormalise(probs)
    if params.top_p < 1:
        keep &= torch.cumsum(probs, dim=-1) - probs < params.top_p
        probs = renormalise(probs)
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs[:, :1]
        probs = renormalise(probs)
    keep &= rank < min(params.max_support, vocab_size)
    probs = renormalise(probs)
    return SparseRows.from_dicts([{int(order[r, i]): float(probs[r, i]) for i in range(vocab_size) if keep[r, i]}
                                  for r in range(num_rows)], width=min(params.max_support, vocab_size))


candidates = sampling_module._candidates
CANDIDATE_PARAMS = [
    dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=40),
    dict(temperature=0.8, top_k=300, top_p=0.95), dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.6, top_k=100, top_p=0.5, min_p=0.01), dict(temperature=1.0, max_support=8, top_p=0.99),
    dict(temperature=2.0, top_k=1), dict(temperature=1.0, top_k=1500),  # most of the vocabulary: sorted whole
    dict(temperature=1.0, top_k=5000, top_p=0.9),  # top_k beyond the vocabulary keeps every token
]


def test_the_native_rows_are_built_and_taken_on_the_cpu(monkeypatch):
    assert sampling_module._native() is not None, "kernels._sampling_rows is not built (pip install -e .)"
    monkeypatch.setattr(sampling_module, "_filter", lambda *a: pytest.fail("the torch path ran"))
    process_logits(torch.randn(3, 500), SamplingParams(temperature=0.7, top_p=0.9))


@pytest.mark.parametrize("way", ["native", "torch"])
@pytest.mark.parametrize("params", CANDIDATE_PARAMS)
@pytest.mark.parametrize("logit_kind", ["normal", "bf16 ties", "integer ties", "masked", "bf16 input", "float64 input"])
def test_selected_candidates_give_the_rows_of_the_sorted_definition(params, logit_kind, way, monkeypatch):
    # bf16 logits repeat values near the top of a 2,000-token row, and integer logits tie in
    # hundreds: the threshold of the selection falls inside a tie, where only the lower ids
    # may be taken. Masked rows carry -inf logits (a grammar's, a bad-word list's). Both ways of
    # selecting: the native rows (kernels/_sampling_rows.c) and torch's (_candidates).
    generator = torch.Generator().manual_seed(len(str(params)))
    logits = torch.randn(6, 2000, generator=generator) * 3
    if logit_kind == "bf16 ties":
        logits = logits.to(torch.bfloat16).to(torch.float32)
    elif logit_kind == "integer ties":
        logits = logits.round().clamp(-4, 6)
    elif logit_kind == "masked":
        logits[:, ::3] = float("-inf")
    elif logit_kind == "bf16 input":
        logits = logits.to(torch.bfloat16)
    elif logit_kind == "float64 input":
        logits = logits.to(torch.float64)
    sampling = SamplingParams(**params)
    selections = []
    monkeypatch.setattr(sampling_module, "_candidates", lambda *a: selections.append(a) or candidates(*a))
    if way == "torch":
        monkeypatch.setattr(sampling_module, "_native", lambda: None)
    got = process_logits(logits, sampling)
    assert len(selections) == (way == "torch" and sampling.top_k != 1500)
    expected = sorted_definition(logits, sampling)
    assert torch.equal(got.token_ids, expected.token_ids)
    assert torch.allclose(got.probs, expected.probs, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", range(20))
def test_a_host_u_draws_what_the_pick_stream_tensor_draws(seed):
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(seed))
    rows = process_logits(logits, SamplingParams(temperature=0.9, top_p=0.9))
    position = 17 + seed
    host = sample(rows, uniform_at(seed, position))
    assert torch.equal(host, draw(rows, seed, torch.tensor([position])))


@pytest.mark.parametrize("params", CANDIDATE_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_window_draws_are_the_draws_of_the_processed_rows(params, dtype):
    # draw_windows (one native call on the step's threads) against its definition: row j of a
    # window gets sample(process_logits(row), uniform_at(seed, position + j)) — seeds and
    # positions past 2**32 (Philox's high words) — drawn in order up to the first draft it
    # rejects; the rows after it, and rows in no window, keep out's values. The same tokens on
    # 1, 2 and 4 threads.
    generator = torch.Generator().manual_seed(len(str(params)) + len(str(dtype)))
    logits = (torch.randn(12, 2000, generator=generator) * 3).to(dtype)
    logits[3, ::4] = float("-inf")  # (a masked row)
    sampling = SamplingParams(**params)
    rows = process_logits(logits, sampling)
    seeds = [0, 7, 2**40 + 3, 2**64 - 1]
    positions = [0, 5, 2**33 + 11, 2**61 - 9]

    def expected(row: int, seed: int, position: int) -> int:
        return int(sample(SparseRows(rows.token_ids[row : row + 1], rows.probs[row : row + 1]), uniform_at(seed, position))[0])

    # windows: rows 0-4 (4 drafts, the first two right, then a wrong one), 5 (a plain row), 7-9
    # (2 drafts, both right: the bonus row is drawn too), 10-11 (drafts not given: every row
    # drawn); row 6 in none
    shapes = [(0, 5, 2), (5, 1, 0), (7, 3, 2), (10, 2, None)]  # (first row, rows, drafts it accepts)
    windows = []
    for w, (first, num_rows, num_right) in enumerate(shapes):
        if num_right is None:
            windows.append(DrawWindow(first, num_rows, sampling, seeds[w], positions[w]))
            continue
        drafts = [expected(first + j, seeds[w], positions[w] + j) for j in range(num_right)]
        if num_right < num_rows - 1:  # then a draft the row's token rejects, and filler after it
            wrong = (expected(first + num_right, seeds[w], positions[w] + num_right) + 1) % 2000
            drafts += [wrong] * (num_rows - 1 - num_right)
        windows.append(DrawWindow(first, num_rows, sampling, seeds[w], positions[w], tuple(drafts)))
    drawn_rows = {0: (0, 0), 1: (0, 1), 2: (0, 2), 5: (1, 0), 7: (2, 0), 8: (2, 1), 9: (2, 2), 10: (3, 0), 11: (3, 1)}
    for threads in (1, 2, 4):
        out = torch.full((13,), -7, dtype=torch.int64)
        assert draw_windows(logits, windows, out, threads)
        for row in range(13):
            if row in drawn_rows:
                w, j = drawn_rows[row]
                assert int(out[row]) == expected(row, seeds[w], positions[w] + j), (threads, row)
            else:  # after a window's first rejection (rows 3, 4), in no window (6), past the logits (12)
                assert int(out[row]) == -7, (threads, row)


def test_window_draws_refuse_what_they_do_not_take():
    logits = torch.randn(3, 50)
    out = torch.zeros(3, dtype=torch.int64)
    greedy = DrawWindow(0, 1, SamplingParams(temperature=0.0), 0, 0)
    sampled = DrawWindow(0, 1, SamplingParams(), 0, 0)
    assert not draw_windows(logits, [sampled, greedy], out)  # a greedy window: nothing drawn here
    assert not draw_windows(logits.to(torch.float16), [sampled], out)
    assert (out == 0).all()
    with pytest.raises(IndexError, match="outside"):
        draw_windows(logits, [DrawWindow(2, 2, SamplingParams(), 0, 0, (1,))], out)
    with pytest.raises(ValueError, match="drafts for a window of 2 rows"):
        draw_windows(logits, [DrawWindow(0, 2, SamplingParams(), 0, 0, (1, 2))], out)
    with pytest.raises(ValueError, match="position"):
        draw_windows(logits, [DrawWindow(0, 1, SamplingParams(), 0, 2**61)], out)
