"""The hybrid family's routed experts in host memory (device slots) and MoCE on its draft rows
(issue 34): offloading changes no bit of the trunk, the MTP layer or prefill, on the reference
modules and on the fused path alike; MoCE moves draft rows only, the same on both paths. On a
CPU box the fused kernels run in Triton's interpreter."""

import pytest
import torch

from shared.model import RoutingOptions
from shared.model.families import build_fused
from shared.model.families.hybrid.config import NextConfig
from shared.model.families.hybrid.loader import expert_modules, offload_experts, random_next
from shared.model.kv_cache import KVPool
from shared.model.rows import Rows

CONFIG = dict(model_type="qwen3_5_moe_text", vocab_size=97, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=40,
              moe_intermediate_size=16, shared_expert_intermediate_size=12, num_experts=8, num_experts_per_tok=2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, max_position_embeddings=128,
              layer_types=["linear_attention", "full_attention"], partial_rotary_factor=0.25, rms_norm_eps=1e-6,
              mtp_num_hidden_layers=1)
SLOTS = 3  # of 8 experts a block
TOKENS = torch.tensor([5, 17, 3, 88, 41, 9, 60, 23, 71, 2, 33, 50])


def new_model(slots: int | None, quantize: str = "none"):
    """The same random weights (std 0.2: routes that matter), experts all resident or in slots
    (quantize "fp8": block-scaled FP8 weights, shared.model.quantize)."""
    model = random_next(NextConfig.from_dict(CONFIG), dtype=torch.float32, device="cpu", seed=4, std=0.2,
                        quantize=quantize)
    offload_experts(model, slots, torch.device("cpu"))
    return model


@pytest.fixture(scope="module")
def models():
    """(every expert resident, SLOTS of 8 resident) with the same weights."""
    return new_model(None), new_model(SLOTS)


def misses(model) -> int:
    return sum(experts.store.counters.misses for experts in expert_modules(model))


def on_pool(model):
    """(the model's fused forward, its KV pool of 2 slots, a slot acquired with a zero state)."""
    fused = build_fused(model, max_rows=8, max_length=64, num_state_slots=2)
    c = model.config
    pool = KVPool(num_layers=model.num_kv_layers, num_slots=2, max_length=64, num_kv_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, dtype=model.dtype, device=model.device, block_size=8)
    slot, length = pool.acquire(64)
    fused.states.reset(slot)
    length.reserve(8)
    return fused, pool, slot


def test_the_reference_modules_compute_the_same_bits_with_experts_in_host_memory(models):
    resident, few = models
    assert all(not e.store.all_resident and e.store.num_slots == SLOTS for e in expert_modules(few))
    want, hidden = resident(TOKENS, resident.new_cache(16))
    got, hidden_few = few(TOKENS, few.new_cache(16))
    assert torch.equal(got, want) and torch.equal(hidden_few, hidden)
    mtp_want, _ = resident.forward_mtp(hidden[:-1], TOKENS[1:], resident.new_mtp_cache(16))
    mtp_got, _ = few.forward_mtp(hidden[:-1], TOKENS[1:], few.new_mtp_cache(16))
    assert torch.equal(mtp_got, mtp_want)
    assert misses(few) > 0 and misses(resident) == 0


def _run_fused(model, routing=None):
    """Prefill 8 tokens, a 4-row verify window, then MTP rows: (window logits, MTP logits)."""
    fused, pool, slot = on_pool(model)
    c = model.config
    hidden = fused.prefill(TOKENS[:8], [(0, 8, slot)], pool.paged())
    read, write = fused.states.buffers(slot)
    rows = Rows.window(8, 4, slot, "cpu")
    rows = Rows(**{**rows.__dict__, "state_in": torch.tensor([read]), "state_out": torch.tensor([write])})
    logits, _ = fused.forward(TOKENS[8:], rows, pool.paged())
    mtp_pool = KVPool(num_layers=1, num_slots=1, max_length=64, num_kv_heads=c.num_key_value_heads,
                      head_dim=c.head_dim, dtype=model.dtype, device="cpu", block_size=8)
    mtp_slot, _ = mtp_pool.acquire(64)
    mtp_logits, _ = fused.forward_mtp(hidden[:6], TOKENS[1:7], Rows.window(0, 6, mtp_slot, "cpu"), mtp_pool.paged(),
                                      routing)
    return fused, logits, mtp_logits


def test_the_fused_path_computes_the_same_bits_with_experts_in_host_memory(models):
    resident, few = models
    fused_all, want, mtp_want = _run_fused(resident)
    before = misses(few)
    fused_few, got, mtp_got = _run_fused(few)
    assert fused_all.offload is None and fused_few.offload is not None and fused_few.mtp_offload is not None
    assert torch.equal(got, want) and torch.equal(mtp_got, mtp_want)
    assert misses(few) > before  # (8 prompt rows route to more experts than 3 slots: groups in turn)


def test_fp8_experts_in_host_memory_compute_the_resident_bits_on_both_paths():
    resident, few = new_model(None, "fp8"), new_model(SLOTS, "fp8")
    assert all(e.store.fp8 and not e.store.all_resident for e in expert_modules(few))
    want, _ = resident(TOKENS, resident.new_cache(16))
    assert torch.equal(few(TOKENS, few.new_cache(16))[0], want)
    _, fused_want, mtp_want = _run_fused(resident)
    _, fused_got, mtp_got = _run_fused(few)
    assert torch.equal(fused_got, fused_want) and torch.equal(mtp_got, mtp_want)
    assert misses(few) > 0


def test_moce_routes_draft_rows_toward_resident_experts_alike_on_both_paths(models):
    """MoCE (scale 3) on the MTP layer of the model with 3 of 8 experts resident, row by row from
    the same residency map on both paths (a forward's misses change the map): the fused path's
    logits are the reference's, they differ from full routing's, and at scale 1 (no boost) MoCE
    is full routing bit for bit."""
    _, few = models
    store = few.mtp.layers[0].mlp.store
    hidden = few(TOKENS, few.new_cache(16))[1]
    c = few.config
    fused = build_fused(few, max_rows=8, max_length=64)
    pool = KVPool(num_layers=1, num_slots=1, max_length=64, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                  dtype=few.dtype, device="cpu", block_size=8)
    slot, _ = pool.acquire(64)
    draft = RoutingOptions(moce=True, scale=3.0, draft_rows=torch.ones(1, dtype=torch.bool))
    unboosted = RoutingOptions(moce=True, scale=1.0, draft_rows=torch.ones(1, dtype=torch.bool))
    caches = {name: few.new_mtp_cache(16) for name in ("moce", "unboosted", "full")}
    moved = 0
    for i in range(6):
        h, token = hidden[i : i + 1], TOKENS[i + 1 : i + 2]
        store.ensure([1, 4, 6])
        want, _ = few.forward_mtp(h, token, caches["moce"], routing=draft)
        store.ensure([1, 4, 6])
        got, _ = fused.forward_mtp(h, token, Rows.window(i, 1, slot, "cpu"), pool.paged(), draft)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        full, _ = few.forward_mtp(h, token, caches["full"])
        plain, _ = few.forward_mtp(h, token, caches["unboosted"], routing=unboosted)
        assert torch.equal(plain, full)
        moved += not torch.allclose(want, full, rtol=1e-3, atol=1e-4)
    assert moved > 0


def test_the_resident_bytes_count_the_device_slots_not_the_host_copies(models):
    from shared.model.loader import resident_bytes

    resident, few = models
    expert = expert_modules(resident)[0].store.expert_bytes
    blocks = len(expert_modules(resident))
    # every block keeps SLOTS of its 8 experts (and, once fused, the shared expert beside them)
    fixed = sum(e.store.num_fixed for e in expert_modules(few)) - sum(e.store.num_fixed for e in expert_modules(resident))
    assert resident_bytes(resident) - resident_bytes(few) == (8 - SLOTS) * blocks * expert - fixed * expert


def test_the_shared_expert_maps_to_its_fixed_slot_on_the_device(models):
    """slots_of (what graph segments gather) sends the shared expert's route id E to its slot after
    the routed slots; a dropped route (-1) stays -1; routed experts go to their slots."""
    _, few = models
    build_fused(few, max_rows=8, max_length=64)  # (fusing puts the shared expert beside the slots)
    store = expert_modules(few)[0].store
    store.ensure([5])
    ids = torch.tensor([[5, 8], [-1, 8]])
    assert store.slots_of(ids).tolist() == [[store.slot(5), SLOTS], [-1, SLOTS]]
    assert store.resident_mask().shape == (8,)


@pytest.fixture
def torch_reference_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("window", [1, 3])
def test_segments_run_the_hybrid_forward_between_route_reads(models, torch_reference_ops, window):
    """The segmented forward (graphs between the host's route reads on CUDA; here eagerly, on
    fixed input tensors) gives the all-resident forward's bits for Gated DeltaNet and gated
    attention layers alike, run again and again from one committed state (a replayed segment
    rewrites the same state buffer); a 3-row window needs more experts than 3 slots in some
    layer and finishes eagerly, in groups."""
    from shared.model.segments import SegmentedForward

    resident, few = models
    c = resident.config
    runs = []
    for model in (resident, few):
        fused, pool, slot = on_pool(model)
        fused.prefill(TOKENS[:8], [(0, 8, slot)], pool.paged())
        read, write = fused.states.buffers(slot)
        token_ids = torch.zeros(window, dtype=torch.int64)
        rows = Rows(positions=torch.arange(8, 8 + window), slots=torch.full((window,), slot),
                    seq_starts=torch.tensor([0, window], dtype=torch.int32), seq_slots=torch.tensor([slot]),
                    max_rows_per_seq=window, state_in=torch.tensor([read]), state_out=torch.tensor([write]))
        runs.append((fused, token_ids, rows, pool.paged()))
    (full, full_ids, full_rows, full_kv), (offloaded, ids, rows, kv) = runs
    assert offloaded.segmented_offload and offloaded.offload is not None
    segmented = SegmentedForward(offloaded, ids, rows, kv, capture=False)
    assert len(segmented.outputs) == c.num_hidden_layers + 1  # every layer routes: a segment each, and one more
    eager_from = segmented._eager_from
    eager = []
    segmented._eager_from = lambda segment: eager.append(segment) or eager_from(segment)
    before = misses(few)
    generator = torch.Generator().manual_seed(window)
    for _ in range(3):
        draw = torch.randint(0, c.vocab_size, (window,), generator=generator)
        full_ids.copy_(draw)
        ids.copy_(draw)
        want_logits, want_hidden = full.forward(full_ids, full_rows, full_kv)
        logits, hidden = segmented.run()
        assert torch.equal(logits, want_logits) and torch.equal(hidden, want_hidden)
        assert torch.equal(offloaded.states.rec, full.states.rec) and torch.equal(offloaded.states.conv,
                                                                                  full.states.conv)
    assert misses(few) > before  # experts were copied in (and the segments after them replayed)
    assert (len(eager) > 0) == (window == 3)  # one row's 2 routes fit 3 slots; 3 rows' do not always
    # a prefill after segmented windows reads its own routes (none of the last window's carry over)
    for fused, _, rows, kv in runs:
        fused.states.reset(1)
        runs_hidden = fused.prefill(TOKENS[2:9], [(0, 7, 1)], kv)
        if fused is full:
            want = runs_hidden
    assert torch.equal(runs_hidden, want)


def test_grouped_prefill_with_experts_in_host_memory_is_the_all_resident_bits(monkeypatch, torch_reference_ops):
    """Prefill's grouped expert GEMMs (the GPU's path; torch._grouped_mm runs bf16 on the CPU
    too): with 3 of 8 experts a block in slots, groups of them in turn and the shared expert
    with the first group give the resident prefill's hidden rows and linear states bit for bit."""
    from shared.model.families.hybrid.fused import HybridFused

    monkeypatch.setattr(HybridFused, "_grouped_prefill", lambda self: True)
    out = []
    for num_slots in (None, SLOTS):
        model = random_next(NextConfig.from_dict(CONFIG), dtype=torch.bfloat16, device="cpu", seed=4, std=0.2)
        offload_experts(model, num_slots, torch.device("cpu"))
        fused, pool, slot = on_pool(model)
        out.append((fused.prefill(TOKENS, [(0, len(TOKENS), slot)], pool.paged()), fused.states.rec.clone(), model))
    (want, want_rec, _), (got, got_rec, few) = out
    assert torch.equal(got, want) and torch.equal(got_rec, want_rec)
    assert misses(few) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_offloaded_hybrid_windows_replay_as_graph_segments_on_the_gpu():
    """Through the window runner the service uses: with 3 of 8 experts a block in device slots,
    each window shape's first run is eager and later runs replay graph segments; every window
    (verify windows rolled back to a row, one-row steps, decode-ahead chains) gives the
    all-resident model's bits, and the committed linear states stay equal."""
    from shared.model.graphs import FusedRunner

    runners, slots = [], []
    for num_slots in (None, SLOTS):
        model = random_next(NextConfig.from_dict(CONFIG), dtype=torch.bfloat16, device="cuda", seed=4, std=0.2)
        offload_experts(model, num_slots, torch.device("cuda"))
        c = model.config
        fused = build_fused(model, max_rows=8, max_length=64, num_state_slots=2)
        pool = KVPool(num_layers=model.num_kv_layers, num_slots=2, max_length=64, num_kv_heads=c.num_key_value_heads,
                      head_dim=c.head_dim, dtype=model.dtype, device="cuda")
        runner = FusedRunner(fused, pool, 5, use_graphs=True)
        runner.capture()
        slot, _ = runner.acquire(64)
        runners.append(runner)
        slots.append(slot)
    assert runners[0].graphs and not runners[1].graphs and runners[1].segments == {}
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    position = 0
    # (window, rows kept): a shape's first run is eager, later ones replay its segments
    for window, kept in ((1, 1), (1, 1), (3, 2), (1, 1), (5, 3), (3, 3), (5, 5), (1, 1), (3, 1), (5, 2)):
        outs = [runner.run([(slot, ids[position : position + window], position)]) for runner, slot in zip(runners, slots)]
        assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
        for runner, slot in zip(runners, slots):
            runner.settle(slot, kept - 1 if window > 1 else None)
        position += kept
    for runner, slot in zip(runners, slots):
        runner.run([(slot, ids[position : position + 1], position)])
    chained = [runner.run_next() for runner in runners]
    assert torch.equal(chained[0].logits, chained[1].logits)
    assert sorted(runners[1].segments) == [(1, 1, 1), (3, 1, 3), (5, 1, 5)]
    assert torch.equal(runners[0].states.rec, runners[1].states.rec)
    assert misses(runners[1].fused.model) > 0
