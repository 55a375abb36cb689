"""kernels.moe dispatch/combine against a dense per-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import Dispatch, combine, dispatch, moe_forward, swiglu_expert
from kernels.routing import route_prompt_topk, route_topk

NUM_EXPERTS = 12
HIDDEN = 16
INTER = 24


def make_experts(seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    up = torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return gate.to(dtype), up.to(dtype), down.to(dtype)


def dense_reference(hidden, expert_ids, weights, gate, up, down):
    """Loop over tokens and routes in float64, skipping id -1."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for rank in range(expert_ids.shape[1]):
            e = int(expert_ids[t, rank])
            if e == -1:
                continue
            h = F.silu(gate[e].double() @ x) * (up[e].double() @ x)
            out[t] += float(weights[t, rank]) * (down[e].double() @ h)
    return out


def make_routes(seed: int = 1, num_tokens: int = 9, k: int = 4):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    expert_ids, weights = route_topk(logits, k)
    expert_ids = expert_ids.clone()
    expert_ids[0, 2] = -1  # a dropped route mixed in
    expert_ids[3, 1:] = -1
    expert_ids[5, :] = -1  # a token with no route at all
    weights = weights.masked_fill(expert_ids == -1, 0.0)
    return hidden, expert_ids, weights


class Recorder:
    """A run_expert that records its calls and checks it never sees a bad id."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, torch.Tensor]] = []

    def __call__(self, expert_id: int, rows: torch.Tensor) -> torch.Tensor:
        assert isinstance(expert_id, int) and 0 <= expert_id < NUM_EXPERTS
        self.calls.append((expert_id, rows.clone()))
        return self.inner(expert_id, rows)


def test_moe_forward_matches_dense_reference_with_dropped_routes():
    hidden, expert_ids, weights = make_routes()
    gate, up, down = make_experts()
    run = Recorder(swiglu_expert(gate, up, down))
    out = moe_forward(hidden, expert_ids, weights, run, num_experts=NUM_EXPERTS)
    want = dense_reference(hidden, expert_ids, weights, gate, up, down)
    assert out.shape == hidden.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    assert bool((out[5] == 0).all())  # all routes -1 → zeros
    # Each distinct selected expert runs exactly once, on exactly its tokens.
    called = [e for e, _ in run.calls]
    distinct = sorted(set(expert_ids[expert_ids >= 0].tolist()))
    assert sorted(called) == distinct and len(called) == len(distinct)
    for e, rows in run.calls:
        tokens = [t for t in range(hidden.shape[0]) if e in expert_ids[t].tolist()]
        torch.testing.assert_close(rows, hidden[tokens], rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(5))
def test_moe_forward_random_routes_with_residency(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    num_tokens, k = 20, 5
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    resident = torch.rand(NUM_EXPERTS, generator=gen) < 0.4
    expert_ids, weights = route_prompt_topk(logits, k, resident=resident, packed=-0.15)  # dropout: some -1
    gate, up, down = make_experts(seed)
    run = Recorder(swiglu_expert(gate, up, down))
    out = moe_forward(hidden, expert_ids, weights, run, num_experts=NUM_EXPERTS, resident=resident)
    want = dense_reference(hidden, expert_ids, weights, gate, up, down)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    plan = dispatch(expert_ids, num_experts=NUM_EXPERTS, resident=resident)
    assert [e for e, _ in run.calls] == plan.expert_ids.tolist()  # called in dispatch order


def test_dispatch_groups_resident_experts_first_then_by_id():
    expert_ids = torch.tensor([[5, 1, -1], [3, 5, 0], [-1, -1, -1], [0, 7, 1]])
    resident = torch.zeros(8, dtype=torch.bool)
    resident[[5, 7]] = True
    plan = dispatch(expert_ids, num_experts=8, resident=resident)
    assert isinstance(plan, Dispatch)
    assert plan.expert_ids.tolist() == [5, 7, 0, 1, 3]
    assert plan.offsets.tolist() == [0, 2, 3, 5, 7, 8]
    assert plan.token_index.tolist() == [0, 1, 3, 1, 3, 0, 3, 1]
    assert plan.route_index.tolist() == [0, 4, 10, 5, 9, 1, 11, 3]
    for tensor in (plan.expert_ids, plan.offsets, plan.token_index, plan.route_index):
        assert tensor.dtype == torch.int64
    # Every route points at its own expert and never at a -1 entry.
    flat = expert_ids.reshape(-1)
    for g, e in enumerate(plan.expert_ids.tolist()):
        rows = plan.route_index[plan.offsets[g] : plan.offsets[g + 1]]
        assert bool((flat[rows] == e).all())
    # Without a residency map the groups are ordered by id.
    assert dispatch(expert_ids, num_experts=8).expert_ids.tolist() == [0, 1, 3, 5, 7]


def test_all_routes_dropped_gives_zeros_and_runs_nothing():
    hidden = torch.randn(3, HIDDEN)
    expert_ids = torch.full((3, 2), -1)
    run = Recorder(swiglu_expert(*make_experts()))
    out = moe_forward(hidden, expert_ids, torch.zeros(3, 2), run, num_experts=NUM_EXPERTS)
    assert run.calls == [] and bool((out == 0).all()) and out.shape == hidden.shape
    plan = dispatch(expert_ids, num_experts=NUM_EXPERTS)
    assert plan.num_groups == 0 and plan.offsets.tolist() == [0] and plan.num_routes == 0


def test_combine_accumulates_in_float32_and_returns_output_dtype():
    expert_ids = torch.tensor([[0, 1], [1, -1]])
    plan = dispatch(expert_ids, num_experts=2)
    expert_outputs = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16)  # plan order
    weights = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    out = combine(expert_outputs, plan, weights, num_tokens=2)
    assert out.dtype == torch.bfloat16
    # plan rows: expert 0 ← token 0; expert 1 ← tokens 0, 1
    torch.testing.assert_close(out.float(), torch.tensor([[0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 4], [5.0, 6.0]]))


def test_bf16_path_close_to_fp32():
    hidden, expert_ids, weights = make_routes(seed=7, num_tokens=16)
    fp32 = moe_forward(hidden, expert_ids, weights, swiglu_expert(*make_experts(3)), num_experts=NUM_EXPERTS)
    bf16 = moe_forward(
        hidden.bfloat16(), expert_ids, weights.bfloat16(),
        swiglu_expert(*make_experts(3, torch.bfloat16)), num_experts=NUM_EXPERTS,
    )
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, rtol=5e-2, atol=3e-2)


def test_swiglu_expert_matches_nn_linear_and_accepts_sequences():
    gate, up, down = make_experts(5)
    x = torch.randn(4, HIDDEN)
    e = 3
    lin = {}
    for name, w in (("gate", gate[e]), ("up", up[e]), ("down", down[e])):
        lin[name] = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin[name].weight.data.copy_(w)
    with torch.no_grad():
        want = lin["down"](F.silu(lin["gate"](x)) * lin["up"](x))
    torch.testing.assert_close(swiglu_expert(gate, up, down)(e, x), want)
    torch.testing.assert_close(swiglu_expert(list(gate), list(up), list(down))(e, x), want)
    with pytest.raises(ValueError, match="expert_id"):
        swiglu_expert(gate, up, down)(NUM_EXPERTS, x)
    with pytest.raises(ValueError, match="down_proj"):
        swiglu_expert(gate, up, down[:, :, :-1])
    with pytest.raises(ValueError, match="up_proj"):
        swiglu_expert(gate, up[:-1], down)


@pytest.mark.parametrize("bad", [NUM_EXPERTS, NUM_EXPERTS + 5, -2, -100])
def test_bad_expert_ids_rejected(bad):
    expert_ids = torch.tensor([[0, 1], [2, bad]])
    with pytest.raises(ValueError, match=f"expert_ids contains {bad}"):
        dispatch(expert_ids, num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="expert_ids"):
        moe_forward(torch.zeros(2, HIDDEN), expert_ids, torch.ones(2, 2), swiglu_expert(*make_experts()),
                    num_experts=NUM_EXPERTS)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(expert_ids=torch.zeros(4, dtype=torch.int64)), "expert_ids"),
        (dict(expert_ids=torch.zeros(2, 2)), "expert_ids"),
        (dict(num_experts=0), "num_experts"),
        (dict(resident=torch.ones(3, dtype=torch.bool)), "resident"),
        (dict(resident=torch.ones(NUM_EXPERTS)), "resident"),
    ],
)
def test_dispatch_rejects_bad_arguments(kwargs, match):
    args = dict(expert_ids=torch.zeros(2, 2, dtype=torch.int64), num_experts=NUM_EXPERTS) | kwargs
    with pytest.raises(ValueError, match=match):
        dispatch(args.pop("expert_ids"), **args)


def test_moe_forward_rejects_mismatched_shapes():
    run = swiglu_expert(*make_experts())
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden"):
        moe_forward(torch.zeros(3), ids, torch.ones(3, 2), run, num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="weights"):
        moe_forward(torch.zeros(3, HIDDEN), ids, torch.ones(3, 1), run, num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="run_expert"):
        moe_forward(torch.zeros(3, HIDDEN), ids, torch.ones(3, 2), lambda e, x: x[:1], num_experts=NUM_EXPERTS)
