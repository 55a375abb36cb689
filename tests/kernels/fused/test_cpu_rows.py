"""The torch references the CPU runs whole batches through (DESIGN §11): a row's bits are its
one-row step's, whatever other rows share the call and wherever the row sits in it."""

import math

import pytest
import torch

from kernels.fused import linear as linear_module
from kernels.fused.attention import attention_reference
from kernels.fused.linear import rowwise_linear


@pytest.mark.parametrize("num_out", [70, linear_module.WIDE_OUTPUTS, linear_module.WIDE_OUTPUTS + 30])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 8, 9])
def test_rowwise_linear_rows_are_their_one_row_bits(num_out, num_rows):
    g = torch.Generator().manual_seed(num_out * 10 + num_rows)
    x = torch.randn(num_rows, 200, generator=g)
    w = torch.randn(num_out, 200, generator=g)
    out = rowwise_linear(x, w)
    assert out.shape == (num_rows, num_out)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, rtol=1e-4, atol=1e-4)
    for i in range(num_rows):
        assert torch.equal(rowwise_linear(x[i : i + 1], w)[0], out[i]), f"row {i} of {num_rows}"
    # the same row among other rows, at another place (a tile's other row differs)
    shuffled = torch.cat([torch.randn(1, 200, generator=g), x.flip(0)])
    assert torch.equal(rowwise_linear(shuffled, w)[1:].flip(0), out)


def test_rowwise_linear_of_no_rows():
    assert rowwise_linear(torch.zeros(0, 8), torch.zeros(linear_module.WIDE_OUTPUTS, 8)).shape == (0, 2048)


def contiguous_tables(num_slots, blocks_per_slot):
    return torch.arange(num_slots * blocks_per_slot, dtype=torch.int32).view(num_slots, blocks_per_slot)


@pytest.mark.parametrize("gated", [False, True])
def test_attention_reference_rows_are_their_one_row_bits_and_exact(gated):
    g = torch.Generator().manual_seed(3)
    num_heads, num_kv, head_dim, block_size, blocks_per_slot = 8, 2, 16, 16, 6  # GQA: 4 query heads a KV head
    tables = contiguous_tables(3, blocks_per_slot)[:, torch.randperm(blocks_per_slot, generator=g)]  # shuffled blocks
    keys = torch.randn(3 * blocks_per_slot, block_size, num_kv, head_dim, generator=g)
    values = torch.randn(3 * blocks_per_slot, block_size, num_kv, head_dim, generator=g)
    positions = torch.tensor([0, 15, 16, 40, 41, 95])  # block edges, a window's consecutive rows
    slots = torch.tensor([1, 0, 2, 2, 2, 0])
    q = torch.randn(len(positions), num_heads, head_dim, generator=g)
    gate = torch.randn(len(positions), num_heads * head_dim, generator=g) if gated else None
    out = attention_reference(q, keys, values, tables, positions, slots, gate)
    for i in range(len(positions)):
        alone = attention_reference(q[i : i + 1], keys, values, tables, positions[i : i + 1], slots[i : i + 1],
                                    None if gate is None else gate[i : i + 1])
        assert torch.equal(alone[0], out[i]), f"row {i}"
        # against attention written out in float64 over the row's own positions
        span = torch.arange(int(positions[i]) + 1)
        blocks = tables[slots[i], span // block_size].long()
        k = keys[blocks, span % block_size].double().repeat_interleave(num_heads // num_kv, dim=1)  # [L, Hq, D]
        v = values[blocks, span % block_size].double().repeat_interleave(num_heads // num_kv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) / math.sqrt(head_dim)
        expected = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
        if gate is not None:
            expected = expected * torch.sigmoid(gate[i].double().view(num_heads, head_dim))
        torch.testing.assert_close(out[i].double(), expected, rtol=1e-5, atol=1e-5)
