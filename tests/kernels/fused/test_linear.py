"""kernels.fused.linear: prefill_linear, one tile for every row count, so a prompt's rows are the
same bits alone or in a forward shared with other prompts (DESIGN §11); the table of settings
measured per weight shape."""

import pytest
import torch
import torch.nn.functional as F

import kernels.fused.linear as linear_module
from kernels.fused.linear import prefill_linear

from .conftest import assert_same_row, devices_and_dtypes, tolerance


def rel_err(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@devices_and_dtypes()
def test_rows_are_the_same_bits_whatever_shares_the_forward(device, dtype):
    g = torch.Generator().manual_seed(21)
    weight = (0.1 * torch.randn(200, 96, generator=g)).to(device, dtype)  # N not a multiple of the tile's 128
    x = torch.randn(150, 96, generator=g).to(device, dtype)
    shared = prefill_linear(x, weight)
    assert shared.shape == (150, 200) and shared.dtype == dtype
    assert rel_err(shared, F.linear(x.double(), weight.double())) < tolerance(dtype)
    for start, stop in ((0, 7), (7, 47), (47, 150), (100, 101)):  # a prompt of 7, 40, 103 and 1 rows alone
        assert_same_row(prefill_linear(x[start:stop], weight), shared[start:stop])


def test_off_it_is_cublas_and_shapes_are_checked(monkeypatch):
    x, weight = torch.randn(5, 8), torch.randn(3, 8)
    monkeypatch.setattr(linear_module, "INVARIANT_PREFILL", False)
    assert torch.equal(prefill_linear(x, weight), F.linear(x, weight))
    with pytest.raises(ValueError, match="do not match"):
        prefill_linear(x, torch.randn(3, 7))
    assert prefill_linear(x[:0], weight).shape == (0, 3)


def test_measured_settings_are_well_formed_and_win_over_the_rule():
    """Every MEASURED entry is a launch the kernel can take (power-of-two blocks, its pipelined
    tiles within the shared-memory budget) and is what linear_config answers for that shape."""
    for (num_out, num_in), config in linear_module.MEASURED.items():
        block_n, block_k, warps, stages = config
        for size in (block_n, block_k, warps):
            assert size & (size - 1) == 0, f"{config} for [{num_out}, {num_in}]"
        assert stages >= 2
        assert (stages - 1) * (linear_module.BLOCK_M + block_n) * block_k * 2 <= linear_module.SMEM_BUDGET
        assert linear_module.linear_config(num_out, num_in) == config
