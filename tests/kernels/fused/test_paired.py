"""bfloat16 weights in the paired layout (kernels.fused.paired) read by the CPU's float32 kernels and
step: the bits of their float32 values, whatever the sizes, rows, splits and threads (DESIGN §11)."""

import pytest
import torch

from kernels.fused import cpu_rows, cpu_step
from kernels.fused.paired import pair_bf16, unpair
from shared.model import ModelConfig, load_model
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model import graphs
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool

needs_native = pytest.mark.skipif(not cpu_rows.available(), reason="the native kernels are not built")


def halves(*shape, seed=0):
    """float32 values that are bfloat16 values (a bfloat16 checkpoint's weights)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()


def test_the_layout_pairs_a_chunks_values_j_and_j_plus_8_and_leaves_the_tail_in_order():
    weight = torch.arange(2 * 37, dtype=torch.float32).view(2, 37)  # (small integers: exact in bfloat16)
    paired = pair_bf16(weight)
    assert paired.dtype == torch.bfloat16 and paired.shape == weight.shape and paired.is_contiguous()
    chunk = [v for k in range(8) for v in (k, k + 8)]  # 0, 8, 1, 9, ..., 7, 15
    assert paired[0].float().tolist() == chunk + [16 + v for v in chunk] + [32, 33, 34, 35, 36]
    assert paired[1].float().tolist() == [37 + v for v in paired[0].float().tolist()]
    for shape in [(5,), (3, 16), (2, 3, 40), (4, 100)]:
        w = halves(*shape)
        assert torch.equal(unpair(pair_bf16(w)), w)


def test_weights_that_are_not_bfloat16_values_are_not_paired():
    w = halves(4, 32)
    w[2, 5] += 1e-3  # (a float32 value between two bfloat16 values)
    assert pair_bf16(w) is None
    assert pair_bf16(halves(4, 32).to(torch.bfloat16)) is None  # float32 only
    nan = halves(4, 32)
    nan[0, 0] = float("nan")
    assert pair_bf16(nan) is None


@needs_native
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("num_out, num_in, splits, step", [
    (37, 256, 1, 256),  # chunks only
    (70, 200, 1, 200),  # an 8-value step after the chunks
    (19, 7, 1, 7),  # no chunk: the tail only
    (33, 72, 3, 32),  # split-K, every split starting on a chunk
    (40, 100, 2, 50),  # a split starting inside a chunk
    (21, 120, 3, 40),  # a split starting at a chunk's second eight
    (17, 136, 3, 48),  # the last split short
])
def test_native_products_of_paired_weights_are_the_float32_weights_bits(num_rows, num_out, num_in, splits, step):
    x = torch.randn(num_rows, num_in, generator=torch.Generator().manual_seed(num_rows))
    weight = halves(num_out, num_in, seed=num_out)
    ours = cpu_rows.partials(x, pair_bf16(weight), splits, step, paired=True)
    assert ours is not None and torch.equal(ours, cpu_rows.partials(x, weight, splits, step))


@needs_native
@pytest.mark.parametrize("num_tokens, top_k, num_experts, hidden, inter", [
    (1, 2, 16, 256, 128), (8, 2, 16, 256, 128),  # the embedded model's shapes: one or two routes an expert
    (5, 3, 4, 40, 24),  # several routes an expert (converted once for them)
    (2, 2, 3, 19, 9),  # tails only
    (6, 2, 2, 64, 48),
])
def test_native_experts_of_paired_weights_are_the_float32_weights_bits(num_tokens, top_k, num_experts, hidden, inter):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    ids[0, 0] = -1  # a dropped route
    gate_up, down = halves(num_experts, 2 * inter, hidden, seed=1), halves(num_experts, hidden, inter, seed=2)
    ours = cpu_rows.experts(x, ids, pair_bf16(gate_up), pair_bf16(down), paired=True)
    assert ours is not None and torch.equal(ours, cpu_rows.experts(x, ids, gate_up, down))


@needs_native
def test_the_kernels_refuse_paired_weights_under_bfloat16_rows():
    x = torch.randn(2, 32).to(torch.bfloat16)
    assert cpu_rows.partials(x, pair_bf16(halves(8, 32)), 1, 32, paired=True) is None
    assert cpu_rows.experts(x, torch.zeros(2, 1, dtype=torch.int64), pair_bf16(halves(2, 8, 32)),
                            pair_bf16(halves(2, 32, 4)), paired=True) is None
    with pytest.raises(ValueError, match="weights of type 2 under rows of type 1"):  # (the entry point's own check)
        cpu_rows.native().partials(0, 0, 0, 1, 1, 32, 32, 32, 1, 32, 1, 2)


# Odd sizes (hidden 40: one chunk and an 8-value step; experts' intermediate 12: the tail only)
STEP_MODEL = dict(
    model_type="qwen3_moe", vocab_size=101, hidden_size=40, intermediate_size=48, moe_intermediate_size=12,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
    num_experts_per_tok=3, max_position_embeddings=128, rope_theta=10000.0, norm_topk_prob=True,
    initializer_range=0.5,
)


@pytest.fixture(scope="module")
def bf16_valued_model():
    """A float32 model whose weights are bfloat16 values, as a bfloat16 checkpoint loads."""
    model = load_model(config=ModelConfig.from_dict(STEP_MODEL), random_weights=True, seed=11, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
        for layer in model.layers:  # (the experts' stacked weights are the store's own tensors)
            for weight in (layer.mlp.experts.gate_up, layer.mlp.experts.down):
                weight.copy_(weight.to(torch.bfloat16).float())
    return model


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_the_step_over_paired_weights_is_the_float32_steps_bits(bf16_valued_model, threads, monkeypatch, lockstep):
    # The same prompts and steps through a runner whose step reads the paired weights, one whose
    # step reads the float32 weights and one op by op: logits, hidden rows, greedy ids and the KV
    # pool equal bit for bit, windows and batches of 1..14 rows.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # (the step's threads follow torch's)
    monkeypatch.setattr(graphs, "STEPPED_PROMPT_ROWS", 0)  # (every arm prefills by the forward: the pools start equal)
    c = bf16_valued_model.config

    def runner(native: bool, paired: bool):
        pool = KVPool(num_layers=c.num_hidden_layers, num_slots=4, max_length=64, num_kv_heads=c.num_key_value_heads,
                      head_dim=c.head_dim, dtype=torch.float32, device="cpu", block_size=4)
        fused = FusedModel(bf16_valued_model, max_rows=32, max_length=64)
        fused.native_step = native
        if not paired:
            fused._paired = {}  # (made: none)
        return FusedRunner(fused, pool, max_rows=6, max_batch_rows=32), pool

    arms = [runner(True, True), runner(True, False), runner(False, False)]
    assert arms[0][0].fused.step_plan(arms[0][1].paged()) is not None and arms[0][0].fused._paired
    assert arms[0][0].fused._paired["0.gate_up"].dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (9, 4, 13)]
    slots = []
    for run, pool in arms:
        taken = [pool.acquire(64)[0] for _ in prompts]
        for slot, prompt in zip(taken, prompts):
            run.prefill([(slot, prompt, 0)])
        slots.append(taken)
    lengths = [len(p) for p in prompts]
    for picks in [[(0, 1)], [(1, 5)], [(0, 1), (1, 1), (2, 1)], [(2, 5), (0, 4), (1, 5)], [(1, 2), (0, 1)]]:
        outs = lockstep(arms, slots, lengths, picks, gen, 101)
        for out in outs[:2]:
            assert torch.equal(out.logits, outs[2].logits) and torch.equal(out.hidden, outs[2].hidden), picks
            assert torch.equal(out.greedy_ids, outs[2].greedy_ids), picks
        for theirs, ours in zip(arms[2][1].paged().layers, arms[0][1].paged().layers):
            assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), picks


@needs_native
def test_a_model_whose_weights_are_not_bfloat16_values_steps_on_its_float32_weights(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = load_model(config=ModelConfig.from_dict(STEP_MODEL), random_weights=True, seed=12, dtype=torch.float32)
    c = model.config
    pool = KVPool(num_layers=c.num_hidden_layers, num_slots=1, max_length=32, num_kv_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, dtype=torch.float32, device="cpu")
    fused = FusedModel(model, max_rows=8, max_length=32)
    assert fused.step_plan(pool.paged()) is not None and fused._paired == {}
    with pytest.raises(ValueError, match="weights of type 2 under rows of type 1"):
        cpu_rows.native().step_plan((0,) * 18 + (1, 2), [])
    assert cpu_step.plan(model.embed_tokens.weight.to(torch.bfloat16), model.lm_head.weight, fused.cos, fused.sin,
                         pool.block_tables, [], 4, 2, paired=True) is None
