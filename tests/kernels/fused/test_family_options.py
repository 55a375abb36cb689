"""The fused kernels' options for the Qwen3-Next / Qwen3.5-MoE family, each off by default:
centred (1 + w) norms, partial rotary, query heads interleaved with their output gate (or the
gate after v), the attention output gate, the shared expert as route k + 1. Each against its
torch reference, the references against the family's modules
(shared.model.families.hybrid.modules), and row invariance."""

import pytest
import torch
import torch.nn.functional as F

from kernels.fused.attention import AttentionWorkspace, attention_reference, decode_attention
from kernels.fused.moe import combine_add_rmsnorm, combine_reference, experts_reference, fused_experts
from kernels.fused.norm import add_rmsnorm, add_rmsnorm_reference, qk_norm_rope_reference, qk_norm_rope_store
from kernels.fused.router import route
from shared.model.layers import Rotary

from .conftest import assert_same_row, devices_and_dtypes, identity_tables, page, tolerance


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))



def next_modules(dtype, device="cpu", *, hidden=64, num_experts=12, top_k=8, inter=32):
    """A SharedMoe (random weights, dtype) of a tiny Qwen3-Next config, and its fused tensors: the
    router with the shared gate as row E [E + 1, H], the experts with the shared one as expert E."""
    from shared.model.families.hybrid.config import NextConfig
    from shared.model.families.hybrid.modules import SharedMoe

    config = NextConfig(
        vocab_size=32, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, moe_intermediate_size=inter, shared_expert_intermediate_size=inter,
        num_experts=num_experts, num_experts_per_tok=top_k, layer_types=("full_attention",),
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, max_position_embeddings=64)
    moe = SharedMoe(config)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    moe = moe.to(device, dtype)
    shared = moe.shared_expert
    router = torch.cat([moe.gate.weight, moe.shared_expert_gate.weight]).detach()
    gate_up = torch.cat([moe.experts.gate_up_proj, torch.cat([shared.gate_proj.weight, shared.up_proj.weight])[None]])
    down = torch.cat([moe.experts.down_proj, shared.down_proj.weight[None]])
    return moe, router, gate_up.detach().contiguous(), down.detach().contiguous()


def centred_norm_module(weight, eps):
    from shared.model.families.hybrid.modules import CenteredRMSNorm

    norm = CenteredRMSNorm(weight.shape[0], eps).to(weight.device, weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@devices_and_dtypes()
def test_centred_add_rmsnorm_matches_reference_and_rows_are_invariant(device, dtype):
    g = torch.Generator().manual_seed(31)
    x, r = (torch.randn(5, 96, generator=g).to(device, dtype) for _ in range(2))
    w = (0.3 * torch.randn(96, generator=g)).to(device, dtype)  # centred weights: around 0
    normed, residual = add_rmsnorm(x, r, w, 1e-6, centred=True)
    ref_normed, ref_residual = add_rmsnorm_reference(x, r, w, 1e-6, centred=True)
    assert rel_err(normed, ref_normed) < tolerance(dtype)
    assert torch.equal(residual, ref_residual)
    # (1 + w) is the plain norm's weight up to the rounding of y and of 1 + w
    assert rel_err(normed, add_rmsnorm_reference(x, r, 1 + w.float(), 1e-6)[0]) < 3 * tolerance(dtype)
    alone, _ = add_rmsnorm(x[2:3], r[2:3], w, 1e-6, centred=True)
    assert_same_row(alone[0], normed[2])
    only, _ = add_rmsnorm(x, None, w, 1e-6, centred=True)
    assert rel_err(only, add_rmsnorm_reference(x, None, w, 1e-6, centred=True)[0]) < tolerance(dtype)
    partials = torch.randn(5, 3, 96, generator=g).to(device)
    summed, new_residual = add_rmsnorm(partials, r, w, 1e-6, centred=True)
    ref_summed, _ = add_rmsnorm_reference(partials.sum(dim=1).to(dtype), r, w, 1e-6, centred=True)
    assert rel_err(summed, ref_summed) < tolerance(dtype)
    assert_same_row(add_rmsnorm(partials[4:], r[4:], w, 1e-6, centred=True)[0][0], summed[4])


@devices_and_dtypes()
def test_centred_combine_matches_reference_and_rows_are_invariant(device, dtype):
    g = torch.Generator().manual_seed(32)
    top_k = 3
    route_out = torch.randn(4 * top_k, 64, generator=g).to(device)
    weights = torch.rand(4, top_k, generator=g).to(device)
    residual = torch.randn(4, 64, generator=g).to(device, dtype)
    norm = (0.2 * torch.randn(64, generator=g)).to(device, dtype)
    normed, new_residual = combine_add_rmsnorm(route_out, weights, residual, norm, 1e-6, centred=True)
    ref_normed, ref_residual = combine_reference(route_out, weights, residual, norm, 1e-6, centred=True)
    assert rel_err(normed, ref_normed) < tolerance(dtype)
    assert rel_err(new_residual, ref_residual) < tolerance(dtype)
    alone = combine_add_rmsnorm(route_out[top_k : 2 * top_k], weights[1:2], residual[1:2], norm, 1e-6, centred=True)
    assert_same_row(alone[0][0], normed[1])
    assert_same_row(alone[1][0], new_residual[1])
    route_rows = torch.randperm(4 * top_k, generator=g).to(device)
    through_rows = combine_add_rmsnorm(route_out, weights, residual, norm, 1e-6, route_rows=route_rows, centred=True)
    unpermuted = combine_add_rmsnorm(route_out[route_rows], weights, residual, norm, 1e-6, centred=True)
    for a, b in zip(through_rows, unpermuted):
        assert torch.equal(a, b)


def family_qkv(rows, num_heads, num_kv, head_dim, layout, generator, device="cpu", dtype=torch.float32, scale=1.0):
    """(qkv [T, P] as the family's projection gives it, q_head_stride, gate: a [T, Hq, D] view of qkv):
    "interleaved": each query head then its gate, then k, v (GatedAttention's q_proj; q_head_stride 2 D);
    "after_v": q, k, v, then the gates (rows wider than (Hq + 2 Hkv) * D; q_head_stride None)."""
    width = (2 * num_heads + 2 * num_kv) * head_dim
    qkv = (scale * torch.randn(rows, width, generator=generator)).to(device, dtype)
    if layout == "interleaved":
        gate = qkv[:, : 2 * num_heads * head_dim].unflatten(1, (num_heads, 2 * head_dim))[:, :, head_dim:]
        return qkv, 2 * head_dim, gate
    return qkv, None, qkv[:, (num_heads + 2 * num_kv) * head_dim :].unflatten(1, (num_heads, head_dim))


@devices_and_dtypes()
@pytest.mark.parametrize("layout,rotary_dim", [("after_v", 8), ("interleaved", 8), ("after_v", None)])
def test_qk_norm_rope_centred_partial_rotary_matches_reference_and_rows_are_invariant(device, dtype, layout,
                                                                                     rotary_dim):
    g = torch.Generator().manual_seed(33)
    num_heads, num_kv, head_dim, block_size = 4, 2, 16, 4
    qkv, q_stride, _ = family_qkv(3, num_heads, num_kv, head_dim, layout, g, device, dtype)
    q_norm, k_norm = ((0.2 * torch.randn(head_dim, generator=g)).to(device, dtype) for _ in range(2))
    rotary = Rotary(rotary_dim or head_dim, 10000.0, 64).to(device)
    positions, slots = torch.tensor([9, 10, 11], device=device), torch.tensor([1, 1, 1], device=device)
    options = dict(centred=True, rotary_dim=rotary_dim, q_head_stride=q_stride)

    def store(rows):
        keys, tables = page(torch.zeros(2, 16, num_kv, head_dim, dtype=dtype, device=device), block_size,
                            torch.Generator().manual_seed(2))
        values = torch.zeros_like(keys)
        q = qk_norm_rope_store(qkv[rows], q_norm, k_norm, rotary.cos, rotary.sin, positions[rows], slots[rows], keys,
                               values, tables, num_heads, num_kv, 1e-6, **options)
        written = torch.stack([tables[1, p // block_size].long() * block_size + p % block_size
                               for p in positions[rows].tolist()])
        return q, keys.flatten(0, 1)[written], values.flatten(0, 1)[written]

    q, k, v = store(slice(0, 3))
    ref_q, ref_k, ref_v = qk_norm_rope_reference(qkv, q_norm, k_norm, rotary.cos, rotary.sin, positions, num_heads,
                                                 num_kv, 1e-6, **options)
    assert rel_err(q, ref_q) < tolerance(dtype)
    assert rel_err(k, ref_k) < tolerance(dtype)
    assert torch.equal(v, ref_v)
    if rotary_dim is not None:  # the dims past rotary_dim are the normed values, not rotated
        q_heads = qkv[:, : num_heads * (q_stride or head_dim)].unflatten(1, (num_heads, -1))[..., :head_dim]
        normed_q, _ = add_rmsnorm_reference(q_heads, None, q_norm, 1e-6, centred=True)
        assert torch.equal(ref_q[..., rotary_dim:], normed_q[..., rotary_dim:])
        assert not torch.equal(ref_q[..., :rotary_dim], normed_q[..., :rotary_dim])
    alone_q, alone_k, alone_v = store(slice(1, 2))
    assert_same_row(alone_q[0], q[1])
    assert_same_row(alone_k[0], k[1])
    assert torch.equal(alone_v[0], v[1])


@devices_and_dtypes()
@pytest.mark.parametrize("layout", ["after_v", "interleaved"])
def test_attention_output_gate_matches_reference_and_rows_are_invariant(device, dtype, layout):
    g = torch.Generator().manual_seed(34)
    num_heads, num_kv, head_dim, max_length, rows = 4, 2, 64, 192, 3  # head_dim 64: two merge slices of 32
    keys = torch.randn(2, max_length, num_kv, head_dim, generator=g).to(device, dtype)
    values = torch.randn(2, max_length, num_kv, head_dim, generator=g).to(device, dtype)
    tables = identity_tables(2, device)
    q = torch.randn(rows, num_heads, head_dim, generator=g).to(device, dtype)
    # the gate: a [T, Hq, D] view of the projection's rows (strided rows, and heads when interleaved)
    qkv, _, gate = family_qkv(rows, num_heads, num_kv, head_dim, layout, g, device, dtype, scale=3.0)
    positions = torch.tensor([130, 131, 132], device=device)  # two splits of 128 keys
    slots = torch.full((rows,), 1, device=device)
    starts = torch.tensor([0, rows], dtype=torch.int32, device=device)
    workspace = AttentionWorkspace(4, num_heads, head_dim, max_length, device)
    out = decode_attention(q, keys, values, tables, positions, slots, starts, slots[:1], rows, workspace, gate=gate)
    ref = attention_reference(q, keys, values, tables, positions, slots, gate=gate)
    assert rel_err(out, ref) < tolerance(dtype)
    plain = attention_reference(q, keys, values, tables, positions, slots)
    assert torch.equal(ref, (plain * torch.sigmoid(gate)).to(dtype))  # GatedAttention's rounding
    if layout == "after_v":  # a [T, Hq * D] column slice with strided rows: the same as its [T, Hq, D] view
        flat = gate.flatten(1)
        assert flat.stride(0) == qkv.shape[1]
        flat_out = decode_attention(q, keys, values, tables, positions, slots, starts, slots[:1], rows, workspace,
                                    gate=flat)
        assert torch.equal(flat_out, out)
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    alone = decode_attention(q[1:2], keys, values, tables, positions[1:2], slots[:1], one, slots[:1], 1, workspace,
                             gate=gate[1:2])
    assert_same_row(alone[0], out[1])


@devices_and_dtypes()
@pytest.mark.parametrize("splits", [0, 2])
def test_router_shared_gate_adds_the_shared_expert_as_route_k(device, dtype, splits, monkeypatch):
    from kernels.fused import router as router_module

    g = torch.Generator().manual_seed(35 + splits)
    num_experts, top_k, rows = 12, 8, 5
    if splits:
        logits = torch.randn(rows, splits, num_experts + 1, generator=g).to(device)
        summed = logits.sum(dim=1).to(dtype)
        kwargs = dict(round_to=dtype)
    else:
        logits = summed = (3 * torch.randn(rows, num_experts + 1, generator=g)).to(device, dtype)
        kwargs = {}
    live = torch.tensor([1, 0, 1, 1, 1], device=device)
    ids, weights = route(logits, top_k, normalize=True, shared_gate=True, live=live, **kwargs)
    assert ids.shape == weights.shape == (rows, top_k + 1) and weights.dtype == torch.float32
    # the routed experts: exactly what the first E columns route to without the gate
    routed_ids, routed_weights = route(logits[..., :num_experts].contiguous(), top_k, normalize=True, live=live,
                                       **kwargs)
    assert torch.equal(ids[:, :top_k], routed_ids)
    assert torch.equal(weights[:, :top_k], routed_weights)
    # route k: expert E (-1 on the padding row), weight sigmoid of the model-dtype gate logit, float32
    assert ids[:, top_k].tolist() == [num_experts, -1, num_experts, num_experts, num_experts]
    torch.testing.assert_close(weights[:, top_k], torch.sigmoid(summed[:, -1].float()), rtol=2e-6, atol=1e-7)
    # the reference branch (the CPU path)
    monkeypatch.setattr(router_module, "use_triton", lambda x: False)
    ref_ids, ref_weights = route(logits, top_k, normalize=True, shared_gate=True, live=live, **kwargs)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    alone_ids, alone_weights = route(logits[3:4], top_k, normalize=True, shared_gate=True, **kwargs)
    assert torch.equal(alone_ids[0], ids[3])
    assert_same_row(alone_weights[0], weights[3])


@devices_and_dtypes()
def test_shared_expert_runs_as_route_k_plus_one_through_experts_and_combine(device, dtype):
    # k + 1 = 9 routes a row (TOP_K 9, K_PAD 16): route, experts (the shared one as expert E of the
    # [E + 1] tensors) and combine + centred norm against their references and SharedMoe itself.
    moe, router_weight, gate_up, down = next_modules(dtype, device)
    num_experts, top_k = moe.experts.gate_up_proj.shape[0], moe.top_k
    g = torch.Generator().manual_seed(36)
    x = torch.randn(3, 64, generator=g).to(device, dtype)
    residual = torch.randn(3, 64, generator=g).to(device, dtype)
    norm = (0.2 * torch.randn(64, generator=g)).to(device, dtype)

    logits = F.linear(x, router_weight)  # [T, E + 1] (once: cuBLAS is no row-invariant GEMV)

    def step(rows):
        ids, weights = route(logits[rows], top_k, normalize=True, shared_gate=True)
        route_out = fused_experts(x[rows], ids, gate_up, down)
        return ids, weights, route_out, combine_add_rmsnorm(route_out, weights, residual[rows], norm, 1e-6,
                                                            centred=True)

    ids, weights, route_out, (normed, new_residual) = step(slice(0, 3))
    assert ids.shape == (3, top_k + 1) and (ids[:, top_k] == num_experts).all()
    assert rel_err(route_out, experts_reference(x, ids, gate_up, down)) < tolerance(dtype)
    ref_normed, ref_residual = combine_reference(route_out, weights, residual, norm, 1e-6, centred=True)
    assert rel_err(normed, ref_normed) < tolerance(dtype)
    assert rel_err(new_residual, ref_residual) < tolerance(dtype)
    with torch.no_grad():  # the family's module: routed experts + sigmoid(gate) * shared expert
        module_residual = residual + moe(x)
        module_normed = centred_norm_module(norm, 1e-6)(module_residual)
    assert rel_err(new_residual, module_residual) < 2 * tolerance(dtype)
    assert rel_err(normed, module_normed) < 2 * tolerance(dtype)
    alone_ids, _, alone_out, (alone_normed, alone_residual) = step(slice(1, 2))
    assert torch.equal(alone_ids[0], ids[1])
    assert_same_row(alone_out, route_out[top_k + 1 : 2 * (top_k + 1)])
    assert_same_row(alone_normed[0], normed[1])
    assert_same_row(alone_residual[0], new_residual[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_family_references_match_the_family_modules(dtype, monkeypatch):
    """The references (the CPU path) compute what shared.model.families.hybrid.modules compute, bit for
    bit: CenteredRMSNorm, GatedAttention's norms + partial rotary and output gate, SharedMoe's routing."""
    from kernels.fused import router as router_module

    g = torch.Generator().manual_seed(37)
    eps, num_heads, num_kv, head_dim, width = 1e-6, 4, 2, 16, 8
    x, r = (torch.randn(4, 64, generator=g).to(dtype) for _ in range(2))
    w = (0.3 * torch.randn(64, generator=g)).to(dtype)
    normed, residual = add_rmsnorm_reference(x, r, w, eps, centred=True)
    assert torch.equal(normed, centred_norm_module(w, eps)(r + x))
    route_out, route_w = torch.randn(12, 64, generator=g), torch.rand(4, 3, generator=g)
    mixed = (route_out.view(4, 3, -1) * route_w.unsqueeze(-1)).sum(dim=1).to(dtype)
    assert torch.equal(combine_reference(route_out, route_w, r, w, eps, centred=True)[0],
                       centred_norm_module(w, eps)(r + mixed))
    # GatedAttention: q, gate = q_proj(x).view(T, H, 2D).chunk(2); centred norms; rotary on the first `width` dims
    qkv, q_stride, _ = family_qkv(3, num_heads, num_kv, head_dim, "interleaved", g, dtype=dtype)
    gate = qkv[:, : 2 * num_heads * head_dim].view(3, num_heads, 2 * head_dim).chunk(2, dim=-1)[1]
    q_norm, k_norm = ((0.2 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2))
    rotary, positions = Rotary(width, 10000.0, 64), torch.tensor([5, 6, 7])
    q, k, v = qk_norm_rope_reference(qkv, q_norm, k_norm, rotary.cos, rotary.sin, positions, num_heads, num_kv, eps,
                                     centred=True, rotary_dim=width, q_head_stride=q_stride)
    module_q = centred_norm_module(q_norm, eps)(qkv[:, : 2 * num_heads * head_dim].view(3, num_heads, 2 * head_dim)
                                                 .chunk(2, dim=-1)[0])
    module_k = centred_norm_module(k_norm, eps)(qkv[:, 2 * num_heads * head_dim :][:, : num_kv * head_dim]
                                                 .view(3, num_kv, head_dim))
    assert torch.equal(q, torch.cat([rotary(module_q[..., :width], positions), module_q[..., width:]], dim=-1))
    assert torch.equal(k, torch.cat([rotary(module_k[..., :width], positions), module_k[..., width:]], dim=-1))
    assert torch.equal(v, qkv[:, (2 * num_heads + num_kv) * head_dim :].view(3, num_kv, head_dim))
    # the output gate: out * sigmoid(gate) on the [T, Hq * D] rows, in the dtype
    cache = torch.randn(1, 16, num_kv, head_dim, generator=g).to(dtype)
    tables, slots = identity_tables(1, "cpu"), torch.zeros(3, dtype=torch.long)
    attn = attention_reference(q, cache, cache, tables, positions, slots)
    gated = attention_reference(q, cache, cache, tables, positions, slots, gate=gate)
    assert torch.equal(gated.reshape(3, -1), attn.reshape(3, -1) * torch.sigmoid(gate.reshape(3, -1)))
    # SharedMoe's routing: softmax top-k over the E experts (renormalised), sigmoid of the gate logit
    moe, router_weight, _, _ = next_modules(dtype)
    hidden = torch.randn(5, 64, generator=g).to(dtype)
    monkeypatch.setattr(router_module, "use_triton", lambda x: False)
    logits = F.linear(hidden, router_weight)  # [T, E + 1]
    ids, weights = route(logits, moe.top_k, normalize=True, shared_gate=True)
    module_weights, module_ids = torch.topk(torch.softmax(logits[:, :-1], dim=-1, dtype=torch.float32), moe.top_k)
    # (the same experts; torch.topk orders tied logits, frequent in bf16, its own way, route by lowest id)
    assert torch.equal(ids[:, : moe.top_k].sort(dim=1)[0], module_ids.sort(dim=1)[0])
    torch.testing.assert_close(weights[:, : moe.top_k], module_weights / module_weights.sum(-1, keepdim=True))
    assert (ids[:, moe.top_k] == moe.experts.gate_up_proj.shape[0]).all()
    assert torch.equal(weights[:, moe.top_k], torch.sigmoid(logits[:, -1].float()))
    # (the module's gate logit is its own GEMV, and its sigmoid is rounded to the dtype: ours is float32)
    module_gate = torch.sigmoid(moe.shared_expert_gate(hidden))[:, 0]
    torch.testing.assert_close(weights[:, moe.top_k], module_gate.float(), rtol=tolerance(dtype), atol=1e-6)


@devices_and_dtypes()
def test_family_options_are_off_by_default(device, dtype):
    """Off (the defaults) is qwen3_moe's path: the plain norm, full rotary, no gate, k routes."""
    from shared.model.layers import RMSNorm

    g = torch.Generator().manual_seed(38)
    x, r = (torch.randn(3, 96, generator=g).to(device, dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(device, dtype)
    assert all(torch.equal(a, b) for a, b in zip(add_rmsnorm(x, r, w, 1e-6), add_rmsnorm(x, r, w, 1e-6, centred=False)))
    plain = RMSNorm(96, 1e-6).to(device, dtype)
    with torch.no_grad():
        plain.weight.copy_(w)
    assert torch.equal(add_rmsnorm_reference(x, r, w, 1e-6)[0], plain(r + x))
    route_out, route_w = torch.randn(9, 96, generator=g).to(device), torch.rand(3, 3, generator=g).to(device)
    assert all(torch.equal(a, b) for a, b in zip(combine_add_rmsnorm(route_out, route_w, r, w, 1e-6),
                                                 combine_add_rmsnorm(route_out, route_w, r, w, 1e-6, centred=False)))
    num_heads, num_kv, head_dim = 4, 2, 16
    qkv = torch.randn(3, (num_heads + 2 * num_kv) * head_dim, generator=g).to(device, dtype)
    q_norm, k_norm = ((1 + 0.2 * torch.randn(head_dim, generator=g)).to(device, dtype) for _ in range(2))
    rotary = Rotary(head_dim, 10000.0, 64).to(device)
    positions, slots = torch.tensor([3, 4, 5], device=device), torch.tensor([0, 0, 0], device=device)
    runs = []
    for options in ({}, dict(centred=False, rotary_dim=None, q_head_stride=None), dict(rotary_dim=head_dim)):
        keys = torch.zeros(1, 8, num_kv, head_dim, dtype=dtype, device=device)
        values = torch.zeros_like(keys)
        runs.append((qk_norm_rope_store(qkv, q_norm, k_norm, rotary.cos, rotary.sin, positions, slots, keys, values,
                                        identity_tables(1, device), num_heads, num_kv, 1e-6, **options), keys, values))
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    ref_q, _, _ = qk_norm_rope_reference(qkv, q_norm, k_norm, rotary.cos, rotary.sin, positions, num_heads, num_kv,
                                         1e-6)
    q_heads = qkv[:, : num_heads * head_dim].view(3, num_heads, head_dim)
    assert torch.equal(ref_q, rotary(add_rmsnorm_reference(q_heads, None, q_norm, 1e-6)[0], positions))
    keys = runs[0][1]
    workspace = AttentionWorkspace(4, num_heads, head_dim, 8, device)
    starts = torch.tensor([0, 3], dtype=torch.int32, device=device)
    attend = [decode_attention(runs[0][0], keys, runs[0][2], identity_tables(1, device), positions, slots, starts,
                               slots[:1], 3, workspace, **options) for options in ({}, dict(gate=None))]
    assert torch.equal(*attend)
    logits = torch.randn(3, 16, generator=g).to(device, dtype)
    for a, b in zip(route(logits, 4, normalize=True), route(logits, 4, normalize=True, shared_gate=False)):
        assert torch.equal(a, b) and a.shape == (3, 4)


@devices_and_dtypes()
def test_family_options_read_before_the_wait_give_the_same_bits(device, dtype, monkeypatch):
    # As test_per_row_kernels_reading_before_the_wait_give_the_same_bits, with the family's options
    # (the merge reads the output gate, a kernel's further back, before its wait).
    import kernels.fused as fused_package

    g = torch.Generator().manual_seed(39)
    x, r = (torch.randn(3, 96, generator=g).to(device, dtype) for _ in range(2))
    partials = torch.randn(3, 2, 96, generator=g).to(device)
    w = (0.3 * torch.randn(96, generator=g)).to(device, dtype)
    route_out, route_w = torch.randn(3 * 9, 96, generator=g).to(device), torch.rand(3, 9, generator=g).to(device)
    num_heads, num_kv, head_dim = 4, 2, 32
    qkv, q_stride, gate = family_qkv(3, num_heads, num_kv, head_dim, "interleaved", g, device, dtype)
    q_norm, k_norm = ((0.2 * torch.randn(head_dim, generator=g)).to(device, dtype) for _ in range(2))
    rotary = Rotary(8, 10000.0, 64).to(device)
    positions, slots = torch.tensor([9, 10, 11], device=device), torch.tensor([1, 1, 1], device=device)
    starts = torch.tensor([0, 3], dtype=torch.int32, device=device)

    def run():
        keys, tables = page(torch.zeros(2, 16, num_kv, head_dim, dtype=dtype, device=device), 4,
                            torch.Generator().manual_seed(2))
        values = torch.zeros_like(keys)
        q = qk_norm_rope_store(qkv, q_norm, k_norm, rotary.cos, rotary.sin, positions, slots, keys, values, tables,
                               num_heads, num_kv, 1e-6, centred=True, rotary_dim=8, q_head_stride=q_stride)
        workspace = AttentionWorkspace(4, num_heads, head_dim, 16, device)
        attn = decode_attention(q, keys, values, tables, positions, slots, starts, slots[:1], 3, workspace, gate=gate)
        return (*add_rmsnorm(x, r, w, 1e-6, centred=True), *add_rmsnorm(partials, r, w, 1e-6, centred=True),
                *combine_add_rmsnorm(route_out, route_w, r, w, 1e-6, centred=True), q, keys, values, attn)

    monkeypatch.setattr(fused_package, "EARLY_READS", False)
    late = run()
    monkeypatch.setattr(fused_package, "EARLY_READS", True)
    early = run()
    for a, b in zip(late, early):
        assert torch.equal(a, b)
