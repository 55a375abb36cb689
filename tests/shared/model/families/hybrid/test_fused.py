"""The hybrid family's fused forward (shared.model.families.hybrid.fused) against its reference
modules, its linear-attention states (ping-pong buffers, rollback to a kept row), and the window
runner over them. On a CPU box the kernels run in Triton's interpreter."""

import pytest
import torch

from shared.model.families import build_fused
from shared.model.families.hybrid.fused import HybridFused, unsupported_reason
from shared.model.rows import Rows
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool
from shared.model.families.hybrid.loader import random_next
from shared.model.families.hybrid.config import NextConfig
from shared.model.quantize import Fp8Linear, quantize_model

BASE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=12,
            num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=128,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mlp_only_layers=[2], partial_rotary_factor=0.25, rms_norm_eps=1e-6)
LAYOUTS = {"split": dict(model_type="qwen3_5_moe_text"), "grouped": dict(model_type="qwen3_next")}


def new_model(layout: str, seed: int = 0):
    model = random_next(NextConfig.from_dict(BASE | LAYOUTS[layout]), dtype=torch.float32, device="cpu", seed=seed,
                        std=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-trivial norms and decays, so a mix-up cannot hide
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=gen) * 2 - 1)
    return model


def fuse(layout: str, fp8: bool = False):
    """(the reference model, its fused forward keeping states for 6 slots); fp8: its projections
    and experts block-scaled FP8 first (shared.model.quantize; blocks that split the shared
    expert's width and the fused rows, so per-row scales and padding are exercised)."""
    model = new_model(layout)
    if fp8:
        quantize_model(model, (16, 16))
    expected = model(torch.arange(12) % 97, model.new_cache(16))[0]
    fused = build_fused(model, max_rows=8, max_length=64, num_state_slots=6)
    assert isinstance(fused, HybridFused)
    again = model(torch.arange(12) % 97, model.new_cache(16))[0]  # fusing keeps the reference the same function
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)
    return model, fused


@pytest.fixture(scope="module", params=[(layout, fp8) for fp8 in (False, True) for layout in sorted(LAYOUTS)],
                ids=lambda p: p[0] + ("-fp8" if p[1] else ""))
def any_layout(request):
    """Both projection layouts (Qwen3-Next's grouped one is converted to the split one), with
    full-precision and with FP8 weights."""
    return fuse(*request.param)


@pytest.fixture(scope="module")
def fused():
    return fuse("split")


def new_pool(model, num_slots=3):
    c = model.config
    return KVPool(num_layers=model.num_kv_layers, num_slots=num_slots, max_length=64, num_kv_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, dtype=model.dtype, device="cpu", block_size=8)


def start(fused, pool, prompt):
    """A sequence at a new slot with `prompt` prefilled; returns the slot."""
    slot, length = pool.acquire(64)
    fused.states.reset(slot)
    length.reserve(len(prompt))
    fused.prefill(torch.tensor(prompt), [(0, len(prompt), slot)], pool.paged())
    return slot


def step(fused, pool, slot, tokens, position):
    """One window of `tokens` at `position` of the slot, reading its committed state."""
    read, write = fused.states.buffers(slot)
    rows = Rows.window(position, len(tokens), slot, "cpu")
    rows = Rows(**{**rows.__dict__, "state_in": torch.tensor([read]), "state_out": torch.tensor([write])})
    return fused.forward(torch.tensor(tokens), rows, pool.paged())


@pytest.mark.parametrize("window", [1, 4])
def test_prefill_and_a_window_match_the_reference(any_layout, window):
    model, fused = any_layout
    ids = torch.randint(0, 97, (20 + window,), generator=torch.Generator().manual_seed(window)).tolist()
    ref_logits, ref_hidden = model(torch.tensor(ids), model.new_cache(40))
    pool = new_pool(model)
    slot = start(fused, pool, ids[:20])
    logits, hidden = step(fused, pool, slot, ids[20:], 20)
    torch.testing.assert_close(logits, ref_logits[20:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden[20:], rtol=1e-4, atol=1e-4)


def test_a_window_rolled_back_decodes_like_the_accepted_rows_alone(fused):
    """Slot a verifies [head, d0..d3] and keeps the head and two drafts; slot b decodes the same
    three tokens one step each. Every row, and the next step after them, is bit-identical."""
    model, fused = fused
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 97, (9,), generator=gen).tolist()
    window = torch.randint(0, 97, (5,), generator=gen).tolist()
    pool = new_pool(model)
    a, b = start(fused, pool, prompt), start(fused, pool, prompt)
    verified, _ = step(fused, pool, a, window, 9)
    fused.states.settle(a, kept_row=2)
    for j, token in enumerate(window[:3]):
        row, _ = step(fused, pool, b, [token], 9 + j)
        fused.states.settle(b)
        assert torch.equal(row[0], verified[j])
    after_a, _ = step(fused, pool, a, [7], 12)
    after_b, _ = step(fused, pool, b, [7], 12)
    assert torch.equal(after_a, after_b)


def test_a_ragged_batch_gives_each_row_its_one_row_step(fused):
    model, fused = fused
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (6, 11, 8)]
    windows = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (1, 3, 2)]
    pool = new_pool(model, num_slots=6)
    batch_slots = [start(fused, pool, p) for p in prompts]
    alone_slots = [start(fused, pool, p) for p in prompts]
    buffers = [fused.states.buffers(s) for s in batch_slots]
    positions = [p for prompt, window in zip(prompts, windows) for p in range(len(prompt), len(prompt) + len(window))]
    rows = Rows(positions=torch.tensor(positions),
                slots=torch.tensor([s for s, w in zip(batch_slots, windows) for _ in w]),
                seq_starts=torch.tensor([0, 1, 4, 6], dtype=torch.int32), seq_slots=torch.tensor(batch_slots),
                max_rows_per_seq=3, state_in=torch.tensor([r for r, _ in buffers]),
                state_out=torch.tensor([w for _, w in buffers]))
    batched, _ = fused.forward(torch.tensor([t for w in windows for t in w]), rows, pool.paged())
    row = 0
    for slot, prompt, window in zip(alone_slots, prompts, windows):
        for j, token in enumerate(window):
            alone, _ = step(fused, pool, slot, [token], len(prompt) + j)
            fused.states.settle(slot)
            assert torch.equal(alone[0], batched[row])
            row += 1


def test_a_step_computed_ahead_and_dropped_leaves_the_committed_state(fused):
    """The runner's decode-ahead: a chained step reads the state its predecessor wrote; when the
    engine drops it (the next round verifies drafts instead), the window reads the committed
    state as if the step had never run."""
    model, fused = fused
    pool = new_pool(model, num_slots=4)
    runner = FusedRunner(fused, pool, 5, max_batch_rows=8, use_graphs=False)
    prompt = [5, 17, 33, 2, 41, 9]
    dropped, kept = (start(fused, pool, prompt) for _ in range(2))
    for slot in (dropped, kept):
        runner.run([(slot, [60], 6)])
        runner.settle(slot)
        if slot == dropped:
            runner.run_next()  # (not settled: dropped)
    a = runner.run([(dropped, [61, 62, 63], 7)]).logits.clone()
    b = runner.run([(kept, [61, 62, 63], 7)]).logits.clone()
    assert torch.equal(a, b)


def test_the_chained_step_continues_from_the_step_before(fused):
    model, fused = fused
    pool = new_pool(model, num_slots=4)
    runner = FusedRunner(fused, pool, 5, max_batch_rows=8, use_graphs=False)
    prompt = [5, 17, 33, 2, 41, 9]
    chained, stepped = (start(fused, pool, prompt) for _ in range(2))
    first = runner.run([(chained, [60], 6)])
    token = int(first.greedy_ids[0])
    runner.settle(chained)
    ahead = runner.run_next().logits.clone()
    runner.settle(chained)
    runner.run([(stepped, [60], 6)])
    runner.settle(stepped)
    assert torch.equal(runner.run([(stepped, [token], 7)]).logits, ahead)


def test_unsupported_shapes_are_named():
    model = new_model("split")
    object.__setattr__(model.config, "linear_conv_kernel_dim", 3)
    assert "linear_conv_kernel_dim" in unsupported_reason(model)
    with pytest.raises(ValueError, match="linear_conv_kernel_dim"):
        HybridFused(model, max_rows=4, max_length=16)


def test_fp8_weights_fuse_as_views_and_the_shared_expert_pads():
    model, fused = fuse("grouped", fp8=True)
    assert isinstance(model.layers[1].self_attn.o_proj, Fp8Linear)
    layer = fused.layers[1]
    assert type(layer.gate_up).__name__ == "Fp8Weight" and layer.gate_up.shape[0] == 8 + 1  # routed + shared
    assert type(model.layers[1].mlp.gate) is torch.nn.Linear  # the router stays
    # the mixer's fused in-projection: the reference modules are views of it (nothing kept twice)
    mixer = fused.layers[0].mixer
    assert model.layers[0].linear_attn.in_proj_qkv.weight.data_ptr() == mixer.in_proj.q.data_ptr()
