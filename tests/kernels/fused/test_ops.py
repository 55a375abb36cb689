"""Each fused kernel against its torch reference, and row invariance (a row's bits do not
depend on the other rows of its launch)."""

import pytest
import torch
import torch.nn.functional as F

from kernels.fused.attention import AttentionWorkspace, attention_reference, decode_attention
from kernels.fused.linear import linear
from kernels.fused.moe import combine_add_rmsnorm, combine_reference, experts_reference, fused_experts, silu_mul
from kernels.fused.norm import add_rmsnorm, add_rmsnorm_reference, qk_norm_rope_reference, qk_norm_rope_store
from kernels.fused.router import MoceTables, route
from kernels.routing import route_topk
from shared.model.layers import Rotary

from .conftest import assert_same_row, devices_and_dtypes, identity_tables, page, tolerance


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@devices_and_dtypes()
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_linear_matches_reference_and_rows_are_invariant(device, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=g).to(device, dtype)  # K not a multiple of the block: masked tail
    w = torch.randn(70, 200, generator=g).to(device, dtype)
    out = linear(x, w)
    ref = x.double() @ w.double().T
    assert out.shape == (rows, 70) and out.dtype == dtype
    assert rel_err(out, ref) < tolerance(dtype)
    middle = rows // 2
    assert_same_row(linear(x[middle : middle + 1], w)[0], out[middle])
    assert linear(x, w, out_dtype=torch.float32).dtype == torch.float32


@devices_and_dtypes()
def test_add_rmsnorm_matches_reference(device, dtype):
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(6, 96, generator=g).to(device, dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(device, dtype)
    normed, residual = add_rmsnorm(x, r, w, 1e-6)
    ref_normed, ref_residual = add_rmsnorm_reference(x, r, w, 1e-6)
    assert rel_err(normed, ref_normed) < tolerance(dtype)
    assert rel_err(residual, ref_residual) < tolerance(dtype)
    alone, _ = add_rmsnorm(x[2:3], r[2:3], w, 1e-6)
    assert_same_row(alone[0], normed[2])
    normed_only, same = add_rmsnorm(x, None, w, 1e-6)
    assert same is x or torch.equal(same, x)
    assert rel_err(normed_only, add_rmsnorm_reference(x, None, w, 1e-6)[0]) < tolerance(dtype)


@devices_and_dtypes()
def test_per_row_kernels_reading_before_the_wait_give_the_same_bits(device, dtype, monkeypatch):
    # EARLY_READS moves the loads of what the kernel before does not write (weights, residuals,
    # positions, cache rows, route weights) ahead of the PDL wait: the same values, the same math.
    import kernels.fused as fused_package

    g = torch.Generator().manual_seed(8)
    x, r = (torch.randn(3, 96, generator=g).to(device, dtype) for _ in range(2))
    partials = torch.randn(3, 2, 96, generator=g).to(device)
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(device, dtype)
    top_k = 3
    route_out = torch.randn(3 * top_k, 96, generator=g).to(device)
    route_w = torch.rand(3, top_k, generator=g).to(device)
    route_rows = torch.randperm(3 * top_k, generator=g).to(device)
    num_heads, num_kv, head_dim = 4, 2, 16
    qkv = torch.randn(3, (num_heads + 2 * num_kv) * head_dim, generator=g).to(device, dtype)
    q_norm, k_norm = ((1 + 0.2 * torch.randn(head_dim, generator=g)).to(device, dtype) for _ in range(2))
    rotary = Rotary(head_dim, 10000.0, 64).to(device)
    positions, slots = torch.tensor([9, 10, 11], device=device), torch.tensor([1, 1, 1], device=device)

    def run():
        keys, tables = page(torch.zeros(2, 64, num_kv, head_dim, dtype=dtype, device=device), 4,
                            torch.Generator().manual_seed(2))
        values = torch.zeros_like(keys)
        q = qk_norm_rope_store(qkv, q_norm, k_norm, rotary.cos, rotary.sin, positions, slots, keys, values, tables,
                               num_heads, num_kv, 1e-6)
        return (*add_rmsnorm(x, r, w, 1e-6), *add_rmsnorm(partials, r, w, 1e-6), add_rmsnorm(x, None, w, 1e-6)[0],
                *combine_add_rmsnorm(route_out, route_w, r, w, 1e-6),
                *combine_add_rmsnorm(route_out, route_w, r, w, 1e-6, route_rows=route_rows), q, keys, values)

    monkeypatch.setattr(fused_package, "EARLY_READS", False)
    late = run()
    monkeypatch.setattr(fused_package, "EARLY_READS", True)
    early = run()
    for a, b in zip(late, early):
        assert torch.equal(a, b)


@devices_and_dtypes()
@pytest.mark.parametrize("block_size", [4, 64])
def test_qk_norm_rope_writes_the_cache_at_slot_and_position(device, dtype, block_size):
    g = torch.Generator().manual_seed(4)
    num_heads, num_kv, head_dim = 4, 2, 16
    qkv = torch.randn(3, (num_heads + 2 * num_kv) * head_dim, generator=g).to(device, dtype)
    q_norm, k_norm = ((1 + 0.2 * torch.randn(head_dim, generator=g)).to(device, dtype) for _ in range(2))
    rotary = Rotary(head_dim, 10000.0, 64).to(device)
    positions = torch.tensor([9, 10, 11], device=device)  # across a block boundary when blocks hold 4
    slots = torch.tensor([1, 1, 1], device=device)
    keys, tables = page(torch.zeros(2, 64, num_kv, head_dim, dtype=dtype, device=device), block_size, g)
    values = torch.zeros_like(keys)
    q = qk_norm_rope_store(qkv, q_norm, k_norm, rotary.cos, rotary.sin, positions, slots, keys, values, tables,
                           num_heads, num_kv, 1e-6)
    ref_q, ref_k, ref_v = qk_norm_rope_reference(qkv, q_norm, k_norm, rotary.cos, rotary.sin, positions,
                                                 num_heads, num_kv, 1e-6)
    assert rel_err(q, ref_q) < tolerance(dtype)
    written = torch.stack([tables[1, p // block_size].long() * block_size + p % block_size for p in (9, 10, 11)])
    flat_keys, flat_values = keys.flatten(0, 1), values.flatten(0, 1)  # [blocks * block_size, Hkv, D]
    assert rel_err(flat_keys[written], ref_k) < tolerance(dtype)
    assert torch.equal(flat_values[written], ref_v)
    untouched = torch.ones(flat_keys.shape[0], dtype=torch.bool, device=device)
    untouched[written] = False
    assert not flat_keys[untouched].any() and not flat_values[untouched].any()


@devices_and_dtypes()
@pytest.mark.parametrize("context", [5, 300, 1100])
@pytest.mark.parametrize("block_size", [16, 64])  # 16: per-key block ids; 64: a tile per block
def test_split_attention_matches_reference_and_rows_are_invariant(device, dtype, context, block_size):
    g = torch.Generator().manual_seed(context)
    num_heads, num_kv, head_dim, max_length = 8, 2, 32, 1200  # 4 query heads per KV head (GQA)
    contiguous_keys = torch.randn(3, max_length, num_kv, head_dim, generator=g).to(device, dtype)
    contiguous_values = torch.randn(3, max_length, num_kv, head_dim, generator=g).to(device, dtype)
    keys, tables = page(contiguous_keys, block_size, torch.Generator().manual_seed(1))
    values, same_tables = page(contiguous_values, block_size, torch.Generator().manual_seed(1))
    assert torch.equal(tables, same_tables)
    rows = 5
    q = torch.randn(rows, num_heads, head_dim, generator=g).to(device, dtype)
    positions = torch.arange(context - rows, context, device=device).clamp_min(0)
    slots = torch.full((rows,), 2, device=device)
    workspace = AttentionWorkspace(17, num_heads, head_dim, max_length, device)
    starts = torch.tensor([0, rows], dtype=torch.int32, device=device)
    out = decode_attention(q, keys, values, tables, positions, slots, starts, slots[:1], rows, workspace)
    ref = attention_reference(q, contiguous_keys, contiguous_values, identity_tables(3, device), positions, slots)
    assert rel_err(out, ref) < tolerance(dtype)
    assert rel_err(attention_reference(q, keys, values, tables, positions, slots), ref) < 1e-6  # the paged reference
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for i in (0, rows - 1):
        alone = decode_attention(q[i : i + 1], keys, values, tables, positions[i : i + 1], slots[:1], one, slots[:1], 1,
                                 workspace)
        assert_same_row(alone[0], out[i])


@devices_and_dtypes()
def test_attention_ragged_sequences_use_their_own_slots(device, dtype):
    g = torch.Generator().manual_seed(9)
    contiguous_keys = torch.randn(3, 320, 2, 16, generator=g).to(device, dtype)
    contiguous_values = torch.randn(3, 320, 2, 16, generator=g).to(device, dtype)
    keys, tables = page(contiguous_keys, 32, torch.Generator().manual_seed(2))
    values, _ = page(contiguous_values, 32, torch.Generator().manual_seed(2))
    q = torch.randn(4, 4, 16, generator=g).to(device, dtype)
    positions = torch.tensor([40, 41, 41, 299], device=device)  # seq 0: 2 rows in slot 2; seq 1: 1 row; seq 2: 1 row
    slots = torch.tensor([2, 2, 0, 1], device=device)
    starts = torch.tensor([0, 2, 3, 4], dtype=torch.int32, device=device)
    workspace = AttentionWorkspace(8, 4, 16, 320, device)
    out = decode_attention(q, keys, values, tables, positions, slots, starts, torch.tensor([2, 0, 1], device=device), 2,
                           workspace)
    ref = attention_reference(q, contiguous_keys, contiguous_values, identity_tables(3, device), positions, slots)
    assert rel_err(out, ref) < tolerance(dtype)


@devices_and_dtypes()
@pytest.mark.parametrize("moce", [False, True])
def test_router_picks_the_reference_experts(device, dtype, moce):
    g = torch.Generator().manual_seed(11)
    logits = (3 * torch.randn(9, 24, generator=g)).to(device, dtype)
    logits[0, 5] = logits[0, 7]  # an exact tie: the lower id wins
    kwargs, ref_kwargs = {}, {}
    if moce:
        resident = (torch.rand(24, generator=g) > 0.5).to(device)
        draft_rows = (torch.arange(9) % 2 == 0).to(device)
        tables = MoceTables(4, scale=1.7, r1_scale=1.3, protect=2, device=device)
        kwargs = dict(resident=resident, draft_rows=draft_rows, tables=tables)
        ref_kwargs = dict(resident=resident, draft_rows=draft_rows, scale=1.7, r1_scale=1.3, protect=2)
    for normalize in (True, False):
        ids, weights = route(logits, 4, normalize=normalize, **kwargs)
        ref_ids, ref_weights = route_topk(logits, 4, normalize=normalize, **ref_kwargs)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@devices_and_dtypes()
def test_router_one_reduction_per_pick_is_bit_identical(device, dtype, monkeypatch):
    """MAX_WITH_INDEX (max and its index in one reduction) against the argmax and a second reduction
    for the probability: the same ids and bit-identical weights, ties included."""
    import kernels.fused.router as router

    g = torch.Generator().manual_seed(12)
    logits = (3 * torch.randn(7, 40, generator=g)).to(device, dtype)
    logits[1, 3] = logits[1, 30]  # exact ties: the lower id wins either way
    logits[2, :] = 0.5
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(router, "MAX_WITH_INDEX", fused)
        results[fused] = route(logits, 6, normalize=True)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    assert torch.equal(results[True][0], route_topk(logits, 6, normalize=True)[0])


@devices_and_dtypes()
@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_fused_experts_match_reference_and_rows_are_invariant(device, dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    num_experts, inter, hidden, top_k = 6, 48, 256, 3  # hidden = 2 K blocks of the kernel
    gate_up = (0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=g)).to(device, dtype)
    down = (0.2 * torch.randn(num_experts, hidden, inter, generator=g)).to(device, dtype)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    # tokens * top_k routes over 6 experts: with 40 tokens some expert has more than 16 routes,
    # so its group spans several programs
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]).to(device)
    out = fused_experts(x, ids, gate_up, down)
    ref = experts_reference(x, ids, gate_up, down)
    assert out.dtype == torch.float32 and out.shape == (tokens * top_k, hidden)
    assert rel_err(out, ref) < tolerance(dtype)
    t = tokens // 2
    alone = fused_experts(x[t : t + 1], ids[t : t + 1], gate_up, down)
    assert_same_row(alone, out[t * top_k : (t + 1) * top_k])


@devices_and_dtypes()
@pytest.mark.parametrize("tokens", [3, 40])
def test_expert_groups_from_the_table_give_the_same_bits(device, dtype, tokens, monkeypatch):
    # The table (route_table_kernel) forms the groups that each program otherwise finds by
    # comparing its route with all: the same routes share a tile, so every row is the same.
    from kernels.fused import moe

    g = torch.Generator().manual_seed(7 + tokens)
    num_experts, inter, hidden, top_k = 6, 48, 256, 3
    gate_up = (0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=g)).to(device, dtype)
    down = (0.2 * torch.randn(num_experts, hidden, inter, generator=g)).to(device, dtype)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[1] = -1  # a padding row: routes of no expert
    ids = ids.to(device)
    live = (ids.reshape(-1) >= 0)
    monkeypatch.setattr(moe, "TABLE_MIN_ROUTES", 1 << 30)
    compared = fused_experts(x, ids, gate_up, down)[live]
    monkeypatch.setattr(moe, "TABLE_MIN_ROUTES", 1)
    tabled = fused_experts(x, ids, gate_up, down)[live]
    assert torch.equal(compared, tabled)


def test_route_table_sorts_routes_by_expert_and_marks_each_group_s_start():
    from kernels.fused import cdiv, interpreting, moe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        assert interpreting(), "TRITON_INTERPRET=1 must be set on a CPU-only machine"
    flat = [2, 0, 2, -1, 2, 1, 2, 2, 0, -1, 2]  # expert 2: 6 routes, groups of BLOCK_M (4 here)
    ids = torch.tensor(flat, device=device)
    r = len(flat)
    sorted_routes = torch.full((r,), -7, dtype=torch.int32, device=device)
    tile_len = torch.full((r,), -7, dtype=torch.int32, device=device)
    moe._kernels()[4][(cdiv(r, 4),)](ids, sorted_routes, tile_len, r, R_PAD=16, CHUNK=4, BLOCK_M=4, PDL=False)
    assert sorted_routes.tolist() == [3, 9, 1, 8, 5, 0, 2, 4, 6, 7, 10]  # stable by expert, no expert first
    assert tile_len.tolist() == [0, 0, 2, 0, 1, 4, 0, 0, 0, 2, 0]


@devices_and_dtypes()
def test_combine_add_rmsnorm_matches_reference(device, dtype):
    g = torch.Generator().manual_seed(12)
    route_out = torch.randn(12, 64, generator=g).to(device)
    weights = torch.rand(4, 3, generator=g).to(device)
    residual = torch.randn(4, 64, generator=g).to(device, dtype)
    norm = (1 + 0.2 * torch.randn(64, generator=g)).to(device, dtype)
    normed, new_residual = combine_add_rmsnorm(route_out, weights, residual, norm, 1e-6)
    ref_normed, ref_residual = combine_reference(route_out, weights, residual, norm, 1e-6)
    assert rel_err(normed, ref_normed) < tolerance(dtype)
    assert rel_err(new_residual, ref_residual) < tolerance(dtype)


@devices_and_dtypes()
def test_combine_reads_routes_through_their_rows(device, dtype):
    # Prefill's grouped experts leave route outputs sorted by expert: reading them through
    # route_rows must give exactly what un-permuting them first gives.
    g = torch.Generator().manual_seed(13)
    route_out = torch.randn(12, 64, generator=g).to(device, dtype)
    route_rows = torch.randperm(12, generator=g).to(device)
    weights = torch.rand(4, 3, generator=g).to(device)
    residual = torch.randn(4, 64, generator=g).to(device, dtype)
    norm = (1 + 0.2 * torch.randn(64, generator=g)).to(device, dtype)
    through_rows = combine_add_rmsnorm(route_out, weights, residual, norm, 1e-6, route_rows=route_rows)
    unpermuted = combine_add_rmsnorm(route_out[route_rows], weights, residual, norm, 1e-6)
    for a, b in zip(through_rows, unpermuted):
        assert torch.equal(a, b)
    ref_normed, _ = combine_reference(route_out[route_rows].float(), weights, residual, norm, 1e-6)
    assert rel_err(through_rows[0], ref_normed) < tolerance(dtype)


@devices_and_dtypes()
@pytest.mark.parametrize("rows", [1, 37])
def test_silu_mul_matches_reference(device, dtype, rows):
    gate_up = torch.randn(rows, 2 * 48, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert rel_err(silu_mul(gate_up), F.silu(gate) * up) < tolerance(dtype)


@devices_and_dtypes()
@pytest.mark.parametrize("splits", [2, 4])
def test_split_k_partials_feed_the_norm_and_the_router(device, dtype, splits):
    from kernels.fused.linear import linear_partials

    g = torch.Generator().manual_seed(splits)
    x = torch.randn(5, 256, generator=g).to(device, dtype)
    w = torch.randn(48, 256, generator=g).to(device, dtype)
    partials = linear_partials(x, w, splits)
    assert partials.shape == (5, splits, 48) and partials.dtype == torch.float32
    assert rel_err(partials.sum(dim=1), x.double() @ w.double().T) < tolerance(dtype)
    assert_same_row(linear_partials(x[3:4], w, splits)[0], partials[3])
    # consumers: add_rmsnorm sums the partials (split order) and rounds to the residual's dtype
    residual = torch.randn(5, 48, generator=g).to(device, dtype)
    norm = (1 + 0.2 * torch.randn(48, generator=g)).to(device, dtype)
    normed, new_residual = add_rmsnorm(partials, residual, norm, 1e-6)
    ref_normed, ref_residual = add_rmsnorm_reference(partials.sum(dim=1).to(dtype), residual, norm, 1e-6)
    assert rel_err(new_residual, ref_residual) < tolerance(dtype)
    assert rel_err(normed, ref_normed) < tolerance(dtype)
    # and the router picks what it would from the summed logits
    ids, weights = route(partials, 4, round_to=dtype, normalize=True)
    ref_ids, ref_weights = route_topk(partials.sum(dim=1).to(dtype), 4, normalize=True)
    assert (ids == ref_ids).float().mean() > 0.9  # the sum order may flip a near-tie
    with pytest.raises(ValueError, match="round_to"):
        route(partials, 4, normalize=True)


@devices_and_dtypes()
def test_padding_rows_route_to_no_expert(device, dtype):
    """live = 0 rows get expert id -1 and no expert output; live rows are untouched."""
    torch.manual_seed(4)
    logits = torch.randn(5, 16, device=device, dtype=dtype)
    live = torch.tensor([1, 0, 1, 1, 0], device=device)
    ids, weights = route(logits, 4, normalize=True)
    masked_ids, masked_weights = route(logits, 4, normalize=True, live=live)
    assert torch.equal(masked_ids[live == 1], ids[live == 1])
    assert (masked_ids[live == 0] == -1).all()
    torch.testing.assert_close(masked_weights[live == 1], weights[live == 1])
    x = torch.randn(5, 32, device=device, dtype=dtype)
    gate_up = torch.randn(16, 2 * 16, 32, device=device, dtype=dtype) * 0.1
    down = torch.randn(16, 32, 16, device=device, dtype=dtype) * 0.1
    out = fused_experts(x, masked_ids, gate_up, down).view(5, 4, 32)
    full = fused_experts(x, ids, gate_up, down).view(5, 4, 32)
    tol = tolerance(dtype)
    torch.testing.assert_close(out[live == 1], full[live == 1], rtol=tol, atol=tol)
    reference = experts_reference(x, masked_ids, gate_up, down).view(5, 4, 32)
    assert (reference[live == 0] == 0).all()  # the kernels leave padding routes unwritten instead


@pytest.mark.parametrize("element_size", [2, 4])
def test_launch_settings_fit_the_gpus_shared_memory(element_size):
    """The pipelined tiles of every GEMV and expert kernel fit an H100/H200's 227 KiB of shared
    memory in bf16 and in fp32 (the embedded model runs fp32 on the GPU): (stages - 1)
    buffered tiles of x and the weights. The 30B-A3B shapes and small ones."""
    from kernels.fused.linear import BLOCK_M as LINEAR_M
    from kernels.fused.linear import linear_config
    from kernels.fused.moe import BLOCK_M as MOE_M
    from kernels.fused.moe import moe_config

    limit = 232448
    for num_out, num_in in [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (97, 32), (1024, 256)]:
        block_n, block_k, _, stages = linear_config(num_out, num_in, element_size)
        assert (stages - 1) * (LINEAR_M + block_n) * block_k * element_size <= limit, (num_out, num_in)
    for num_out, num_in in [(1536, 2048), (2048, 768), (32, 64), (64, 16)]:
        block_n, block_k, _, stages = moe_config(num_out, num_in, element_size)
        assert (stages - 1) * (MOE_M + 2 * block_n) * block_k * element_size <= limit, (num_out, num_in)
