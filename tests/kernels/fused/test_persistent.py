"""kernels.fused.persistent: a chain of products in one persistent launch computes what today's
kernels compute stage by stage (linear_partials, partials added in split order; route, the
experts and their combine), row-invariantly, whatever the number of programs or the prefetch."""

import pytest
import torch

from kernels.fused.fp8 import quantize
from kernels.fused.linear import dense, linear_config, linear_partials, weight_config
from kernels.fused.moe import fused_experts
from kernels.fused.persistent import ChainPlan, Dense, Experts, experts_stage, stage_partials, sum_partials
from kernels.fused.router import route

from .conftest import assert_same_row, devices_and_dtypes, tolerance

# Stages whose weights all take one tile in linear_config (BLOCK_N 32, BLOCK_K 256), so each stage's
# partials are linear_partials' own; splits 1, 4 and 2 (the consumer adds 1, then 4, then 2 partials).
SHAPES = [(1024, 512), (512, 1024), (1024, 512)]
SPLITS = [1, 4, 2]


def chain_weights(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) / shape[1] ** 0.5).to(device, dtype) for shape in SHAPES]


def dense_chain(weights, splits=SPLITS):
    return [Dense(w, s) for w, s in zip(weights, splits)]


def today(x, weights, splits):
    """Each stage as today's kernels run it: linear_partials, then its consumer's sum in split order."""
    outputs, source = [], x
    for weight, num_splits in zip(weights, splits):
        partials = linear_partials(source, weight, num_splits).transpose(0, 1)  # [splits, rows, N]
        outputs.append(partials)
        source = sum_partials(partials).to(x.dtype)
    return outputs


def test_the_stages_take_one_tile():
    assert len({linear_config(*shape) for shape in SHAPES}) == 1


@devices_and_dtypes()
def test_a_chain_computes_todays_products_stage_by_stage(device, dtype):
    weights = chain_weights(device, dtype)
    x = torch.randn(5, SHAPES[0][1], generator=torch.Generator().manual_seed(1)).to(device, dtype)
    plan = ChainPlan(dense_chain(weights), rows=5, tile=linear_config(*SHAPES[0]))  # linear_partials' own tile
    last = plan.run(x)
    assert last.shape == (2, 5, SHAPES[-1][0]) and last.dtype == torch.float32
    expected = today(x, weights, SPLITS)
    for stage, (got, want) in enumerate(zip(plan.outputs, expected)):
        if device == "cuda":
            assert torch.equal(got, want), f"stage {stage}: max diff {(got - want).abs().max():.3g}"
        else:
            torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-5)
    # and the torch reference, the definition of a stage
    source = x
    for weight, num_splits, got in zip(weights, SPLITS, plan.outputs):
        reference = stage_partials(source, weight, num_splits, plan.tile[1])
        scale = reference.abs().max()
        assert float((got - reference).abs().max() / scale) < tolerance(dtype)
        source = sum_partials(got).to(dtype)


@devices_and_dtypes()
def test_a_row_is_the_same_alone_or_in_a_window(device, dtype):
    weights = chain_weights(device, dtype, seed=2)
    x = torch.randn(5, SHAPES[0][1], generator=torch.Generator().manual_seed(3)).to(device, dtype)
    window = ChainPlan(dense_chain(weights), rows=5).run(x).clone()
    for row in (0, 4):
        alone = ChainPlan(dense_chain(weights), rows=1).run(x[row:row + 1])
        assert_same_row(alone[:, 0], window[:, row])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="many programs and the L2 prefetch need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_programs_and_prefetch_change_no_bit(dtype):
    weights = chain_weights("cuda", dtype, seed=4)
    x = torch.randn(3, SHAPES[0][1], generator=torch.Generator().manual_seed(5)).to("cuda", dtype)
    one = ChainPlan(dense_chain(weights), rows=3, programs=1).run(x).clone()
    for programs in (7, None):
        for prefetch in ("none", "before-barrier", "at-stage-start"):
            plan = ChainPlan(dense_chain(weights), rows=3, programs=programs, prefetch=prefetch)
            assert torch.equal(plan.run(x), one), (programs, prefetch)
            assert int(plan.counter) == plan.table.shape[0] * plan.programs  # every program passed every barrier


def test_plans_name_what_is_wrong():
    weights = chain_weights("cpu", torch.float32)
    router, gate_up, down = torch.randn(8, 1024), torch.randn(8, 64, 1024), torch.randn(8, 1024, 32)
    cases = [
        ([Dense(weights[0]), Dense(weights[0])], "stages\\[1\\]: weight \\(1024, 512\\) does not take the 1024"),
        ([], "starts with a Dense stage"),
        ([Dense(weights[0], 0)], "splits = 0"),
        ([Dense(weights[0].t())], "contiguous"),
        ([Dense(weights[0]), Dense(router), Experts(gate_up, down, 2), Experts(gate_up, down, 2)],
         "stages\\[3\\]: Experts follow the Dense stage that is their router"),
        ([Dense(weights[0]), Experts(gate_up, down, 2)], "is not \\[1024, 2·inter, 512\\]"),
        ([Dense(weights[0]), Dense(router), Experts(gate_up[:, :63].contiguous(), down, 2)], "gate_up \\(8, 63, 1024\\)"),
        ([Dense(weights[0]), Dense(router), Experts(gate_up, down[..., :16].contiguous(), 2)], "down \\(8, 1024, 16\\)"),
        ([Dense(weights[0]), Dense(router), Experts(gate_up, down, 9)], "top_k = 9"),
    ]
    for stages, message in cases:
        with pytest.raises(ValueError, match=message):
            ChainPlan(stages, rows=1)
    with pytest.raises(ValueError, match="rows = 17"):
        ChainPlan(dense_chain(weights), rows=17)
    with pytest.raises(ValueError, match="exactly 1 off CUDA"):
        ChainPlan(dense_chain(weights), rows=1, programs=2)
    with pytest.raises(ValueError, match="prefetch"):
        ChainPlan(dense_chain(weights), rows=1, prefetch="at-stage-start")
    with pytest.raises(ValueError, match="tile"):
        ChainPlan(dense_chain(weights), rows=1, tile=(64, 100, 4, 3))
    plan = ChainPlan(dense_chain(weights), rows=2)
    with pytest.raises(ValueError, match="x: "):
        plan.run(torch.zeros(3, 512))


def test_the_reference_path_runs_where_triton_does_not(monkeypatch):
    """Off the kernels' path (no Triton), a plan computes its stages by the torch reference."""
    import kernels.fused.persistent as persistent

    weights = chain_weights("cpu", torch.float32, seed=6)
    x = torch.randn(2, SHAPES[0][1], generator=torch.Generator().manual_seed(7))
    kernel = ChainPlan(dense_chain(weights), rows=2).run(x).clone()
    monkeypatch.setattr(persistent, "use_triton", lambda _x: False)
    reference = ChainPlan(dense_chain(weights), rows=2).run(x)
    torch.testing.assert_close(kernel, reference, rtol=2e-5, atol=1e-5)


def moe_chain(device, dtype, seed=8, hidden=512, experts=8, inter=64, top_k=3, fp8=False):
    """A layer's MoE block twice over: router (split-K) and experts, then again on their output;
    fp8: the experts' weights block-scaled FP8 (routers stay full precision, as --quantize fp8 leaves them)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(device, dtype)

    def expert_weight(*shape):
        return quantize(w(*shape), (128, 128)) if fp8 else w(*shape)

    stages = []
    for _ in range(2):
        stages += [Dense(w(experts, hidden), 4),
                   Experts(expert_weight(experts, 2 * inter, hidden), expert_weight(experts, hidden, inter), top_k)]
    return stages


@pytest.mark.parametrize("fp8", [False, True], ids=["full", "fp8"])
@devices_and_dtypes()
def test_an_experts_stage_computes_todays_routes_experts_and_combine(device, dtype, fp8):
    stages = moe_chain(device, dtype, fp8=fp8)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    plan = ChainPlan(stages, rows=4)
    plan.run(x)
    source = x
    for index in (0, 2):  # each router and its experts, from the chain's own input to them
        experts = stages[index + 1]
        router_partials = plan.outputs[index]  # [4, rows, E]
        ids, weights = route(router_partials.transpose(0, 1).contiguous(), experts.top_k, round_to=dtype, normalize=True)
        per_route = fused_experts(source, ids, experts.gate_up, experts.down).view(4, experts.top_k, -1)
        combined = torch.zeros(4, 512, dtype=torch.float32, device=device)
        for rank in range(experts.top_k):
            combined += weights[:, rank:rank + 1] * per_route[:, rank]
        got = plan.outputs[index + 1][0]
        assert float((got - combined).abs().max() / combined.abs().max()) < tolerance(dtype)
        reference_acts, reference = experts_stage(source, router_partials, Experts(
            dense(experts.gate_up, dtype), dense(experts.down, dtype), experts.top_k))
        assert float((got - reference).abs().max() / reference.abs().max()) < tolerance(dtype)
        torch.testing.assert_close(plan.acts[index + 1][0], reference_acts, rtol=tolerance(dtype), atol=tolerance(dtype))
        source = got.to(dtype)


@devices_and_dtypes()
def test_an_experts_row_is_the_same_alone_or_in_a_window(device, dtype):
    stages = moe_chain(device, dtype, seed=10)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(11)).to(device, dtype)
    window = ChainPlan(stages, rows=5).run(x).clone()
    for row in (1, 4):
        assert_same_row(ChainPlan(stages, rows=1).run(x[row:row + 1])[:, 0], window[:, row])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="many programs and the L2 prefetch need a CUDA device")
def test_an_experts_chain_changes_no_bit_with_programs_or_prefetch():
    stages = moe_chain("cuda", torch.bfloat16, seed=12)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(13)).to("cuda", torch.bfloat16)
    one = ChainPlan(stages, rows=3, programs=1).run(x).clone()
    for prefetch in ("none", "before-barrier", "at-stage-start"):
        plan = ChainPlan(stages, rows=3, prefetch=prefetch)
        assert torch.equal(plan.run(x), one), prefetch
        assert int(plan.counter) == plan.table.shape[0] * plan.programs


@devices_and_dtypes()
def test_fp8_dense_stages_read_their_weights_as_linear_partials_does(device, dtype):
    weights = [quantize(w, (128, 128)) for w in chain_weights(device, dtype, seed=14)]
    x = torch.randn(3, SHAPES[0][1], generator=torch.Generator().manual_seed(15)).to(device, dtype)
    plan = ChainPlan(dense_chain(weights), rows=3, tile=weight_config(weights[0], dtype))  # linear_partials' tile
    plan.run(x)
    for stage, (got, want) in enumerate(zip(plan.outputs, today(x, weights, SPLITS))):
        if device == "cuda":
            assert torch.equal(got, want), f"stage {stage}: max diff {(got - want).abs().max():.3g}"
        else:
            torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-5)


def test_the_table_fields_are_the_kernels():
    """The host names a stage's fields (persistent.FIELDS) where the kernel reads them (F_*)."""
    import kernels.fused.persistent_kernels as persistent_kernels
    from kernels.fused.persistent import FIELDS

    offsets = {name[2:].lower(): value.value for name, value in vars(persistent_kernels).items()
               if name.startswith("F_")}
    assert offsets == {name: index for index, name in enumerate(FIELDS)}
    assert persistent_kernels.FIELDS.value == len(FIELDS)
