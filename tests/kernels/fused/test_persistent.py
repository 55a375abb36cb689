"""kernels.fused.persistent: a chain of products in one persistent launch computes what today's
kernels compute stage by stage (linear_partials, partials added in split order), row-invariantly,
whatever the number of programs or the prefetch."""

import pytest
import torch

from kernels.fused.linear import linear_config, linear_partials
from kernels.fused.persistent import ChainPlan, stage_partials, sum_partials

from .conftest import assert_same_row, devices_and_dtypes, tolerance

# Stages whose weights all take one tile in linear_config (BLOCK_N 32, BLOCK_K 256), so each stage's
# partials are linear_partials' own; splits 1, 4 and 2 (the consumer adds 1, then 4, then 2 partials).
SHAPES = [(1024, 512), (512, 1024), (1024, 512)]
SPLITS = [1, 4, 2]


def chain_weights(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) / shape[1] ** 0.5).to(device, dtype) for shape in SHAPES]


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
    plan = ChainPlan(weights, SPLITS, rows=5)
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
    window = ChainPlan(weights, SPLITS, rows=5).run(x).clone()
    for row in (0, 4):
        alone = ChainPlan(weights, SPLITS, rows=1).run(x[row:row + 1])
        assert_same_row(alone[:, 0], window[:, row])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="many programs and the L2 prefetch need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_programs_and_prefetch_change_no_bit(dtype):
    weights = chain_weights("cuda", dtype, seed=4)
    x = torch.randn(3, SHAPES[0][1], generator=torch.Generator().manual_seed(5)).to("cuda", dtype)
    one = ChainPlan(weights, SPLITS, rows=3, programs=1).run(x).clone()
    for programs in (7, None):
        for prefetch in ("none", "before-barrier", "at-stage-start"):
            plan = ChainPlan(weights, SPLITS, rows=3, programs=programs, prefetch=prefetch)
            assert torch.equal(plan.run(x), one), (programs, prefetch)
            assert int(plan.counter) == len(SHAPES) * plan.programs  # every program passed every barrier


def test_plans_name_what_is_wrong():
    weights = chain_weights("cpu", torch.float32)
    with pytest.raises(ValueError, match=r"weights\[1\]: takes 512 inputs, stage 0 makes 1024"):
        ChainPlan([weights[0], weights[0]], [1, 1], rows=1)
    with pytest.raises(ValueError, match="as many"):
        ChainPlan(weights, [1], rows=1)
    with pytest.raises(ValueError, match=r"splits\[2\] = 0"):
        ChainPlan(weights, [1, 1, 0], rows=1)
    with pytest.raises(ValueError, match="rows = 17"):
        ChainPlan(weights, SPLITS, rows=17)
    with pytest.raises(ValueError, match="exactly 1 off CUDA"):
        ChainPlan(weights, SPLITS, rows=1, programs=2)
    with pytest.raises(ValueError, match="prefetch"):
        ChainPlan(weights, SPLITS, rows=1, prefetch="at-stage-start")
    with pytest.raises(ValueError, match="contiguous"):
        ChainPlan([weights[0].t()], [1], rows=1)
    plan = ChainPlan(weights, SPLITS, rows=2)
    with pytest.raises(ValueError, match="x: "):
        plan.run(torch.zeros(3, 512))


def test_the_reference_path_runs_where_triton_does_not(monkeypatch):
    """Off the kernels' path (no Triton), a plan computes its stages by the torch reference."""
    import kernels.fused.persistent as persistent

    weights = chain_weights("cpu", torch.float32, seed=6)
    x = torch.randn(2, SHAPES[0][1], generator=torch.Generator().manual_seed(7))
    kernel = ChainPlan(weights, SPLITS, rows=2).run(x).clone()
    monkeypatch.setattr(persistent, "use_triton", lambda _x: False)
    reference = ChainPlan(weights, SPLITS, rows=2).run(x)
    torch.testing.assert_close(kernel, reference, rtol=2e-5, atol=1e-5)
