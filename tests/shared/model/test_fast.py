"""The fused forward (shared.model.families.qwen3_moe.fused) against the reference modules, the captured-window
runner's eager path, and KV pool slots. On a CPU box the kernels run in Triton's interpreter."""

import os

import pytest
import torch

from shared.model import ModelConfig, RoutingOptions, load_model
from shared.model.families.qwen3_moe.fused import FusedModel, unsupported_reason
from shared.model.rows import Rows
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool
from shared.model.runner import Window

CONFIG = dict(
    model_type="qwen3_moe", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0, norm_topk_prob=True,
    mtp_num_hidden_layers=1, mlp_only_layers=[1],  # one dense layer: the fused path covers both kinds
)


@pytest.fixture(scope="module")
def model():
    m = load_model(config=ModelConfig.from_dict(CONFIG), random_weights=True, seed=5)
    with torch.no_grad():
        for name, param in m.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return m


@pytest.fixture(scope="module")
def fused(model):
    return FusedModel(model, max_rows=8, max_length=64)


def test_fusing_keeps_the_reference_modules_working(model, fused):
    # q/k/v now view one fused matrix; the reference forward must be unchanged by that.
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == fused.layers[0].qkv.data_ptr()
    ids = torch.arange(10) % 97
    logits, _ = model(ids, model.new_cache(16))
    again, _ = model(ids, model.new_cache(16))
    assert torch.equal(logits, again)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_fused_window_matches_reference(model, fused, window):
    ids = torch.randint(0, 97, (20 + window,), generator=torch.Generator().manual_seed(window))
    ref_logits, ref_hidden = model(ids, model.new_cache(40))
    cache = model.new_cache(40)
    model(ids[:20], cache)  # prefill by the reference path, as the verifier does
    logits, hidden = fused.forward(ids[20:], Rows.window(20, window, 0, "cpu"), cache.paged())
    torch.testing.assert_close(logits, ref_logits[20:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden[20:], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), ref_logits[20:].argmax(-1))


def test_the_non_invariant_yardstick_computes_the_same_window(model):
    """invariant=False (cuBLAS projections for windows of several rows, bench/invariance.py's
    yardstick) is the same function; only its rounding may follow the window."""
    ids = torch.randint(0, 97, (25,), generator=torch.Generator().manual_seed(2))
    ref_logits, _ = model(ids, model.new_cache(40))
    yardstick = FusedModel(model, max_rows=8, max_length=64, invariant=False)
    cache = model.new_cache(40)
    model(ids[:20], cache)
    logits, _ = yardstick.forward(ids[20:], Rows.window(20, 5, 0, "cpu"), cache.paged())
    torch.testing.assert_close(logits, ref_logits[20:], rtol=1e-4, atol=1e-4)


def new_pool(model, num_slots, max_length=32, block_size=None, device="cpu"):
    c = model.config
    return KVPool(num_layers=c.num_hidden_layers, num_slots=num_slots, max_length=max_length,
                  num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=model.dtype, device=device,
                  block_size=block_size)


@pytest.mark.parametrize("chunk", [5, 19])
@pytest.mark.parametrize("block_size", [None, 4])
def test_fused_prefill_in_chunks_matches_the_whole_prompt(model, fused, chunk, block_size):
    # Chunks into the second slot of a pool (contiguous, or paged in blocks of 4 that chunks
    # straddle): hidden rows and KV rows as the reference forward of the whole prompt at once,
    # and the first slot's blocks untouched.
    ids = torch.randint(0, 97, (19,), generator=torch.Generator().manual_seed(chunk))
    cache = model.new_cache(32)
    _, ref_hidden = model(ids, cache)
    pool = new_pool(model, 2, block_size=block_size)
    other, _ = pool.acquire(32)
    slot, _ = pool.acquire(32)
    hidden = torch.cat([fused.prefill(ids[start : start + chunk], [(start, len(ids[start : start + chunk]), slot)],
                                      pool.paged()) for start in range(0, 19, chunk)])
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
    keys, values = pool.read(slot, 32)
    torch.testing.assert_close(keys[:, :19], cache.keys[:, :19], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(values[:, :19], cache.values[:, :19], rtol=1e-4, atol=1e-4)
    assert not pool.read(other, 32)[0].any() and not keys[:, 19:].any()


def test_fused_prefill_of_several_sequences_in_one_forward(model, fused):
    # Chunks of three sequences (different starts and lengths) in one forward: each sequence's
    # hidden rows and KV rows as when it is prefilled alone (there in a contiguous pool, here
    # in a paged one).
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (9, 14, 5)]
    alone, together = new_pool(model, 3), new_pool(model, 3, block_size=4)
    slots = [(alone.acquire(32)[0], together.acquire(32)[0]) for _ in prompts]
    firsts = (4, 6, 0)  # rows each sequence had prefilled before the shared forward
    expected = []
    for (a, t), prompt, first in zip(slots, prompts, firsts):
        if first:
            fused.prefill(prompt[:first], [(0, first, a)], alone.paged())
            fused.prefill(prompt[:first], [(0, first, t)], together.paged())
        expected.append(fused.prefill(prompt[first:], [(first, len(prompt) - first, a)], alone.paged()))
    ids = torch.cat([prompt[first:] for prompt, first in zip(prompts, firsts)])
    spans = [(first, len(prompt) - first, t) for (_, t), prompt, first in zip(slots, prompts, firsts)]
    hidden = fused.prefill(ids, spans, together.paged())
    torch.testing.assert_close(hidden, torch.cat(expected), rtol=1e-5, atol=1e-5)
    for (a, t), prompt in zip(slots, prompts):
        for mine, theirs in zip(together.read(t, len(prompt)), alone.read(a, len(prompt))):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="spans cover"):
        fused.prefill(ids, spans[:2], together.paged())


@pytest.mark.parametrize("moce", [False, True])
def test_fused_mtp_matches_reference(model, fused, moce):
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(1))
    _, hidden = model(ids, model.new_cache(16))
    routing = RoutingOptions(moce=True, scale=1.5, draft_rows=torch.ones(11, dtype=torch.bool)) if moce else None
    ref_logits, ref_out = model.forward_mtp(hidden[:11], ids[1:], model.new_mtp_cache(16), routing=routing)
    cache = model.new_mtp_cache(16)
    logits, out = fused.forward_mtp(hidden[:11], ids[1:], Rows.window(0, 11, 0, "cpu"), cache.paged(),
                                    routing=routing)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


def test_fused_mtp_logits_of_chosen_rows_are_those_rows_bits(model, fused):
    """logit_rows: the lm_head on those rows alone gives each the bits it has among all rows (a
    catch-up reads only its last row's logits, shared.model.mtp_runner)."""
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(2))
    _, hidden = model(ids, model.new_cache(16))
    every, out = fused.forward_mtp(hidden[:11], ids[1:], Rows.window(0, 11, 0, "cpu"), model.new_mtp_cache(16).paged())
    chosen = torch.tensor([3, 10])
    some, same_out = fused.forward_mtp(hidden[:11], ids[1:], Rows.window(0, 11, 0, "cpu"),
                                       model.new_mtp_cache(16).paged(), logit_rows=chosen)
    assert some.shape == (2, every.shape[1])
    assert torch.equal(some, every[chosen]) and torch.equal(same_out, out)


def test_window_runner_decodes_like_the_reference(model, fused):
    """Greedy decoding through FusedRunner over a paged pool slot (blocks of 4, shuffled by an
    earlier tenant) equals the reference, and a verify window's rows agree with the single-row
    steps that follow the same path."""
    pool = new_pool(model, 3, max_length=64, block_size=4)
    first, _ = pool.acquire(8)  # takes blocks, then gives them back out of order
    runner = FusedRunner(fused, pool, max_rows=8)
    assert not runner.use_graphs  # CPU: eager
    prompt = [5, 17, 42, 8, 71, 3]
    reference = list(prompt)
    cache = model.new_cache(64)
    logits, _ = model(torch.tensor(reference), cache)
    for _ in range(8):
        reference.append(int(logits[-1].argmax()))
        logits, _ = model(torch.tensor(reference[-1:]), cache)
    slot, _ = pool.acquire(4)
    pool.release(first)
    pool.release(slot)
    slot, _ = pool.acquire(64)
    assert pool.block_tables[slot, :16].tolist() != list(range(16))  # not in order: paging is exercised
    fused.prefill(torch.tensor(prompt[:-1]), [(0, 5, slot)], pool.paged())
    tokens = list(prompt)
    for _ in range(8):
        out = runner.run([(slot, tokens[-1:], len(tokens) - 1)])
        tokens.append(int(out.greedy_ids[0]))
    assert tokens == reference
    window = runner.run([(slot, reference[6:10], 6)])  # re-verify four committed tokens as one window
    assert window.greedy_ids.tolist() == reference[7:11]
    pool.release(slot)


def test_pool_slots_and_blocks_are_isolated_and_accounted():
    pool = KVPool(num_layers=2, num_slots=3, max_length=8, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                  device="cpu", block_size=2, num_blocks=6)
    assert pool.max_blocks == 4 and pool.num_free_blocks == 6
    a, cache_a = pool.acquire(8)  # 4 blocks
    b, cache_b = pool.acquire(3)  # 2 blocks
    assert a != b and pool.num_free == 1 and pool.num_free_blocks == 0 and cache_b.max_length == 3
    with pytest.raises(RuntimeError, match="need 1 KV blocks of 2; 0 of 6 are free"):
        pool.acquire(1)
    held_a, held_b = pool.block_tables[a].tolist(), pool.block_tables[b, :2].tolist()
    assert len(set(held_a) | set(held_b)) == 6  # no block shared
    pool.keys[0, held_a[1], 1].fill_(1.0)  # position 3 of slot a
    keys_a, _ = pool.read(a, 8)
    assert keys_a[0, 3].eq(1).all() and keys_a.ne(0).sum() == 4 and not pool.read(b, 3)[0].any()
    pool.release(a)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="not held"):
        pool.release(a)
    with pytest.raises(ValueError, match="cache length 9"):
        pool.acquire(9)
    c, _ = pool.acquire(2)
    d, _ = pool.acquire(2)
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="all 3 KV slots"):
        pool.acquire(1)
    for slot in (b, c, d):
        pool.release(slot)
    assert pool.num_free == 3 and pool.num_free_blocks == 6


def test_unsupported_models_name_the_reason():
    raw = dict(CONFIG, attention_bias=True)
    m = load_model(config=ModelConfig.from_dict(raw), random_weights=True)
    assert "attention_bias" in unsupported_reason(m)
    with pytest.raises(ValueError, match="attention_bias"):
        FusedModel(m, max_rows=4, max_length=16)
    slots = load_model(config=ModelConfig.from_dict(CONFIG), random_weights=True, num_expert_slots=4)
    assert unsupported_reason(slots) is None  # offloaded experts: tests/shared/model/test_offload.py


def test_dependent_launch_is_off_where_the_device_lacks_it(fused):
    assert fused.pdl is False  # CPU: kernels launch plainly (the interpreter has no PDL)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a CUDA GPU of compute capability 9.0+")
def test_dependent_launch_changes_no_bit():
    """Kernels launched as programmatic dependents (each waits in-kernel for its predecessor)
    give the same bits as plain launches, eager and captured: a missing wait would race."""
    config = ModelConfig.from_dict(CONFIG | dict(head_dim=16))  # tl.dot on a GPU needs K >= 16
    model = load_model(config=config, random_weights=True, seed=5, dtype=torch.bfloat16, device="cuda")
    runners = []
    for pdl in (True, False):
        pool = KVPool(num_layers=3, num_slots=1, max_length=64, num_kv_heads=2, head_dim=16, dtype=model.dtype,
                      device="cuda")
        runner = FusedRunner(FusedModel(model, max_rows=8, max_length=64, pdl=pdl), pool, max_rows=8)
        runner.capture([1, 5])
        slot, _ = pool.acquire(64)  # (after the capture, whose warm-up writes where no request is)
        runners.append((runner, slot))
    prompt = [5, 17, 42, 8, 71, 3, 9, 60, 11, 2]
    for start in range(0, 10, 5):  # captured 5-row windows, then 1-row steps (captured) and a 3-row (eager)
        outs = [r.run([Window(slot, prompt[start : start + 5], start)]).logits.clone() for r, slot in runners]
        assert torch.equal(outs[0], outs[1])
    for position, size in ((10, 1), (11, 3)):
        outs = [r.run([Window(slot, prompt[:size], position)]).logits.clone() for r, slot in runners]
        assert torch.equal(outs[0], outs[1])


def _prefilled_pool(model, prompts, device, block_size=4):
    """A paged pool (a slot per prompt, plus a scratch slot) with each prompt's KV rows written."""
    pool = new_pool(model, len(prompts) + 1, max_length=64, block_size=block_size, device=device)
    slots = []
    fused = FusedModel(model, max_rows=8, max_length=64)
    interpreting = os.environ.pop("TRITON_INTERPRET", None)  # the context: the fused ops' torch code (faster)
    try:
        for prompt in prompts:
            slot, _ = pool.acquire(64)
            fused.prefill(torch.tensor(prompt, device=device), [(0, len(prompt), slot)], pool.paged())
            slots.append(slot)
    finally:
        if interpreting is not None:
            os.environ["TRITON_INTERPRET"] = interpreting
    scratch, _ = pool.acquire(1)
    return pool, slots, scratch


def test_a_batch_of_windows_matches_each_window_alone(model, fused):
    """run_batch: several sequences' windows in one ragged forward give each window's rows."""
    prompts = [[5, 17, 42, 8], [9, 1, 60, 33, 2, 70], [11, 12]]
    pool, slots, scratch = _prefilled_pool(model, prompts, "cpu")
    runner = FusedRunner(fused, pool, max_rows=4, max_batch_rows=8, scratch_slot=scratch)
    windows = [(slots[0], [3], 4), (slots[1], [44, 45, 46], 6), (slots[2], [7], 2)]
    batch = runner.run(windows).logits[:5].clone()
    alone = torch.cat([runner.run([(slot, ids, start)]).logits.clone() for slot, ids, start in windows])
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rows"):
        runner.run([(slots[0], [1] * 5, 4), (slots[1], [1] * 4, 6)])  # 9 rows > max_batch_rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs of decode batches need a CUDA device")
def test_decode_batch_graphs_give_each_row_its_one_row_bits():
    """On the GPU a decode batch (captured, padded to its bucket on the scratch slot) gives every
    row the same bits as that sequence's captured one-row step, and a verify batch (captured
    or eager) the same bits as each window alone."""
    config = ModelConfig.from_dict(CONFIG | dict(head_dim=16))
    model = load_model(config=config, random_weights=True, seed=5, dtype=torch.bfloat16, device="cuda")
    prompts = [[5, 17, 42, 8], [9, 1, 60, 33, 2, 70], [11, 12], [40, 41, 42]]
    pool, slots, scratch = _prefilled_pool(model, prompts, "cuda")
    runner = FusedRunner(FusedModel(model, max_rows=8, max_length=64), pool, max_rows=5, max_batch_rows=8,
                          scratch_slot=scratch, verify_window=3)
    runner.capture()
    assert sorted(runner.graphs) == [(1, 1, 1), (2, 1, 2), (2, 2, 1), (3, 1, 3), (4, 1, 4), (4, 4, 1), (4, 4, 3),
                                     (5, 1, 5), (8, 8, 1), (8, 8, 3)]
    assert sorted(runner.chained) == [(1, 1, 1), (2, 2, 1), (4, 4, 1), (8, 8, 1)]
    decode = [(slot, [20 + i], len(p)) for i, (slot, p) in enumerate(zip(slots, prompts))][:3]  # bucket 4, one pad
    batch = runner.run(decode).logits[:3].clone()
    alone = torch.cat([runner.run([(slot, ids, start)]).logits.clone() for slot, ids, start in decode])
    assert torch.equal(batch, alone)
    # decode-ahead: the chained batch step feeds each row's greedy token at its next position
    first = runner.run(decode)
    next_ids = first.greedy_ids[:3].tolist()
    chained = runner.run_next().logits[:3].clone()
    explicit = runner.run([(slot, [t], start + 1) for (slot, _, start), t in zip(decode, next_ids)])
    assert torch.equal(chained, explicit.logits[:3])
    for verify in ([(slots[0], [3, 4, 5], 4), (slots[1], [6], 6), (slots[3], [7, 8], 3)],  # the 8-row graph
                   [(slots[0], [3, 4, 5, 6], 4), (slots[2], [9], 2)]):  # a 4-row window: eager
        rows = sum(len(ids) for _, ids, _ in verify)
        batch = runner.run(verify).logits[:rows].clone()
        alone = torch.cat([runner.run([(slot, ids, start)]).logits.clone() for slot, ids, start in verify])
        assert torch.equal(batch, alone)


def test_chained_decode_batch_feeds_each_rows_greedy_token(model, fused):
    prompts = [[5, 17, 42, 8], [9, 1, 60]]
    pool, slots, scratch = _prefilled_pool(model, prompts, "cpu")
    runner = FusedRunner(fused, pool, max_rows=4, max_batch_rows=4, scratch_slot=scratch)
    decode = [(slots[0], [3], 4), (slots[1], [7], 3)]
    next_ids = runner.run(decode).greedy_ids[:2].tolist()
    chained = runner.run_next().logits[:2].clone()
    explicit = runner.run([(slot, [t], start + 1) for (slot, _, start), t in zip(decode, next_ids)]).logits[:2]
    torch.testing.assert_close(chained, explicit, rtol=1e-5, atol=1e-5)
    runner.run([(slots[0], [1, 2], 6)])  # a verify window: no decode step to chain
    with pytest.raises(ValueError, match="follows a decode step"):
        runner.run_next()


@pytest.fixture(params=["interpreter", "torch"])
def cpu_ops(request, monkeypatch):
    """The fused kernels' CPU code: in Triton's interpreter (the kernels themselves), or their
    torch references (what a service on a CPU runs)."""
    if request.param == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_cpu_rows_are_bit_identical_to_their_one_row_steps(model, path, cpu_ops):
    """Exact mode's invariance on the CPU: a window's rows carry exactly the logits of the
    one-row steps that decode the same tokens after the same prompt — the reference modules
    (row_invariant: one-row steps) and the fused path (invariant, its default: one forward,
    its products row by row) alike."""
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(4))
    fused = FusedModel(model, max_rows=16, max_length=64)

    def prefilled():
        cache = model.new_cache(40)
        model.prefill(prompt, cache)
        return cache

    def run(tokens, cache, start):
        if path == "reference":
            return model(tokens, cache, row_invariant=True)[0]
        return fused.forward(tokens, Rows.window(start, len(tokens), 0, "cpu"), cache.paged())[0]

    cache = prefilled()
    singles = torch.cat([run(ids[j : j + 1], cache, 20 + j) for j in range(len(ids))])
    for rows in (2, 6):
        window = run(ids[:rows], prefilled(), 20)
        if path == "fused" and cpu_ops == "interpreter":
            # (the interpreter's dots are numpy matmuls, whose sums follow the BLAS's kernels and
            # memory alignment — OpenBLAS' Haswell / Zen kernels sum a row by its place in the
            # tile: to float32 rounding, as tests/kernels/fused check the interpreted kernels)
            torch.testing.assert_close(window, singles[:rows], rtol=2e-5, atol=1e-4)
        else:
            assert torch.equal(window, singles[:rows]), rows


def test_cpu_batches_give_each_row_its_one_row_bits(model, fused, cpu_ops):
    prompts = [[5, 17, 42, 8], [9, 1, 60, 33, 2, 70], [11, 12]]
    pool, slots, scratch = _prefilled_pool(model, prompts, "cpu")
    runner = FusedRunner(fused, pool, max_rows=4, max_batch_rows=8, scratch_slot=scratch)
    windows = [(slots[0], [3, 50], 4), (slots[1], [44, 45, 46], 6), (slots[2], [7], 2)]
    batch = runner.run(windows).logits[:6].clone()
    singles = torch.cat([runner.run([(slot, [token], start + j)]).logits.clone()
                         for slot, ids, start in windows for j, token in enumerate(ids)])
    assert torch.equal(batch, singles)


def test_routing_options_of_one_row_keep_its_draft_flag():
    routing = RoutingOptions(moce=True, scale=0.5, draft_rows=torch.tensor([False, True, True]))
    one = routing.row(1)
    assert one.moce and one.scale == 0.5 and one.draft_rows.tolist() == [True]
    assert RoutingOptions().row(4) == RoutingOptions()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_embedded_models_cpu_batches_are_row_invariant(monkeypatch, dtype):
    """What a service on a CPU runs with the fused path: the embedded model, the torch references,
    two threads; windows of 1..17 rows and batches of mixed windows in one forward each give every
    row its one-row step's bits (DESIGN §11: the products run row by row, rowwise_linear)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load_model(None, dtype=dtype)
        c = model.config
        fused = FusedModel(model, max_rows=24, max_length=128)
        pool = KVPool(num_layers=c.num_hidden_layers, num_slots=5, max_length=128, num_kv_heads=c.num_key_value_heads,
                      head_dim=c.head_dim, dtype=dtype, device="cpu")
        runner = FusedRunner(fused, pool, max_rows=17, max_batch_rows=24)
        slots = [pool.acquire(128)[0] for _ in range(4)]
        g = torch.Generator().manual_seed(8)
        prompts = [torch.randint(0, c.vocab_size, (12 + 5 * i,), generator=g) for i in range(4)]
        for slot, prompt in zip(slots, prompts):
            fused.prefill(prompt, [(0, len(prompt), slot)], runner.kv)
        text = torch.randint(0, c.vocab_size, (4, 17), generator=g).tolist()
        singles = [torch.cat([runner.run([(slot, [token], len(prompt) + j)]).logits.clone()
                              for j, token in enumerate(ids)]) for slot, prompt, ids in zip(slots, prompts, text)]
        for rows in range(1, 18):
            assert torch.equal(runner.run([(slots[0], text[0][:rows], len(prompts[0]))]).logits, singles[0][:rows]), rows
        for sizes in ([1, 1, 1, 1], [5, 1, 3, 2], [2, 6], [1, 17], [4, 4, 4, 4]):
            windows = [(slots[i], text[i][:n], len(prompts[i])) for i, n in enumerate(sizes)]
            batch = runner.run(windows).logits
            want = torch.cat([singles[i][:n] for i, n in enumerate(sizes)])
            assert torch.equal(batch[: len(want)], want), sizes
    finally:
        torch.set_num_threads(previous)
