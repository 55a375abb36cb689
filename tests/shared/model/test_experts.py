"""Expert store: LRU slots, counters, residency mask, identical outputs with few slots."""

import pytest
import torch

from shared.model import load_model
from shared.model.experts import ExpertStore


def store(num_experts=8, num_slots=3, hidden=4, inter=2):
    gate_up = torch.arange(num_experts, dtype=torch.float32)[:, None, None].expand(num_experts, 2 * inter, hidden).clone()
    down = torch.arange(num_experts, dtype=torch.float32)[:, None, None].expand(num_experts, hidden, inter).clone()
    return ExpertStore(gate_up, down, device="cpu", num_slots=num_slots)


def test_lru_replacement_and_counters():
    s = store()
    assert s.resident_experts() == [0, 1, 2]
    s.ensure([1])
    assert s.resident_experts() == [0, 2, 1]
    s.ensure([5])  # evicts the least recently used: 0
    assert s.resident_experts() == [2, 1, 5]
    s.ensure([2, 6])  # 2 hits; 6 evicts 1 (2 was just used)
    assert s.resident_experts() == [5, 2, 6]
    assert (s.counters.hits, s.counters.misses) == (2, 2)
    assert s.counters.bytes_moved == 5 * s.expert_bytes  # 3 initial loads + 2 misses
    assert s.counters.hit_rate == 0.5


def test_residency_mask_matches_slots():
    s = store()
    s.ensure([7, 4])
    mask = s.resident_mask()
    assert mask.tolist() == [e in s.resident_experts() for e in range(8)]
    for expert in s.resident_experts():
        slot = int(s.slot_of_expert[expert])
        assert torch.equal(s.gate_up[slot], s.host_gate_up[expert])


def test_too_many_experts_at_once():
    with pytest.raises(ValueError, match="only 3 slots"):
        store().ensure([0, 1, 2, 3])


def test_bad_slot_count():
    with pytest.raises(ValueError, match="num_slots"):
        store(num_slots=9)


def test_outputs_identical_with_a_quarter_of_the_slots(mtp_checkpoint):
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(0))
    full = load_model(mtp_checkpoint)
    few = load_model(mtp_checkpoint, num_expert_slots=2)  # 8 experts, top-2: 25% of the slots
    expected, hidden = full.score(ids)
    cache = few.new_cache(32)
    rows = [few(ids[i : i + 1], cache)[0] for i in range(24)]  # one token at a time: top-2 fits 2 slots
    assert torch.equal(torch.cat(rows), torch.cat([full(ids[i : i + 1], c)[0] for c in [full.new_cache(32)] for i in range(24)]))
    stores = [layer.mlp.experts for layer in few.layers]
    assert sum(s.counters.misses for s in stores) > 0  # experts really moved
    assert all(s.resident_mask().sum() == 2 for s in stores)
    assert (torch.cat(rows) - expected).abs().max() < 1e-4


def test_gather_path_matches_dispatch(mtp_checkpoint):
    """The sync-free gather path (used on CUDA) computes the same MoE output on the CPU."""
    model = load_model(mtp_checkpoint)
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(4))
    stores = [layer.mlp.experts for layer in model.layers]
    expected, _ = model.score(ids)
    for s in stores:
        s.path = "gather"
    logits, _ = model.score(ids)
    assert (logits - expected).abs().max() < 1e-5
    with pytest.raises(ValueError, match="expert path"):
        stores[0].forward(torch.zeros(1, 32), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2), path="bogus")


def test_a_block_needing_more_experts_than_slots_streams_them(mtp_checkpoint):
    """A prompt's rows route to more distinct experts than there are slots: each expert is
    loaded just before its rows run, and the output is the all-resident one (the drafter's
    catch-up over a prompt once failed here: "13 distinct experts needed at once")."""
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(1))
    full = load_model(mtp_checkpoint)
    few = load_model(mtp_checkpoint, num_expert_slots=2)
    expected, _ = full.score(ids)
    got, _ = few.score(ids)  # 24 rows at once, top-2 of 8 experts: far more than 2 distinct
    assert torch.equal(got, expected)
    assert sum(layer.mlp.experts.counters.misses for layer in few.layers) >= 6
