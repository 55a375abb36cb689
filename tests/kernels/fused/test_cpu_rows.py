"""What the CPU runs whole batches through (DESIGN §11) — the torch references and the native
kernels that replace them in the step: a row's bits are its one-row step's, whatever other rows
share the call and wherever the row sits in it."""

import math

import pytest
import torch

from kernels.fused import cpu_rows
from kernels.fused import linear as linear_module
from kernels.fused.attention import attention_reference
from kernels.fused.linear import rowwise_linear, torch_rowwise_linear
from kernels.fused.moe import experts_reference


@pytest.mark.parametrize("product", [rowwise_linear, torch_rowwise_linear], ids=["native", "torch"])
@pytest.mark.parametrize("num_out", [70, linear_module.WIDE_OUTPUTS, linear_module.WIDE_OUTPUTS + 30])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 8, 9])
def test_rowwise_linear_rows_are_their_one_row_bits(product, num_out, num_rows):
    g = torch.Generator().manual_seed(num_out * 10 + num_rows)
    x = torch.randn(num_rows, 203, generator=g)  # (203: a sum with a tail past the native kernel's eight lanes)
    w = torch.randn(num_out, 203, generator=g)
    out = product(x, w)
    assert out.shape == (num_rows, num_out)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, rtol=1e-4, atol=1e-4)
    for i in range(num_rows):
        assert torch.equal(product(x[i : i + 1], w)[0], out[i]), f"row {i} of {num_rows}"
    # the same row among other rows, at another place (a tile's other row differs)
    shuffled = torch.cat([torch.randn(1, 203, generator=g), x.flip(0)])
    assert torch.equal(product(shuffled, w)[1:].flip(0), out)


def test_rowwise_linear_takes_the_native_kernel_with_strided_rows_and_in_bfloat16():
    g = torch.Generator().manual_seed(11)
    wide_x, wide_w = torch.randn(5, 96, generator=g), torch.randn(40, 96, generator=g)
    x, w = wide_x[:, 32:64], wide_w[:, 32:64]  # a K range, as linear_partials' splits take it
    assert torch.equal(rowwise_linear(x, w), cpu_rows.linear(x.contiguous(), w.contiguous()))
    torch.testing.assert_close(rowwise_linear(x, w), torch_rowwise_linear(x, w), rtol=1e-5, atol=1e-5)
    xb, wb = wide_x.bfloat16(), wide_w.bfloat16()
    out = rowwise_linear(xb, wb)
    assert out.dtype == torch.bfloat16
    for i in range(5):
        assert torch.equal(rowwise_linear(xb[i : i + 1], wb)[0], out[i])
    # one rounding to bf16 of a float32 sum: at most an ulp from torch's
    torch.testing.assert_close(out.float(), torch_rowwise_linear(xb, wb).float(), rtol=1e-2, atol=1e-2)
    assert cpu_rows.linear(x.double(), w.double()) is None  # (not a dtype it reads: torch's way)


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


# --- the native kernels (kernels/fused/_cpu_rows.c) the CPU step runs instead of the references


def test_the_native_kernels_are_built():
    # scripts/test installs the package (pip install -e .), which compiles them; without them
    # the CPU step would silently take the (slower) references and the tests below compare nothing.
    assert cpu_rows.available()


def paged_cache(g, dtype, *, num_slots=3, blocks_per_slot=6, block_size=16, num_kv=2, head_dim=16):
    tables = contiguous_tables(num_slots, blocks_per_slot)[:, torch.randperm(blocks_per_slot, generator=g)]
    keys = torch.randn(num_slots * blocks_per_slot, block_size, num_kv, head_dim, generator=g).to(dtype)
    values = torch.randn(num_slots * blocks_per_slot, block_size, num_kv, head_dim, generator=g).to(dtype)
    return keys, values, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 20])  # 20: a sum with a tail past the eight lanes
def test_native_attention_rows_are_their_one_row_bits_and_the_reference(dtype, head_dim):
    g = torch.Generator().manual_seed(5)
    keys, values, tables = paged_cache(g, dtype, head_dim=head_dim)
    positions = torch.tensor([0, 15, 16, 40, 41, 42, 95])  # block edges, a window's consecutive rows
    slots = torch.tensor([1, 0, 2, 2, 2, 2, 0])
    q = torch.randn(len(positions), 8, head_dim, generator=g).to(dtype)
    out = cpu_rows.attention(q, keys, values, tables, positions, slots)
    assert out.dtype == dtype and out.shape == q.shape
    reference = attention_reference(q, keys, values, tables, positions, slots)
    atol = 1e-5 if dtype == torch.float32 else 2e-2  # (bf16: one rounding of the output apart at most)
    torch.testing.assert_close(out.float(), reference.float(), rtol=atol, atol=atol)
    for i in range(len(positions)):
        alone = cpu_rows.attention(q[i : i + 1], keys, values, tables, positions[i : i + 1], slots[i : i + 1])
        assert torch.equal(alone[0], out[i]), f"row {i}"
    # the rows in another order, among a stranger: the same bits
    order = torch.randperm(len(positions), generator=g)
    mixed = cpu_rows.attention(torch.cat([q[order], q[:1]]), keys, values, tables,
                               torch.cat([positions[order], torch.tensor([90])]),
                               torch.cat([slots[order], torch.tensor([1])]))
    assert torch.equal(mixed[:-1], out[order])


def test_decode_attention_on_the_cpu_takes_the_native_kernel_and_applies_the_gate(monkeypatch):
    from kernels.fused.attention import decode_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as a service runs: no interpreter
    g = torch.Generator().manual_seed(6)
    keys, values, tables = paged_cache(g, torch.float32)
    positions, slots = torch.tensor([3, 50, 51]), torch.tensor([0, 2, 2])
    q = torch.randn(3, 8, 16, generator=g)
    gate = torch.randn(3, 8 * 16, generator=g)
    seq_starts, seq_slots = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([0, 2])
    out = decode_attention(q, keys, values, tables, positions, slots, seq_starts, seq_slots, 2, None, gate=gate)
    native = cpu_rows.attention(q, keys, values, tables, positions, slots)
    assert torch.equal(out, (native.view(3, -1) * torch.sigmoid(gate)).view(3, 8, 16))
    reference = attention_reference(q, keys, values, tables, positions, slots, gate)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_native_attention_refuses_what_it_does_not_read_and_positions_outside_the_tables():
    g = torch.Generator().manual_seed(7)
    keys, values, tables = paged_cache(g, torch.float32)
    q = torch.randn(1, 8, 16, generator=g)
    # another dtype, a non-contiguous cache: not applicable (the caller takes the reference)
    assert cpu_rows.attention(q.double(), keys.double(), values.double(), tables, torch.tensor([3]), torch.tensor([0])) is None
    strided = keys.transpose(2, 3).contiguous().transpose(2, 3)
    assert cpu_rows.attention(q, strided, values, tables, torch.tensor([3]), torch.tensor([0])) is None
    with pytest.raises(ValueError, match="outside the block tables"):
        cpu_rows.attention(q, keys, values, tables, torch.tensor([6 * 16]), torch.tensor([0]))
    with pytest.raises(ValueError, match="outside the block tables"):
        cpu_rows.attention(q, keys, values, tables, torch.tensor([3]), torch.tensor([3]))


def expert_weights(g, dtype, num_experts=6, hidden=40, inter=24):  # sizes with a tail past the eight lanes
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_experts_routes_are_their_one_row_bits_and_the_reference(dtype):
    g = torch.Generator().manual_seed(8)
    gate_up, down = expert_weights(g, dtype)
    x = torch.randn(7, 40, generator=g).to(dtype)
    ids = torch.tensor([[0, 3], [3, 0], [5, -1], [3, 1], [2, 4], [0, 5], [1, 1]])  # shared experts, a dropped route
    out = cpu_rows.experts(x, ids, gate_up, down)
    assert out.dtype == torch.float32 and out.shape == (14, 40)
    assert torch.equal(out[5], torch.zeros(40))  # route (2, rank 1) dropped
    reference = experts_reference(x, ids, gate_up, down)
    # bf16: both round the products and the activation to bf16; a rounding apart flips a bf16 ulp
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, reference, rtol=atol, atol=atol)
    for t in range(len(ids)):
        alone = cpu_rows.experts(x[t : t + 1], ids[t : t + 1], gate_up, down)
        assert torch.equal(alone, out[2 * t : 2 * t + 2]), f"token {t}"


def test_native_experts_leave_fp8_weights_to_the_reference_and_refuse_unknown_experts():
    from kernels.fused.fp8 import quantize

    g = torch.Generator().manual_seed(9)
    gate_up, down = expert_weights(g, torch.float32, hidden=128, inter=128)
    x = torch.randn(2, 128, generator=g)
    ids = torch.tensor([[0, 1], [2, 3]])
    assert cpu_rows.experts(x, ids, quantize(gate_up, (128, 128)), quantize(down, (128, 128))) is None
    with pytest.raises(ValueError, match="expert id"):
        cpu_rows.experts(x, torch.tensor([[0, 6]]), gate_up, down)


def test_fused_experts_on_the_cpu_takes_the_native_kernel(monkeypatch):
    from kernels.fused.moe import fused_experts

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(10)
    gate_up, down = expert_weights(g, torch.float32)
    x = torch.randn(3, 40, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [4, 0]])
    assert torch.equal(fused_experts(x, ids, gate_up, down), cpu_rows.experts(x, ids, gate_up, down))


def test_native_partials_are_linear_partials_torch_way_and_row_invariant():
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(6, 100, generator=g), torch.randn(24, 100, generator=g)
    for splits, step in [(1, 100), (2, 50), (4, 32), (3, 64)]:  # (4, 32): a short last split; (3, 64): an empty one
        out = cpu_rows.partials(x, w, splits, step)
        assert out.shape == (6, splits, 24) and out.dtype == torch.float32
        expected = torch.stack([torch_rowwise_linear(x[:, s * step : (s + 1) * step], w[:, s * step : (s + 1) * step])
                                for s in range(splits)], dim=1)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for i in range(6):
            assert torch.equal(cpu_rows.partials(x[i : i + 1], w, splits, step)[0], out[i])
    xb, wb = x.bfloat16(), w.bfloat16()  # (bf16 inputs, float32 sums: the reference's .float() products)
    torch.testing.assert_close(cpu_rows.partials(xb, wb, 2, 50),
                               torch.stack([xb[:, :50].float() @ wb[:, :50].float().T,
                                            xb[:, 50:].float() @ wb[:, 50:].float().T], dim=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("centred", [False, True])
def test_native_add_rmsnorm_in_its_three_kinds_is_the_references_and_row_invariant(dtype, centred):
    from kernels.fused.moe import combine_reference
    from kernels.fused.norm import add_rmsnorm_reference

    g = torch.Generator().manual_seed(13)
    rows, hidden, k = 5, 44, 3
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + torch.randn(hidden, generator=g) / 4).to(dtype)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    partials = torch.randn(rows, 3, hidden, generator=g)
    routes, route_weights = torch.randn(rows * k, hidden, generator=g), torch.rand(rows, k, generator=g)
    summed = (partials[:, 0] + partials[:, 1] + partials[:, 2]).to(dtype)
    cases = {  # kind: (native arguments, the reference's (normed, new residual))
        "plain": ((x, residual), add_rmsnorm_reference(x, residual, weight, 1e-6, centred)),
        "no residual": ((x, None), add_rmsnorm_reference(x, None, weight, 1e-6, centred)),
        "partials": ((partials, residual), add_rmsnorm_reference(summed, residual, weight, 1e-6, centred)),
        "routes": ((routes, residual), combine_reference(routes, route_weights, residual, weight, 1e-6, centred)),
    }
    # bf16: our sum of squares and the reference's round differently: a bf16 ulp at most
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    for kind, ((a, r), (want_normed, want_residual)) in cases.items():
        extra = {"route_weights": route_weights} if kind == "routes" else {}
        normed, new_residual = cpu_rows.add_rmsnorm(a, r, weight, 1e-6, centred, **extra)
        assert normed.dtype == dtype and new_residual.dtype == dtype, kind
        torch.testing.assert_close(normed.float(), want_normed.float(), rtol=tol, atol=tol, msg=kind)
        torch.testing.assert_close(new_residual.float(), want_residual.float(), rtol=tol, atol=tol, msg=kind)
        if r is None:
            assert new_residual is a
        for i in range(rows):
            one = (a[i * k : i * k + k] if kind == "routes" else a[i : i + 1]), (None if r is None else r[i : i + 1])
            extra_one = {"route_weights": route_weights[i : i + 1]} if kind == "routes" else {}
            alone = cpu_rows.add_rmsnorm(*one, weight, 1e-6, centred, **extra_one)
            assert torch.equal(alone[0][0], normed[i]) and torch.equal(alone[1][0], new_residual[i]), (kind, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["qwen3", "hybrid"])  # hybrid: centred norms, a partial rotary width, q/gate interleaved
def test_native_qk_norm_rope_store_is_the_reference_and_row_invariant(dtype, layout):
    from kernels.fused.norm import qk_norm_rope_reference

    g = torch.Generator().manual_seed(14)
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 8
    centred, rot, q_stride = (True, 8, 2 * head_dim) if layout == "hybrid" else (False, head_dim, head_dim)
    width = heads * q_stride + 2 * kv_heads * head_dim
    rows = 6
    qkv = torch.randn(rows, width + 5, generator=g).to(dtype)[:, :width]  # (a row stride wider than the row)
    q_norm, k_norm = (1 + torch.randn(head_dim, generator=g) / 4).to(dtype), (1 + torch.randn(head_dim, generator=g) / 4).to(dtype)
    angles = torch.arange(64).float()[:, None] / (10 ** (torch.arange(rot // 2).float() / rot))
    cos, sin = torch.cat([angles.cos()] * 2, dim=1), torch.cat([angles.sin()] * 2, dim=1)  # [64, rot]
    positions, slots = torch.tensor([0, 7, 8, 30, 31, 63]), torch.tensor([1, 0, 0, 2, 2, 1])
    tables = contiguous_tables(3, 8)[:, torch.randperm(8, generator=g)]
    keys, values = torch.zeros(24, block_size, kv_heads, head_dim, dtype=dtype), torch.zeros(24, block_size, kv_heads, head_dim, dtype=dtype)
    q = cpu_rows.qk_norm_rope_store(qkv, q_norm, k_norm, cos, sin, positions, slots, keys, values, tables, heads,
                                    kv_heads, 1e-6, centred, rot, q_stride)
    want_q, want_k, want_v = qk_norm_rope_reference(qkv, q_norm, k_norm, cos, sin, positions, heads, kv_heads, 1e-6,
                                                    centred, rot, q_stride)
    blocks, offsets = tables[slots, positions // block_size].long(), positions % block_size
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(keys[blocks, offsets].float(), want_k.float(), rtol=tol, atol=tol)
    assert torch.equal(values[blocks, offsets], want_v)  # v is copied as it is
    for i in range(rows):
        k_alone, v_alone = torch.zeros_like(keys), torch.zeros_like(values)
        q_alone = cpu_rows.qk_norm_rope_store(qkv[i : i + 1], q_norm, k_norm, cos, sin, positions[i : i + 1],
                                              slots[i : i + 1], k_alone, v_alone, tables, heads, kv_heads, 1e-6,
                                              centred, rot, q_stride)
        assert torch.equal(q_alone[0], q[i]) and torch.equal(k_alone[blocks[i], offsets[i]], keys[blocks[i], offsets[i]])
    with pytest.raises(ValueError, match="outside"):
        cpu_rows.qk_norm_rope_store(qkv[:1], q_norm, k_norm, cos, sin, torch.tensor([64]), slots[:1], keys, values,
                                    tables, heads, kv_heads, 1e-6, centred, rot, q_stride)


def torch_route(router_logits, top_k, round_to, normalize, live):
    """kernels.fused.router.route's torch way (the reference path it takes where the native
    kernel does not apply)."""
    from kernels.routing import route_topk

    if router_logits.dim() == 3:
        summed = router_logits[:, 0]
        for s in range(1, router_logits.shape[1]):
            summed = summed + router_logits[:, s]
        router_logits = summed.to(round_to)
    ids, weights = route_topk(router_logits, top_k, normalize=normalize)
    if live is not None:
        ids = torch.where(live.unsqueeze(1) != 0, ids, -1)
    return ids, weights


@pytest.mark.parametrize("round_to", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [0, 1, 3])  # 0: logits [T, E] in round_to, not partials
@pytest.mark.parametrize("normalize", [True, False])
def test_native_route_is_the_references_top_k_and_row_invariant(round_to, splits, normalize):
    """300 rows of random router logits, 16 experts, top 1 to 4: the same experts in the same rank
    order as the torch way, the weights within 1e-6 (the kernel's own softmax), padding rows'
    ids -1; each row alone gives its bits in the batch."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(300, max(splits, 1), 16, generator=g) * 3  # [T, S, E]
    router_logits = logits if splits else logits[:, 0].to(round_to)
    live = (torch.rand(300, generator=g) > 0.1).to(torch.int32)
    for top_k in (1, 2, 4):
        ids, weights = cpu_rows.route(router_logits, top_k, round_to, normalize, live)
        expected_ids, expected_weights = torch_route(router_logits, top_k, round_to, normalize, live)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-6)
        for i in (0, 7, 299):
            alone_ids, alone_weights = cpu_rows.route(router_logits[i : i + 1], top_k, round_to, normalize, live[i : i + 1])
            assert torch.equal(alone_ids[0], ids[i]) and torch.equal(alone_weights[0], weights[i])


def test_native_route_ties_go_to_the_lower_id_and_route_takes_it(monkeypatch):
    """Equal logits: the lower expert id ranks first (the reference's rule); kernels.fused.router.
    route takes the kernel on the CPU for a plain top-k and leaves MoCE routing to torch."""
    from kernels.fused.router import route

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    ids, weights = cpu_rows.route(logits, 3, None, True, None)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3), rtol=1e-6, atol=1e-6)
    calls = []
    native = cpu_rows.route
    monkeypatch.setattr(cpu_rows, "route", lambda *a: calls.append(1) or native(*a))
    assert torch.equal(route(logits, 3, normalize=True)[0], ids) and calls == [1]
    assert cpu_rows.route(logits, 0, None, True, None) is None and cpu_rows.route(logits, 6, None, True, None) is None
