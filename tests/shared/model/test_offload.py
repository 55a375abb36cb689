"""Offloaded experts on the fused path (shared.model.offload): the same bits as all-resident,
groups when a window needs more experts than slots, the routing memory and its prefetches."""

import pytest
import torch

from shared.model import ModelConfig, load_model
from shared.model.experts import ExpertStore
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model.rows import Rows
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool
from shared.model.offload import RoutingMemory

CONFIG = dict(
    model_type="qwen3_moe", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0, norm_topk_prob=True,
    mtp_num_hidden_layers=1, mlp_only_layers=[1],
)


def models(slots: int, **options):
    config = ModelConfig.from_dict(CONFIG | options.pop("config", {}))
    return load_model(config=config, random_weights=True, seed=3, **options), load_model(
        config=config, random_weights=True, seed=3, num_expert_slots=slots, **options)


@pytest.fixture
def torch_reference_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def forward(fused: FusedModel, model, ids: torch.Tensor, window: int):
    cache = model.new_cache(48)
    model(ids[:-window], cache)  # prefill by the reference path
    return fused.forward(ids[-window:], Rows.window(len(ids) - window, window, 0, ids.device), cache.paged())


def store_of(model, layer=0) -> ExpertStore:
    return model.layers[layer].mlp.experts


@pytest.mark.parametrize("window", [1, 3, 8])
def test_offloaded_windows_are_the_all_resident_bits(torch_reference_ops, window):
    full, few = models(slots=2)  # 8 experts, top-2: windows of 3 and 8 rows need several groups
    ids = torch.randint(0, 97, (20 + window,), generator=torch.Generator().manual_seed(window))
    expected = forward(FusedModel(full, max_rows=8, max_length=64), full, ids, window)
    fused = FusedModel(few, max_rows=8, max_length=64)
    assert fused.offloaded and fused.offload.moe_layers == [0, 2]  # layer 1 is dense
    got = forward(fused, few, ids, window)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    misses = sum(store_of(few, i).counters.misses for i in (0, 2))
    assert misses > 0 and all(store_of(few, i).resident_mask().sum() == 2 for i in (0, 2))


def test_groups_run_the_triton_kernels_to_the_same_bits():
    """In Triton's interpreter: a group's launch leaves the other groups' routes unwritten
    (id -1), and only each route's own group's output is kept."""
    full, few = models(slots=3)
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(9))
    expected, _ = forward(FusedModel(full, max_rows=8, max_length=64), full, ids, 5)
    got, _ = forward(FusedModel(few, max_rows=8, max_length=64), few, ids, 5)
    assert torch.equal(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream and the Triton kernels need CUDA")
def test_offloaded_windows_on_the_gpu_are_the_all_resident_bits():
    full, few = models(slots=3, config=dict(head_dim=16), device="cuda", dtype=torch.bfloat16)
    assert few.layers[0].mlp.experts.copy_stream is few.layers[2].mlp.experts.copy_stream  # one per model
    resident = FusedModel(full, max_rows=8, max_length=64)
    offloaded = FusedModel(few, max_rows=8, max_length=64, expert_prefetch=True)
    for window in (1, 5, 8):
        ids = torch.randint(0, 97, (20 + window,), generator=torch.Generator().manual_seed(window)).cuda()
        for _ in range(2):  # the second time, the routing memory prefetches
            expected, got = forward(resident, full, ids, window), forward(offloaded, few, ids, window)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert offloaded.offload.counters.correct > 0
    assert sum(store_of(few, i).counters.prefetch_hits for i in (0, 2)) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_offloaded_windows_replay_as_graph_segments_on_the_gpu():
    full, few = models(slots=3, config=dict(head_dim=16), device="cuda", dtype=torch.bfloat16)
    runners, slots = [], []
    for model in (full, few):
        pool = KVPool(num_layers=3, num_slots=2, max_length=64, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16,
                      device="cuda")
        runner = FusedRunner(FusedModel(model, max_rows=8, max_length=64), pool, 5, use_graphs=True)
        runner.capture()
        runners.append(runner)
        slots.append(pool.acquire(64)[0])
    assert runners[0].graphs and not runners[1].graphs and runners[1].segments == {}
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    position = 0
    for window in (1, 1, 2, 1, 5, 2, 5, 1, 3, 3):  # a shape's first run is eager, later ones replay
        outs = [runner.run([(slot, ids[position : position + window], position)]) for runner, slot in zip(runners, slots)]
        assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
        position += window
    assert sorted(runners[1].segments) == [(1, 1, 1), (2, 1, 2), (3, 1, 3), (5, 1, 5)]
    assert sum(store_of(few, i).counters.misses for i in (0, 2)) > 0


def test_the_same_window_again_is_predicted_and_prefetched(torch_reference_ops):
    full, few = models(slots=4)
    fused = FusedModel(few, max_rows=8, max_length=64, expert_prefetch=True)
    assert FusedModel(few, max_rows=8, max_length=64).offload.memory is None  # off by default
    ids = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(2))
    cache = few.new_cache(48)
    few(ids[:12], cache)
    rows = Rows.window(12, 2, 0, "cpu")
    first, _ = fused.forward(ids[12:14], rows, cache.paged())
    counters = fused.offload.counters
    assert counters.predicted == 0 and counters.needed > 0  # nothing seen yet: no hints
    # Other windows move the slots, then the first window again (same positions, same routes):
    for start in (14, 12):
        fused.forward(ids[start : start + 2], Rows.window(start, 2, 0, "cpu"), cache.paged())
    assert counters.predicted > 0 and counters.precision == 1.0
    layer2 = store_of(few, 2).counters
    assert layer2.prefetched > 0 and layer2.prefetch_hits > 0  # layer 2's copies started during layer 0
    again, _ = fused.forward(ids[12:14], rows, cache.paged())
    assert torch.equal(again, first)  # prefetching changes no bit


def test_prefill_teaches_the_routing_memory(torch_reference_ops):
    _, few = models(slots=4)
    fused = FusedModel(few, max_rows=8, max_length=64, expert_prefetch=True)
    pool = KVPool(num_layers=3, num_slots=1, max_length=64, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  device="cpu")
    slot, _ = pool.acquire(32)
    prompt = torch.tensor([5, 6, 7, 8, 5, 6])
    fused.prefill(prompt, [(0, 6, slot)], pool.paged())
    memory = fused.offload.memory
    assert len(memory) == 2 * 4  # two MoE layers, four distinct tokens
    assert all(len(memory.predict(layer, [5])) == 2 for layer in (0, 2))


def test_offloaded_windows_run_eagerly(torch_reference_ops):
    _, few = models(slots=4)
    fused = FusedModel(few, max_rows=8, max_length=64)
    pool = KVPool(num_layers=3, num_slots=2, max_length=64, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  device="cpu")
    assert FusedRunner(fused, pool, 5, use_graphs=True).use_graphs is False


def test_routing_memory_votes_and_forgets():
    memory = RoutingMemory(num_layers=2, capacity=2)
    memory.record(0, [10, 11], [1, 2, 2, 3])  # token 10 -> (1, 2), token 11 -> (2, 3)
    assert memory.predict(0, [10, 11])[0] == 2  # named by both tokens: first
    assert sorted(memory.predict(0, [10, 11])) == [1, 2, 3]
    assert memory.predict(1, [10]) == []  # per layer
    memory.record(0, [12], [4, -1])  # a dropped route is no prediction; 10 is forgotten
    assert memory.predict(0, [10]) == [] and memory.predict(0, [12]) == [4]
    with pytest.raises(ValueError, match="capacity"):
        RoutingMemory(num_layers=1, capacity=0)


def store(num_slots=3):
    gate_up = torch.randn(8, 4, 4, generator=torch.Generator().manual_seed(0))
    down = torch.randn(8, 4, 2, generator=torch.Generator().manual_seed(1))
    return ExpertStore(gate_up, down, device="cpu", num_slots=num_slots)


def test_prefetch_counts_as_a_use_and_is_counted_when_it_pays():
    s = store()  # resident: 0, 1, 2
    assert s.prefetch([5, 1]) == 1  # 1 is resident (touched); 5 evicts 0
    assert s.resident_experts() == [2, 1, 5]
    assert (s.counters.prefetched, s.counters.misses) == (1, 0)
    s.ensure([5, 7])  # 5 was prefetched: a hit that paid; 7 misses and evicts 2
    assert (s.counters.hits, s.counters.misses, s.counters.prefetch_hits) == (1, 1, 1)
    assert s.prefetch([3, 4, 6, 0]) == 3  # at most num_slots, in order
    assert sorted(s.resident_experts()) == [3, 4, 6]
    s.ensure([3])
    assert s.counters.prefetch_hits == 2
    assert torch.equal(s.gate_up[s.slot(3)], s.host_gate_up[3])
    assert s.slot_of_expert.tolist().count(-1) == 5


@pytest.mark.parametrize("slots", [4, 2])
def test_segments_run_the_forward_between_route_reads(torch_reference_ops, slots):
    """The segmented forward (graphs between the host's route reads on CUDA; here eagerly) gives
    the plain forward's bits, over windows run again and again on the same input tensors; with
    2 slots a 3-row window needs several groups and finishes eagerly."""
    from shared.model.segments import SegmentedForward

    full, few = models(slots=slots)
    resident, offloaded = (FusedModel(m, max_rows=8, max_length=64) for m in (full, few))
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(slots))
    caches = [model.new_cache(48) for model in (full, few)]
    for model, cache in zip((full, few), caches):
        model(ids[:20], cache)
    token_ids, positions = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    rows = Rows(positions=positions, slots=torch.zeros(3, dtype=torch.int64), seq_starts=torch.tensor([0, 3]),
                seq_slots=torch.zeros(1, dtype=torch.int64), max_rows_per_seq=3)
    segmented = SegmentedForward(offloaded, token_ids, rows, caches[1].paged(), capture=False)
    for start in (20, 23, 26):
        token_ids.copy_(ids[start : start + 3])
        positions.copy_(torch.arange(start, start + 3))
        expected = resident.forward(token_ids, rows, caches[0].paged())
        got = segmented.run()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert len(segmented.outputs) == 3  # two MoE layers: three segments


def test_routes_map_to_slots_on_the_device():
    s = store()  # resident: 0, 1, 2
    s.ensure([6])  # evicts 0
    ids = torch.tensor([[6, -1], [2, 1]])
    assert s.slots_of(ids).tolist() == [[s.slot(6), -1], [s.slot(2), s.slot(1)]]
    assert s.resident_mask().tolist() == [e in (1, 2, 6) for e in range(8)]


def test_grouped_routes_run_a_fixed_expert_with_the_first_group_to_the_all_resident_bits(torch_reference_ops):
    """The hybrid family's prefill with experts in host memory: 3 of 8 routed experts in slots,
    the shared expert fixed after them (route id 8 on every row), through grouped GEMMs in groups
    — bit-identical to every expert resident in one store of 9 (what the resident prefill runs)."""
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(9, 32, 16, generator=g).bfloat16()  # the 8 routed experts, then the shared one
    down = torch.randn(9, 16, 16, generator=g).bfloat16()
    hidden = torch.randn(10, 16, generator=g).bfloat16()
    routed = torch.randint(0, 8, (10, 2), generator=g)
    expert_ids = torch.cat([routed, torch.full((10, 1), 8)], dim=1)  # [T, k + 1]
    resident = ExpertStore(gate_up, down, device="cpu")
    out, rows = resident.grouped_sorted(hidden, expert_ids)
    expected = out[rows]
    few = ExpertStore(gate_up[:8], down[:8], device="cpu", num_slots=3)
    few.with_fixed(gate_up[8:], down[8:])
    got = few.grouped_routes(hidden, expert_ids)
    assert torch.equal(got, expected)
    assert few.counters.misses >= len(set(routed.view(-1).tolist())) - 3


def test_grouped_gemms_over_slot_groups_are_the_all_resident_bits(torch_reference_ops):
    """Prefill's grouped GEMMs (torch._grouped_mm, on the CPU too) with 3 of 8 experts resident:
    groups of experts in turn over the same rows, bit-identical to every expert resident.
    (silu_mul by its torch code: the rows behind the last offset are never computed, and the
    interpreter warns about their garbage.)"""
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(8, 32, 16, generator=g).bfloat16()  # (16-byte strides: _grouped_mm's)
    down = torch.randn(8, 16, 16, generator=g).bfloat16()
    hidden = torch.randn(10, 16, generator=g).bfloat16()
    expert_ids = torch.randint(0, 8, (10, 2), generator=g)
    full = ExpertStore(gate_up, down, device="cpu")
    few = ExpertStore(gate_up, down, device="cpu", num_slots=3)
    expected = full.grouped_routes(hidden, expert_ids)
    assert torch.equal(few.grouped_routes(hidden, expert_ids), expected)
    assert few.counters.misses >= len(set(expert_ids.view(-1).tolist())) - 3
    weights = torch.rand(10, 2, generator=g)
    assert torch.equal(few.forward(hidden, expert_ids, weights, path="grouped"),
                       full.forward(hidden, expert_ids, weights, path="grouped"))


def test_grouped_fp8_experts_read_as_stored_are_their_dequantised_products_in_slot_groups_too():
    """Prefill's grouped path with FP8 experts (kernels.fused.grouped, in the interpreter here):
    every expert resident and 3 of 8 in slots give the dispatch path's outputs on the dequantised
    weights (float32 rounding: the interpreter's dots follow memory alignment), dropped routes of
    no expert left out of the sum as dispatch leaves them."""
    from kernels.fused.fp8 import cat_rows, quantize

    g = torch.Generator().manual_seed(4)
    gate = quantize(0.1 * torch.randn(8, 16, 32, generator=g), (16, 16))
    up = quantize(0.1 * torch.randn(8, 16, 32, generator=g), (16, 16))
    gate_up, down = cat_rows([gate, up]), quantize(0.1 * torch.randn(8, 32, 16, generator=g), (16, 16))
    hidden = torch.randn(30, 32, generator=g)
    expert_ids = torch.randint(0, 8, (30, 2), generator=g)
    weights = torch.rand(30, 2, generator=g)
    full = ExpertStore(gate_up, down, device="cpu")
    few = ExpertStore(gate_up, down, device="cpu", num_slots=3)
    expected = ExpertStore(gate_up.dequantize(), down.dequantize(), device="cpu").forward(
        hidden, expert_ids, weights, path="dispatch")
    for store in (full, few):
        torch.testing.assert_close(store.forward(hidden, expert_ids, weights, path="grouped"), expected,
                                   rtol=1e-5, atol=1e-5)
    assert few.counters.misses >= len(set(expert_ids.view(-1).tolist())) - 3
