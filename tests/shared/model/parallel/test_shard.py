"""What one rank of a split model holds (shared.model.parallel.shard, DESIGN §13): its experts
read from the checkpoint and nothing else, its heads' rows and columns, its config's view."""

import pytest
import torch
from safetensors.torch import save_file

from shared.model import ModelConfig, load_model
from shared.model.parallel.shard import Shard, check_shardable, expert_table


def test_a_share_must_divide():
    assert Shard(1, 2).part(8, "num_experts") == range(4, 8)
    with pytest.raises(ValueError, match="num_experts \\(6\\) is not divisible by --parallel 4"):
        Shard(0, 4).part(6, "num_experts")
    with pytest.raises(ValueError, match="rank 2"):
        Shard(2, 2)
    with pytest.raises(ValueError, match="parallel size 0"):
        Shard(0, 0)


def test_unsplittable_configs_name_their_field(split_checkpoint):
    _, raw = split_checkpoint
    config = ModelConfig.from_dict(raw)
    check_shardable(config, Shard(0, 2))
    with pytest.raises(ValueError, match="num_key_value_heads \\(2\\)"):
        check_shardable(config, Shard(0, 4))
    check_shardable(config, Shard(0, 4, dense="whole"))  # (whole dense weights: only the experts split)
    with pytest.raises(ValueError, match="intermediate_size \\(48\\)"):
        check_shardable(ModelConfig.from_dict(raw | {"num_experts": 32, "num_attention_heads": 32,
                                                     "num_key_value_heads": 32}), Shard(0, 32))
    with pytest.raises(ValueError, match="parallel_dense 'half'"):
        Shard(0, 2, dense="half")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_loads_its_share_of_the_checkpoint(split_checkpoint, rank):
    path, raw = split_checkpoint
    whole = load_model(path, parts="trunk")
    share = load_model(path, parts="trunk", shard=Shard(rank, 2))
    assert share.shard == Shard(rank, 2)
    assert (share.config.num_attention_heads, share.config.num_key_value_heads) == (2, 1)
    d = raw["head_dim"]
    q, kv = slice(rank * 2 * d, (rank + 1) * 2 * d), slice(rank * d, (rank + 1) * d)
    inter = slice(rank * 24, (rank + 1) * 24)
    experts = slice(rank * 4, (rank + 1) * 4)
    for full, part in zip(whole.layers, share.layers):
        a, b = full.self_attn, part.self_attn
        assert (b.num_heads, b.num_kv_heads) == (2, 1)
        assert torch.equal(b.q_proj.weight, a.q_proj.weight[q])
        assert torch.equal(b.k_proj.weight, a.k_proj.weight[kv])
        assert torch.equal(b.v_proj.weight, a.v_proj.weight[kv])
        assert torch.equal(b.o_proj.weight, a.o_proj.weight[:, q])
        assert torch.equal(b.q_norm.weight, a.q_norm.weight)
        if hasattr(full.mlp, "gate_proj"):  # the dense layer: its share of the intermediate
            assert torch.equal(part.mlp.gate_proj.weight, full.mlp.gate_proj.weight[inter])
            assert torch.equal(part.mlp.up_proj.weight, full.mlp.up_proj.weight[inter])
            assert torch.equal(part.mlp.down_proj.weight, full.mlp.down_proj.weight[:, inter])
        else:  # the router whole, the experts the rank's
            assert torch.equal(part.mlp.gate.weight, full.mlp.gate.weight)
            assert part.mlp.store.num_experts == 4
            assert torch.equal(part.mlp.store.gate_up, full.mlp.store.gate_up[experts])
            assert torch.equal(part.mlp.store.down, full.mlp.store.down[experts])
    # the lm_head: the rank's share of the 97-token vocabulary, 49 rows (rank 1's last one zero)
    share_rows = whole.lm_head.weight[rank * 49 : (rank + 1) * 49]
    assert share.lm_head.weight.shape == (49, raw["hidden_size"])
    assert torch.equal(share.lm_head.weight[: share_rows.shape[0]], share_rows)
    assert not share.lm_head.weight[share_rows.shape[0] :].any()
    assert torch.equal(share.embed_tokens.weight, whole.embed_tokens.weight)  # (tied: the look-up stays whole)


def test_a_rank_with_whole_dense_weights_keeps_all_but_its_experts(split_checkpoint):
    path, _ = split_checkpoint
    whole = load_model(path, parts="trunk")
    share = load_model(path, parts="trunk", shard=Shard(1, 2, dense="whole"))
    assert (share.config.num_attention_heads, share.config.num_key_value_heads) == (4, 2)
    for full, part in zip(whole.layers, share.layers):
        assert torch.equal(part.self_attn.o_proj.weight, full.self_attn.o_proj.weight)
        assert torch.equal(part.self_attn.k_proj.weight, full.self_attn.k_proj.weight)
        if hasattr(full.mlp, "gate_proj"):
            assert torch.equal(part.mlp.down_proj.weight, full.mlp.down_proj.weight)
    assert torch.equal(share.lm_head.weight, whole.lm_head.weight)
    assert share.layers[0].mlp.store.num_experts == 4


def test_random_weights_split_like_the_whole_model(split_checkpoint):
    _, raw = split_checkpoint
    config = ModelConfig.from_dict(raw)
    whole = load_model(config=config, random_weights=True, seed=5, parts="trunk")
    share = load_model(config=config, random_weights=True, seed=5, parts="trunk", shard=Shard(1, 2))
    assert torch.equal(share.layers[0].mlp.store.gate_up, whole.layers[0].mlp.store.gate_up[4:])
    assert torch.equal(share.layers[2].self_attn.k_proj.weight, whole.layers[2].self_attn.k_proj.weight[8:])


def test_expert_table_maps_owned_experts_and_drops_the_others():
    table = expert_table(8, Shard(1, 2), torch.device("cpu"))
    assert table.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]


def test_what_cannot_be_split_says_so(split_checkpoint, split_hybrid_checkpoints):
    path, _ = split_checkpoint
    with pytest.raises(ValueError, match="verifier's trunk"):
        load_model(path, parts="all", shard=Shard(0, 2))
    with pytest.raises(ValueError, match="verifier's trunk"):
        load_model(split_hybrid_checkpoints["hybrid"], parts="all", shard=Shard(0, 2))
    with pytest.raises(ValueError, match="num_experts \\(8\\) is not divisible by --parallel 3"):
        load_model(split_hybrid_checkpoints["hybrid"], parts="trunk", shard=Shard(0, 3))


def hybrid_experts(model) -> list:
    return [layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("name", ["hybrid", "qwen3.5"])
def test_a_hybrid_rank_loads_its_routed_experts_and_whole_mixers(split_hybrid_checkpoints, name):
    path = split_hybrid_checkpoints[name]
    whole = load_model(path, parts="trunk")
    share = load_model(path, parts="trunk", shard=Shard(1, 2, dense="whole"))
    assert share.shard == Shard(1, 2, dense="whole")
    for full, part in zip(hybrid_experts(whole), hybrid_experts(share)):
        assert torch.equal(part.gate_up_proj, full.gate_up_proj[4:])
        assert torch.equal(part.down_proj, full.down_proj[4:])
    mixers = {n: p for n, p in whole.named_parameters() if "experts" not in n}
    for n, p in share.named_parameters():
        if "experts" not in n and n != "lm_head.weight":  # token mixers, routers, the shared expert: whole
            assert torch.equal(p, mixers[n]), n
    assert torch.equal(share.lm_head.weight, whole.lm_head.weight)


@pytest.mark.parametrize("name", ["hybrid", "qwen3.5"])
def test_a_hybrid_rank_keeps_its_heads_of_every_mixer(split_hybrid_checkpoints, name):
    """Dense weights split: rank 1 of 2 keeps key head 1 of 2, value heads 2-3 of 4, query heads
    2-3 of 4 (each its query then its gate) and KV head 1 of 2 (Qwen3-Next's grouped projections
    compared in Qwen3.5's layout)."""
    from shared.model.families.hybrid.layout import split_grouped

    path = split_hybrid_checkpoints[name]
    whole = load_model(path, parts="trunk")
    share = load_model(path, parts="trunk", shard=Shard(1, 2))
    c = share.config
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.num_attention_heads, c.num_key_value_heads) == (1, 2, 2, 1)
    for full, part in zip(whole.layers, share.layers):
        if full.linear:
            a, b = full.linear_attn, part.linear_attn
            if a.layout == "grouped":
                split_grouped(a)
            dk, dv, key_dim = a.head_k_dim, a.head_v_dim, a.key_dim
            channels = torch.cat([torch.arange(dk, 2 * dk), key_dim + torch.arange(dk, 2 * dk),
                                  2 * key_dim + torch.arange(2 * dv, 4 * dv)])
            assert torch.equal(b.in_proj_qkv.weight, a.in_proj_qkv.weight[channels])
            assert torch.equal(b.conv1d.weight, a.conv1d.weight[channels])
            assert torch.equal(b.in_proj_z.weight, a.in_proj_z.weight[2 * dv : 4 * dv])
            assert torch.equal(b.in_proj_b.weight, a.in_proj_b.weight[2:4])
            assert torch.equal(b.A_log, a.A_log[2:4]) and torch.equal(b.dt_bias, a.dt_bias[2:4])
            assert torch.equal(b.out_proj.weight, a.out_proj.weight[:, 2 * dv : 4 * dv])
            assert torch.equal(b.norm.weight, a.norm.weight)
            assert (b.num_k_heads, b.num_v_heads, b.conv_dim) == (1, 2, 2 * dk + 2 * dv)
        else:
            a, b = full.self_attn, part.self_attn
            d = a.head_dim
            assert torch.equal(b.q_proj.weight, a.q_proj.weight[2 * 2 * d : 4 * 2 * d])
            assert torch.equal(b.k_proj.weight, a.k_proj.weight[d : 2 * d])
            assert torch.equal(b.o_proj.weight, a.o_proj.weight[:, 2 * d : 4 * d])
    vocab = whole.lm_head.weight.shape[0]  # 97: shares of 49 rows, rank 1's last one padding
    assert torch.equal(share.lm_head.weight[:48], whole.lm_head.weight[49:vocab])
    assert not share.lm_head.weight[48:].any()


def test_a_hybrid_rank_reads_its_rows_of_fused_expert_tensors(split_hybrid_checkpoints, tmp_path):
    """Checkpoints that store each layer's experts as one [E, ...] tensor (as transformers may
    save them): the rank's rows of each."""
    whole = load_model(split_hybrid_checkpoints["hybrid"], parts="trunk")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((split_hybrid_checkpoints["hybrid"] / "config.json").read_text())
    state = {f"model.{n}": p.contiguous() for n, p in whole.state_dict().items() if not n.startswith("rotary")}
    state["lm_head.weight"] = state.pop("model.lm_head.weight")
    save_file(state, str(fused / "model.safetensors"))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    share = load_model(fused, parts="trunk", shard=Shard(0, 2))
    for full, part in zip(hybrid_experts(whole), hybrid_experts(share)):
        assert torch.equal(part.gate_up_proj, full.gate_up_proj[:4])
        assert torch.equal(part.down_proj, full.down_proj[:4])


def test_hybrid_random_weights_split_like_the_whole_model(next_configs):
    from shared.model.families.hybrid.config import NextConfig

    config = NextConfig.from_dict(next_configs["qwen3.5"] | dict(shared_expert_intermediate_size=16))
    whole = load_model(config=config, random_weights=True, seed=4, parts="trunk")
    share = load_model(config=config, random_weights=True, seed=4, parts="trunk", shard=Shard(1, 2))
    for full, part in zip(hybrid_experts(whole), hybrid_experts(share)):
        assert torch.equal(part.gate_up_proj, full.gate_up_proj[4:])
    assert torch.equal(share.embed_tokens.weight, whole.embed_tokens.weight)
    full, part = whole.layers[0].linear_attn, share.layers[0].linear_attn  # (a Gated DeltaNet layer)
    dv = full.head_v_dim
    assert torch.equal(part.out_proj.weight, full.out_proj.weight[:, 2 * dv :])
    assert share.config.linear_num_value_heads == 2
    # FP8 random weights are cut before each module is quantized (an 80B-A3B model split so)
    fp8 = load_model(config=config, random_weights=True, seed=4, parts="trunk", shard=Shard(1, 2), quantize="fp8")
    assert fp8.layers[0].linear_attn.num_v_heads == 2 and fp8.config.num_key_value_heads == 1
