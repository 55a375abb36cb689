"""kernels.fused.fp8 and the kernels reading block-scaled FP8 weights (issue 36): the scheme's
arithmetic, the bit moves that make e4m3 values bf16, linear / linear_partials / fused_experts
in both ways (each tile dequantised, or its e4m3 values multiplied and its partial product
scaled) against the dequantised reference (within float32 rounding: only the order of sums and
where the scale is applied differ), and row invariance — a row's bits alone are its bits in a
window."""

import pytest
import torch

from kernels.fused.fp8 import (FP8_MAX, FP8_DTYPE, Fp8Weight, cat_rows, dequantize_fast, e4m3_bits_as_bf16, exact_bf16,
                               per_row, quantize, row_slice, take_rows)
from kernels.fused.linear import linear, linear_partials, prefill_linear, rowwise_linear
from kernels.fused.moe import experts_reference, fused_experts

from .conftest import assert_same_row, devices_and_dtypes, tolerance

# (rows, columns, block): odd sizes whose blocks neither divide them nor fit them once
SHAPES = [(200, 96, (32, 32)), (70, 130, (16, 32)), (64, 256, (128, 128)), (48, 40, (128, 16))]


def rel_err(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("num_out,num_in,block", SHAPES)
def test_quantize_keeps_each_block_within_e4m3_rounding(num_out, num_in, block):
    g = torch.Generator().manual_seed(num_out)
    w = torch.randn(num_out, num_in, generator=g)
    w[: block[0], : block[1]] = 0.0  # an all-zero block: scale 1, zeros back
    fp8 = quantize(w, block)
    assert fp8.q.dtype == torch.float8_e4m3fn and fp8.scale.dtype == torch.float32
    back = fp8.dequantize()
    assert torch.equal(back[: block[0], : block[1]], torch.zeros(min(block[0], num_out), min(block[1], num_in)))
    assert fp8.scale[0, 0] == 1.0
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value (subnormals: below 2^-9 of the block's max)
    block_max = fp8.scale.repeat_interleave(block[0], 0)[:num_out].repeat_interleave(block[1], 1)[:, :num_in] * FP8_MAX
    assert bool(((back - w).abs() <= w.abs() * 2**-4 + block_max * 2**-10 + 1e-12).all())
    # every nonzero block's largest value lands on e4m3's largest
    assert float(fp8.q.float().abs().max()) == FP8_MAX


def every_finite_code(device):
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn's two NaNs
    return codes.to(torch.uint8).view(FP8_DTYPE).to(device)


def test_e4m3_bit_moves_make_every_finite_code_exact_in_bf16():
    # the kernels' way of reading FP8 (scaled_dot) multiplies these values: every one must be the
    # code's own value, bit for bit (torch's conversion is exact: e4m3 values fit bf16)
    codes = every_finite_code("cpu")
    expected = codes.to(torch.bfloat16)
    got = e4m3_bits_as_bf16(codes)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (codes[got != expected], got[got != expected])
    assert got.abs().max() == FP8_MAX and (got[got != 0].abs().min() == 2.0**-9)  # the largest, the smallest subnormal


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bit moves are PTX: they run on a GPU only")
def test_the_kernels_bit_moves_on_the_gpu_match_their_reference():
    codes = every_finite_code("cuda").repeat(7)  # several elements a thread, odd total
    got = exact_bf16(codes[:-3])
    assert torch.equal(got.view(torch.int16).cpu(), codes[:-3].to(torch.bfloat16).view(torch.int16).cpu())


@pytest.mark.parametrize("lead,num_out,num_in,block", [((), 200, 96, (32, 32)), ((3,), 70, 300, (16, 32)),
                                                      ((2,), 40, 272, (1, 16)), ((5,), 24, 8, (128, 128))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_dequantizing_kernel_makes_the_references_values(lead, num_out, num_in, block, dtype):
    # prefill's dequantised weights (kernels.fused.linear.dense) come from one kernel where Triton
    # runs: bit for bit the reference's q × scale rounded once — over every finite code (its
    # subnormals, ±0, the largest) and scales that are not powers of two (a product rounded in
    # another dtype, or rounded twice, differs); stacks of experts, partial blocks, a scale a row
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(num_in)
    codes = every_finite_code("cpu")
    q = codes[torch.randint(0, codes.numel(), (*lead, num_out, num_in), generator=g)]
    scale_shape = (*lead, -(-num_out // block[0]), -(-num_in // block[1]))
    scale = torch.exp(torch.randn(scale_shape, generator=g) * 8)  # ~1e-14 .. 1e14: every product rounds
    weight = Fp8Weight(q.to(device), scale.to(device), block)
    got, expected = dequantize_fast(weight, dtype), weight.dequantize(dtype)
    assert got.dtype == dtype and got.shape == expected.shape
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits).cpu(), expected.view(bits).cpu()), \
        f"{int((got.view(bits) != expected.view(bits)).sum())} values differ"


def test_rows_concatenate_keeping_blocks_only_when_whole():
    g = torch.Generator().manual_seed(3)
    a, b = quantize(torch.randn(64, 64, generator=g), (32, 32)), quantize(torch.randn(40, 64, generator=g), (32, 32))
    kept = cat_rows([a, b])  # a's rows are whole blocks: b's blocks follow
    assert kept.block == (32, 32) and kept.scale.shape == (2 + 2, 2)
    assert torch.equal(kept.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    expanded = cat_rows([b, a])  # b ends mid-block: one scale per row
    assert expanded.block == (1, 32) and expanded.scale.shape == (104, 2)
    assert torch.equal(expanded.dequantize(), torch.cat([b.dequantize(), a.dequantize()]))
    assert torch.equal(row_slice(kept, 64, 104).dequantize(), b.dequantize())
    with pytest.raises(ValueError, match="whole blocks"):
        row_slice(kept, 16, 64)
    index = torch.tensor([5, 70, 0])
    assert torch.equal(take_rows(kept, index).dequantize(), kept.dequantize()[index])
    assert torch.equal(per_row(a).dequantize(), a.dequantize())
    with pytest.raises(ValueError, match="does not fit"):
        Fp8Weight(a.q, a.scale[:1], a.block)


@pytest.fixture(params=["dequant", "exact"])
def fp8_way(request, monkeypatch):
    """Both ways the kernels read FP8 weights, for the projections and the experts alike
    (kernels.fused.linear: LINEAR_ / EXPERT_FP8_EXACT; each op's default is the one measured faster)."""
    import kernels.fused.linear as linear_module

    exact = request.param == "exact"
    monkeypatch.setattr(linear_module, "LINEAR_FP8_EXACT", exact)
    monkeypatch.setattr(linear_module, "EXPERT_FP8_EXACT", exact)
    return request.param


@devices_and_dtypes()
@pytest.mark.parametrize("num_out,num_in,block", SHAPES)
def test_linear_reads_fp8_as_its_dequantised_weight(device, dtype, num_out, num_in, block, fp8_way):
    g = torch.Generator().manual_seed(num_in)
    fp8 = quantize(0.1 * torch.randn(num_out, num_in, generator=g), block).to(device)
    x = torch.randn(9, num_in, generator=g).to(device, dtype)
    reference = rowwise_linear(x.double(), fp8.dequantize(torch.float64))
    out = linear(x, fp8)
    assert out.shape == (9, num_out) and out.dtype == dtype
    assert rel_err(out, reference) < tolerance(dtype)
    for row in (0, 4, 8):  # a row alone is the same bits as in the window
        assert_same_row(linear(x[row : row + 1], fp8), out[row : row + 1])
    splits = 2
    partials = linear_partials(x, fp8, splits)
    assert partials.shape == (9, splits, num_out) and partials.dtype == torch.float32
    assert rel_err(partials.sum(dim=1), reference) < tolerance(dtype)
    assert rel_err(prefill_linear(x, fp8), reference) < tolerance(dtype)


@devices_and_dtypes()
@pytest.mark.parametrize("hidden,inter,block", [(64, 48, (16, 32)), (96, 40, (32, 32)), (100, 32, (128, 32))])
def test_fused_experts_read_fp8_as_their_dequantised_weights(device, dtype, hidden, inter, block, fp8_way):
    g = torch.Generator().manual_seed(hidden + inter)
    num_experts = 6
    gate = quantize(0.1 * torch.randn(num_experts, inter, hidden, generator=g), block)
    up = quantize(0.1 * torch.randn(num_experts, inter, hidden, generator=g), block)
    gate_up = cat_rows([gate, up]).to(device)  # [E, 2I, H]: per-row scales where I is not whole blocks
    down = quantize(0.1 * torch.randn(num_experts, hidden, inter, generator=g), block).to(device)
    x = torch.randn(7, hidden, generator=g).to(device, dtype)
    ids = torch.randint(0, num_experts, (7, 3), generator=g).to(device)
    ids[2, 1] = -1  # a dropped route (its row is not computed: compared where routes are)
    out = fused_experts(x, ids, gate_up, down)
    reference = experts_reference(x.double(), ids, gate_up.dequantize(torch.float64), down.dequantize(torch.float64))
    assert out.shape == (21, hidden) and out.dtype == torch.float32
    routed = ids.reshape(-1) >= 0
    assert rel_err(out[routed], reference[routed]) < tolerance(dtype)
    assert_same_row(fused_experts(x[4:5], ids[4:5], gate_up, down), out[12:15])
    # the reference path takes FP8 too (each routed expert dequantised)
    assert rel_err(experts_reference(x.float(), ids, gate_up, down)[routed], reference[routed]) < tolerance(torch.float32)


def test_fp8_and_full_precision_experts_do_not_mix():
    g = torch.Generator().manual_seed(1)
    gate_up = quantize(torch.randn(2, 32, 32, generator=g), (16, 16))
    with pytest.raises(ValueError, match="both be FP8"):
        fused_experts(torch.randn(1, 32), torch.zeros(1, 1, dtype=torch.long), gate_up, torch.randn(2, 32, 16))
