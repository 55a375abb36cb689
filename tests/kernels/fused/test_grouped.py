"""kernels.fused.grouped: prefill's expert products over routes sorted by expert, FP8 weights read
as stored — the tile table against an enumeration, the kernels against the dequantised weights
(float64; odd sizes, blocks that neither divide nor fit them, experts with no routes and with
several tiles, routes of no expert sorted behind), row invariance (a route's output whatever the
chunk holds), and the errors."""

import pytest
import torch

from kernels.fused import grouped as grouped_module
from kernels.fused.fp8 import cat_rows, quantize
from kernels.fused.grouped import grouped_experts, grouped_experts_reference, tile_table, tile_table_reference

from .conftest import assert_same_row, devices_and_dtypes

# (hidden, inter, block): odd sizes whose blocks neither divide them nor fit them once
SHAPES = [(96, 48, (32, 32)), (130, 40, (16, 32)), (64, 128, (128, 128))]
SMALL_TILES = {"GATE_UP_TILE": (16, 16, 32, 4, 2), "DOWN_TILE": (32, 16, 32, 4, 2)}  # several tiles of N, K and M


def experts(num_experts, hidden, inter, block, g):
    gate = quantize(0.1 * torch.randn(num_experts, inter, hidden, generator=g), block)
    up = quantize(0.1 * torch.randn(num_experts, inter, hidden, generator=g), block)
    down = quantize(0.1 * torch.randn(num_experts, hidden, inter, generator=g), block)
    return cat_rows([gate, up]), down  # [E, 2I, H] (per-row scales where I is not whole blocks), [E, H, I]


def sort_routes(expert_ids, num_experts, skip=()):
    """(order, counts) as shared.model.expert_paths sorts a chunk's routes: keys = expert, routes of
    an expert in `skip` keyed num_experts (behind every expert's, not computed)."""
    keys = expert_ids.reshape(-1).clone()
    for expert in skip:
        keys[keys == expert] = num_experts
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=num_experts + 1)[:num_experts]
    for expert in skip:
        counts[expert] = 0
    return order, counts


MANY = torch.randint(0, 90, (128,), generator=torch.Generator().manual_seed(5)).tolist()  # 128 experts: several programs


@pytest.mark.parametrize("counts", [[0, 5, 16, 17, 0, 33], [1], [0, 0, 0], [64, 64, 1], MANY])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("way", ["kernel", "torch"])
def test_the_tile_table_covers_each_experts_routes_once_in_tiles_of_its_own(counts, block_m, way):
    num_routes = sum(counts) + 3  # (routes of no expert behind)
    make = tile_table if way == "kernel" else tile_table_reference
    expert, start, length = make(torch.tensor(counts), block_m, num_routes)
    if way == "kernel":  # (the tiles past the last: length 0, whatever else they hold)
        ref = tile_table_reference(torch.tensor(counts), block_m, num_routes)
        used = ref[2] > 0
        assert torch.equal(length, ref[2]) and torch.equal(expert[used], ref[0][used])
        assert torch.equal(start[used], ref[1][used])
    assert expert.numel() == -(-num_routes // block_m) + len(counts)
    covered = []
    for e, s, n in zip(expert.tolist(), start.tolist(), length.tolist()):
        assert 0 <= n <= block_m
        if n:
            first = sum(counts[:e])
            assert first <= s and s + n <= first + counts[e], (e, s, n)
            covered += range(s, s + n)
    assert sorted(covered) == list(range(sum(counts)))  # every routed position once, nothing else


@devices_and_dtypes()
@pytest.mark.parametrize("hidden,inter,block", SHAPES)
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_grouped_experts_read_fp8_as_their_dequantised_weights(device, dtype, hidden, inter, block, tiles, monkeypatch):
    if tiles == "small":
        for name, tile in SMALL_TILES.items():
            monkeypatch.setattr(grouped_module, name, tile)
    g = torch.Generator().manual_seed(hidden + inter)
    num_experts, top_k, num_tokens = 5, 2, 45
    gate_up, down = experts(num_experts, hidden, inter, block, g)
    x = torch.randn(num_tokens, hidden, generator=g)
    expert_ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), generator=g)  # expert 4: no routes
    expert_ids[:40, 0] = 1  # expert 1: 40+ routes (several tiles of 16 and 32)
    order, counts = sort_routes(expert_ids, num_experts, skip=(3,))  # expert 3's routes: not computed
    routed = int(counts.sum())
    out = grouped_experts(x.to(device, dtype), order.to(device), counts.to(device), top_k, gate_up.to(device),
                          down.to(device))
    assert out.shape == (num_tokens * top_k, hidden) and out.dtype == dtype
    reference = grouped_experts_reference(x.double(), order, counts, top_k, gate_up, down)
    err = (out[:routed].double().cpu() - reference[:routed]).norm() / reference[:routed].norm()
    assert err < (1e-6 if dtype == torch.float32 else 2e-2), f"relative error {err:.3g}"


@devices_and_dtypes()
def test_full_precision_experts_run_the_same_kernels(device, dtype):
    g = torch.Generator().manual_seed(7)
    num_experts, top_k = 4, 3
    gate_up = 0.1 * torch.randn(num_experts, 2 * 40, 72, generator=g)
    down = 0.1 * torch.randn(num_experts, 72, 40, generator=g)
    x = torch.randn(21, 72, generator=g)
    expert_ids = torch.randint(0, num_experts, (21, top_k), generator=g)
    order, counts = sort_routes(expert_ids, num_experts)
    out = grouped_experts(x.to(device, dtype), order.to(device), counts.to(device), top_k,
                          gate_up.to(device, dtype), down.to(device, dtype))
    reference = grouped_experts_reference(x.double(), order, counts, top_k, gate_up.double(), down.double())
    err = (out.double().cpu() - reference).norm() / reference.norm()
    assert err < (1e-6 if dtype == torch.float32 else 2e-2), f"relative error {err:.3g}"


@devices_and_dtypes()
def test_a_routes_output_does_not_depend_on_the_chunk_beside_it(device, dtype):
    """Row invariance (DESIGN §11, prefill): a prompt's routes alone, then sorted among another
    prompt's routes (other tiles, other positions in them) — the same output for each."""
    g = torch.Generator().manual_seed(3)
    num_experts, top_k, hidden, inter = 4, 2, 96, 64
    gate_up, down = (w.to(device) for w in experts(num_experts, hidden, inter, (32, 32), g))
    mine = torch.randn(9, hidden, generator=g)
    others = torch.randn(70, hidden, generator=g)
    mine_ids = torch.randint(0, num_experts, (9, top_k), generator=g)
    other_ids = torch.randint(0, num_experts, (70, top_k), generator=g)

    def by_route(x, ids):  # outputs [T*k, H] in route order
        order, counts = sort_routes(ids, num_experts)
        out = grouped_experts(x.to(device, dtype), order.to(device), counts.to(device), top_k, gate_up, down)
        return out[torch.argsort(order.to(device))]

    alone = by_route(mine, mine_ids)
    together = by_route(torch.cat([others[:30], mine, others[30:]]), torch.cat([other_ids[:30], mine_ids, other_ids[30:]]))
    assert_same_row(alone, together[30 * top_k : 39 * top_k])


def test_fp8_and_full_precision_experts_do_not_mix_and_counts_name_every_expert():
    g = torch.Generator().manual_seed(0)
    gate_up, down = experts(3, 32, 16, (16, 16), g)
    x = torch.randn(4, 32, generator=g)
    order, counts = sort_routes(torch.randint(0, 3, (4, 2), generator=g), 3)
    with pytest.raises(ValueError, match="both be FP8 or neither"):
        grouped_experts(x, order, counts, 2, gate_up, down.dequantize())
    with pytest.raises(ValueError, match="counts has 2 experts"):
        grouped_experts(x, order, counts[:2], 2, gate_up, down)
