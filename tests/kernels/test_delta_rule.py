"""The gated delta rule (kernels.delta_rule): the chunked form equals the recurrent one, both
equal transformers' Qwen3-Next references, a window's per-row states are the states of its
prefixes (speculative rollback), and the causal convolution matches a padded conv1d."""

import pytest
import torch
import torch.nn.functional as F

from kernels.delta_rule import causal_conv, chunked, recurrent


def inputs(rows, num_k_heads=2, num_v_heads=4, dk=16, dv=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, num_k_heads, dk, generator=g, dtype=dtype)
    k = torch.randn(rows, num_k_heads, dk, generator=g, dtype=dtype)
    v = torch.randn(rows, num_v_heads, dv, generator=g, dtype=dtype)
    decay = -torch.rand(rows, num_v_heads, generator=g, dtype=dtype) * 2  # log decay in (-2, 0]
    beta = torch.rand(rows, num_v_heads, generator=g, dtype=dtype)
    state = torch.randn(num_v_heads, dk, dv, generator=g, dtype=dtype) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("rows,chunk", [(1, 64), (37, 8), (64, 64), (100, 64), (20, 1)])
@pytest.mark.parametrize("l2norm", [True, False])
def test_the_chunked_form_computes_the_recurrent_rows(rows, chunk, l2norm):
    q, k, v, g, beta, state = inputs(rows, seed=rows)
    out, final = recurrent(q, k, v, g, beta, state, l2norm=l2norm)
    out_c, final_c = chunked(q, k, v, g, beta, state, l2norm=l2norm, chunk=chunk)
    # (float32 inside: both forms round the same math differently)
    torch.testing.assert_close(out_c, out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final_c, final, rtol=1e-4, atol=1e-5)


def test_both_forms_match_transformers_qwen3_next_references():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, state = inputs(50, seed=3, dtype=torch.float32)
    batch = [x.unsqueeze(0) for x in (q, k, v, g, beta)]
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(*batch, initial_state=state.unsqueeze(0),
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_chunked, _ = hf.torch_chunk_gated_delta_rule(*batch, initial_state=state.unsqueeze(0), output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    out, final = recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_state[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked(q, k, v, g, beta, state, chunk=16)[0], ref_chunked[0], rtol=1e-4, atol=1e-4)


def test_a_windows_row_states_are_its_prefixes_states():
    """Rollback after k of n drafts: the state after row k of the window is the state the
    first k rows alone leave, whether kept from the window or recomputed from the state before."""
    q, k, v, g, beta, state = inputs(24, seed=5)
    _, before = recurrent(q[:19], k[:19], v[:19], g[:19], beta[:19], state)  # the committed rows
    window = slice(19, 24)
    out, states = recurrent(q[window], k[window], v[window], g[window], beta[window], before, keep_states=True)
    for accepted in range(1, 6):
        rows = slice(19, 19 + accepted)
        _, again = recurrent(q[rows], k[rows], v[rows], g[rows], beta[rows], before)
        assert torch.equal(states[accepted - 1], again)  # the same operations in the same order
    full, _ = recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(out, full[window], rtol=1e-6, atol=1e-7)


def test_grouped_values_need_a_whole_number_of_value_heads_per_key_head():
    q, k, v, g, beta, _ = inputs(4, num_k_heads=3, num_v_heads=4)
    with pytest.raises(ValueError, match="not a multiple"):
        recurrent(q, k, v, g, beta)


def test_the_causal_convolution_matches_a_padded_conv1d_and_carries_its_state():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(30, 12, generator=gen, dtype=torch.float64)
    weight = torch.randn(12, 4, generator=gen, dtype=torch.float64)
    expected = F.silu(F.conv1d(x.T.unsqueeze(0), weight.unsqueeze(1), padding=3, groups=12)[0, :, :30]).T
    out, _ = causal_conv(x, weight)
    torch.testing.assert_close(out, expected)
    first, state = causal_conv(x[:17], weight)  # a prefix, then the rest from its state
    rest, _ = causal_conv(x[17:], weight, state)
    torch.testing.assert_close(torch.cat([first, rest]), expected)
    _, states = causal_conv(x[17:], weight, state, keep_states=True)  # rollback: the state after each row
    for rows in (1, 5, 13):
        assert torch.equal(states[rows - 1], causal_conv(x[17 : 17 + rows], weight, state)[1])


@pytest.mark.parametrize("rows,chunk", [(100, 16), (150, 64)])
def test_the_chunked_form_stays_finite_and_exact_under_strong_decays(rows, chunk):
    """Log decays down to -20 a row: within a chunk G_i - G_j reaches hundreds above the diagonal
    (never exponentiated) and e^{G_i} underflows to 0; the last chunk is padded (rows % chunk)."""
    q, k, v, _, beta, state = inputs(rows, seed=rows + 1)
    g = -torch.rand(rows, 4, generator=torch.Generator().manual_seed(rows), dtype=torch.float64) * 20
    g[::7] = 0.0  # some rows that do not decay at all
    out, final = recurrent(q, k, v, g, beta, state)
    out_c, final_c = chunked(q, k, v, g, beta, state, chunk=chunk)
    assert torch.isfinite(out_c).all() and torch.isfinite(final_c).all()
    torch.testing.assert_close(out_c, out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final_c, final, rtol=1e-4, atol=1e-5)


def test_padding_rows_change_nothing():
    """The rows that pad the last chunk (beta = 0, g = 0, q = k = v = 0) leave the state and the
    outputs of the real rows as they are, in either form."""
    q, k, v, g, beta, state = inputs(37, seed=11)
    extra = 11  # 37 + 11 = 48: whole chunks of 8 and 16, a part chunk of 64
    padded = [torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]) for x in (q, k, v, g, beta)]
    out, final = recurrent(q, k, v, g, beta, state)
    out_p, final_p = recurrent(*padded, state)
    assert torch.equal(final_p, final) and torch.equal(out_p[:37], out) and not out_p[37:].any()
    for chunk in (8, 16, 64):
        out_c, final_c = chunked(q, k, v, g, beta, state, chunk=chunk)
        out_pc, final_pc = chunked(*padded, state, chunk=chunk)
        torch.testing.assert_close(out_pc[:37], out_c, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final_pc, final_c, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final_c, final, rtol=1e-4, atol=1e-5)


def test_an_empty_prompt_returns_no_rows_and_the_state_before_it():
    q, k, v, g, beta, state = inputs(0)
    out, final = chunked(q, k, v, g, beta, state)
    assert out.shape == (0, 4, 8) and out.dtype == v.dtype
    assert torch.equal(final, state.float())
