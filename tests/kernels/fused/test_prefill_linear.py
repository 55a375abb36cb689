"""Prefill's projections (kernels.fused.linear.prefill_linear): one tile for every row count, so
a prompt's rows are the same bits alone or in a forward shared with other prompts (DESIGN §11)."""

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
