"""The wide products (kernels/fused/_cpu_wide.c: two input rows a 16-lane register on a machine with
AVX-512) against the 8-lane kernels: the same bits for every row, so a row's product does not depend
on how many rows share its step (DESIGN §11)."""

import pytest
import torch

from kernels.fused import cpu_rows
from kernels.fused.paired import pair_bf16

needs_wide = pytest.mark.skipif(not cpu_rows.available() or not cpu_rows.wide_products(),
                                reason="the wide kernel runs on x86-64 machines with AVX-512 only")


def halves(*shape, seed=0):
    """float32 values that are bfloat16 values (weights that the paired layout holds exactly)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()


@needs_wide
@pytest.mark.parametrize("paired", [False, True], ids=["float32", "paired"])
@pytest.mark.parametrize("num_out, num_in, splits, step", [
    (37, 256, 1, 256),  # whole chunks; weight rows in fours and a remainder
    (70, 200, 1, 200),  # an eight after the paired chunks: the 8-lane kernels take that split
    (64, 24, 1, 24),  # three eights (float32: wide; paired: a chunk and an eight, so 8-lane)
    (33, 96, 3, 32),  # split-K, splits of two chunks
    (40, 100, 2, 50),  # splits that are no multiple of eight: 8-lane
    (21, 120, 3, 40),  # splits starting at a chunk's second eight
    (130, 64, 4, 16),  # one chunk a split, more than two column blocks a work item
])
def test_wide_products_are_the_8_lane_kernels_bits_for_any_number_of_rows(paired, num_out, num_in, splits, step):
    x = torch.randn(11, num_in, generator=torch.Generator().manual_seed(num_in))
    weight = halves(num_out, num_in, seed=num_out)
    weight = pair_bf16(weight) if paired else weight
    one_row = [cpu_rows.partials(x[i : i + 1], weight, splits, step, paired=paired)[0] for i in range(len(x))]
    for num_rows in [2, 3, 4, 7, 8, 9, 11]:  # odd rows (a pair's second half empty); more than one pass of 8
        wide = cpu_rows.partials(x[:num_rows], weight, splits, step, paired=paired)
        narrow = cpu_rows.partials(x[:num_rows], weight, splits, step, paired=paired, wide=False)
        assert torch.equal(wide, narrow), num_rows
        for i in range(num_rows):
            assert torch.equal(wide[i], one_row[i]), (num_rows, i)


@needs_wide
def test_wide_products_of_special_values_keep_them():
    """Infinities and NaNs reach the sums they are in, and only those (no lane leaks into a neighbour)."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    x[1, 9] = float("inf")
    x[3, 40] = float("nan")
    weight = halves(12, 64, seed=4).abs() + 0.5  # (positive: an infinity stays one)
    wide = cpu_rows.partials(x, weight, 1, 64)
    torch.testing.assert_close(wide, cpu_rows.partials(x, weight, 1, 64, wide=False), rtol=0, atol=0, equal_nan=True)
    assert torch.isinf(wide[1]).all() and torch.isnan(wide[3]).all()
    assert torch.isfinite(wide[[0, 2, 4]]).all()
    finite = [0, 2, 4]
    assert torch.equal(wide[finite], cpu_rows.partials(x[finite], weight, 1, 64, wide=False))

