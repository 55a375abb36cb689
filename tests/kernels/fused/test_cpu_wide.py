"""The wide products (kernels/fused/_cpu_wide.c: two input rows a 16-lane register on a machine with
AVX-512, or for one or two rows two paired weight rows a register) against the 8-lane kernels: the
same bits for every row, so a row's product does not depend on how many rows share its step (DESIGN
§11)."""

import pytest
import torch

from kernels.fused import cpu_rows
from kernels.fused.paired import pair_bf16
from shared.model import ModelConfig, load_model
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool

needs_wide = pytest.mark.skipif(not cpu_rows.available() or not cpu_rows.wide_products(),
                                reason="the wide kernel runs on x86-64 machines with AVX-512 only")


def halves(*shape, seed=0):
    """float32 values that are bfloat16 values (weights that the paired layout holds exactly)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()


@needs_wide
@pytest.mark.parametrize("paired", [False, True], ids=["float32", "paired"])
@pytest.mark.parametrize("num_out, num_in, splits, step", [
    (37, 256, 1, 256),  # whole chunks; weight rows in fours and a remainder
    (70, 200, 1, 200),  # an eight after the paired chunks: the 8-lane kernels take that split
    (64, 24, 1, 24),  # three eights (float32: wide; paired: a chunk and an eight, so 8-lane)
    (33, 96, 3, 32),  # split-K, splits of two chunks
    (40, 100, 2, 50),  # splits that are no multiple of eight: 8-lane
    (21, 120, 3, 40),  # splits starting at a chunk's second eight
    (130, 64, 4, 16),  # one chunk a split, more than two column blocks a work item
])
def test_wide_products_are_the_8_lane_kernels_bits_for_any_number_of_rows(paired, num_out, num_in, splits, step):
    x = torch.randn(11, num_in, generator=torch.Generator().manual_seed(num_in))
    weight = halves(num_out, num_in, seed=num_out)
    weight = pair_bf16(weight) if paired else weight
    one_row = [cpu_rows.partials(x[i : i + 1], weight, splits, step, paired=paired)[0] for i in range(len(x))]
    for num_rows in [2, 3, 4, 7, 8, 9, 11]:  # odd rows (a pair's second half empty); more than one pass of 8
        wide = cpu_rows.partials(x[:num_rows], weight, splits, step, paired=paired)
        narrow = cpu_rows.partials(x[:num_rows], weight, splits, step, paired=paired, wide=False)
        assert torch.equal(wide, narrow), num_rows
        for i in range(num_rows):
            assert torch.equal(wide[i], one_row[i]), (num_rows, i)


@needs_wide
def test_wide_products_of_special_values_keep_them():
    """Infinities and NaNs reach the sums they are in, and only those (no lane leaks into a neighbour)."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    x[1, 9] = float("inf")
    x[3, 40] = float("nan")
    weight = halves(12, 64, seed=4).abs() + 0.5  # (positive: an infinity stays one)
    wide = cpu_rows.partials(x, weight, 1, 64)
    torch.testing.assert_close(wide, cpu_rows.partials(x, weight, 1, 64, wide=False), rtol=0, atol=0, equal_nan=True)
    assert torch.isinf(wide[1]).all() and torch.isnan(wide[3]).all()
    assert torch.isfinite(wide[[0, 2, 4]]).all()
    finite = [0, 2, 4]
    assert torch.equal(wide[finite], cpu_rows.partials(x[finite], weight, 1, 64, wide=False))



@pytest.fixture
def eight_lanes():
    """Call to forbid the wide kernels until the test ends (every call in this process)."""
    yield lambda: cpu_rows.set_wide(False)
    cpu_rows.set_wide(True)


@needs_wide
@pytest.mark.parametrize("num_out, num_in, splits, step", [
    (37, 256, 1, 256),  # weight rows in sixteens, pairs and one left over
    (16, 128, 1, 128),  # one group of sixteen
    (3, 32, 1, 32),  # a pair and one row
    (70, 200, 1, 200),  # an eight after the paired chunks: the 8-lane kernels take that product
    (33, 96, 3, 32),  # split-K, splits of two chunks
    (21, 120, 3, 40),  # splits starting at a chunk's second eight: 8-lane
])
def test_one_or_two_rows_over_paired_weights_are_the_8_lane_kernels_bits(num_out, num_in, splits, step, eight_lanes):
    # One or two input rows (a request's own decode step) take two paired weight rows a register.
    x = torch.randn(2, num_in, generator=torch.Generator().manual_seed(num_in))
    weight = pair_bf16(halves(num_out, num_in, seed=num_out))
    wide = [cpu_rows.partials(x[:rows], weight, splits, step, paired=True) for rows in (1, 2)]
    narrow = [cpu_rows.partials(x[:rows], weight, splits, step, paired=True, wide=False) for rows in (1, 2)]
    eight_lanes()
    forbidden = [cpu_rows.partials(x[:rows], weight, splits, step, paired=True) for rows in (1, 2)]
    for rows in (0, 1):
        assert torch.equal(wide[rows], narrow[rows]) and torch.equal(wide[rows], forbidden[rows]), rows + 1
    assert torch.equal(wide[1][0], wide[0][0])  # (the first row alone and beside another)


@needs_wide
@pytest.mark.parametrize("num_tokens, hidden, inter", [(1, 64, 32), (2, 64, 32), (3, 256, 128), (8, 48, 16), (4, 40, 24)])
def test_experts_are_the_8_lane_kernels_bits(num_tokens, hidden, inter, eight_lanes):
    # An expert's routes take two paired weight rows a register, two routes a pass (hidden and
    # intermediate sizes that are whole chunks; others, as the last case's: the 8-lane kernels;
    # 8 tokens: experts of three routes and more).
    num_experts, top_k = 6, 2
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(hidden))
    gate_up = pair_bf16(halves(num_experts * 2 * inter, hidden, seed=1)).view(num_experts, 2 * inter, hidden)
    down = pair_bf16(halves(num_experts * hidden, inter, seed=2)).view(num_experts, hidden, inter)
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    wide = cpu_rows.experts(x, ids, gate_up, down, paired=True)
    alone = [cpu_rows.experts(x[t : t + 1], ids[t : t + 1], gate_up, down, paired=True) for t in range(num_tokens)]
    eight_lanes()
    assert torch.equal(wide, cpu_rows.experts(x, ids, gate_up, down, paired=True))
    assert torch.equal(wide, torch.cat(alone))  # (each route its own, whatever shares its expert)


@needs_wide
def test_a_step_over_paired_weights_is_the_8_lane_steps_bits(eight_lanes, monkeypatch):
    # The embedded model's kind of sizes (whole chunks everywhere, a vocabulary of 101 rows: a
    # weight row left over): windows and batches of 1..8 rows, logits and hidden rows bit for bit
    # with the wide kernels and without.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = ModelConfig.from_dict(dict(
        model_type="qwen3_moe", vocab_size=101, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
        num_experts_per_tok=2, max_position_embeddings=128, rope_theta=10000.0, norm_topk_prob=True,
        initializer_range=0.5))
    model = load_model(config=config, random_weights=True, seed=21, dtype=torch.float32)
    with torch.no_grad():  # (bfloat16 values, as a bfloat16 checkpoint loads: the step reads them paired)
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
        for layer in model.layers:
            for weight in (layer.mlp.experts.gate_up, layer.mlp.experts.down):
                weight.copy_(weight.to(torch.bfloat16).float())
    pool = KVPool(num_layers=2, num_slots=4, max_length=64, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                  device="cpu", block_size=4)
    fused = FusedModel(model, max_rows=32, max_length=64)
    runner = FusedRunner(fused, pool, max_rows=6, max_batch_rows=32)
    slots = [pool.acquire(64)[0] for _ in range(4)]
    for i, slot in enumerate(slots):
        runner.prefill([(slot, list(range(3 + i, 20 + i)), 0)])
    plan = fused.step_plan(pool.paged())
    assert plan is not None and fused._paired
    gen = torch.Generator().manual_seed(4)
    cases = []
    for num_rows in (1, 2, 3, 5, 8):
        token_ids = torch.randint(0, 101, (num_rows,), generator=gen)
        row_slots = torch.tensor([slots[t % 4] for t in range(num_rows)])
        positions = torch.tensor([17 + t // 4 for t in range(num_rows)])  # (rewrites the same K and V each run)
        cases.append((token_ids, positions, row_slots))
    wide = [plan.run(*case, None, threads=2) for case in cases]
    eight_lanes()
    for case, (logits, hidden) in zip(cases, wide):
        narrow_logits, narrow_hidden = plan.run(*case, None, threads=2)
        assert torch.equal(logits, narrow_logits) and torch.equal(hidden, narrow_hidden), len(case[0])
