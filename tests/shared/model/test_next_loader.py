"""Loading Qwen3-Next and Qwen3.5-MoE checkpoints into the CPU reference trunk: what
transformers saves, and sharded checkpoints of both layouts (Qwen3.5's composite config and
language-model prefix, per-expert tensors, the MTP layer, a vision tensor skipped); what each
service loads (parts); bad checkpoints name the tensor."""

import pytest
import torch

from shared.model.families.hybrid.loader import load_next

from .next_checkpoints import with_mtp, write_checkpoint
from .test_qwen3_next import pair


def test_a_checkpoint_transformers_saved_loads_to_its_logits(tmp_path):
    reference, _ = pair("hybrid")
    reference.save_pretrained(tmp_path)
    model = load_next(tmp_path)
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(tokens.unsqueeze(0)).logits[0]
    logits, _ = model(tokens, model.new_cache(32))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_sharded_qwen3_5_checkpoint_loads_to_the_same_logits(tmp_path):
    _, source = pair("qwen3.5")
    write_checkpoint(tmp_path, source)
    model = load_next(tmp_path)
    assert model.config.linear_projection == "split"
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(6))
    expected, _ = source(tokens, source.new_cache(32))
    logits, _ = model(tokens, model.new_cache(32))
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("case", ["missing", "mis-shaped"])
def test_a_checkpoint_that_does_not_fit_names_its_tensor(tmp_path, case):
    _, source = pair("qwen3.5")
    name = "model.language_model.layers.2.self_attn.k_proj.weight"
    write_checkpoint(tmp_path, source, drop=name if case == "missing" else None,
                     reshape=name if case == "mis-shaped" else None)
    with pytest.raises(ValueError, match=rf"{case} tensors: .*layers.2.self_attn.k_proj.weight"):
        load_next(tmp_path)


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_the_mtp_layer_loads_and_each_service_loads_its_part(tmp_path, layout):
    """parts: the verifier's trunk without the MTP layer; a lean drafter's embeddings, MTP
    layer and lm_head, never the trunk; both compute what the whole model computes."""
    name = "hybrid" if layout == "qwen3_next" else "qwen3.5"
    source = with_mtp(pair(name)[1])
    write_checkpoint(tmp_path, source, layout)
    whole, trunk, lean = (load_next(tmp_path, parts=parts) for parts in ("all", "trunk", "mtp"))
    assert whole.mtp is not None and trunk.mtp is None and len(lean.layers) == 0 and lean.norm is None
    assert not any(n.startswith(("layers.", "norm.")) for n, _ in lean.named_parameters())
    size = {m: sum(p.numel() for p in m.parameters()) for m in (whole, trunk, lean)}
    assert size[lean] + size[trunk] == size[whole] + source.embed_tokens.weight.numel() + \
        (0 if source.config.tie_word_embeddings else source.lm_head.weight.numel())  # shared by both
    tokens = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(3))
    expected, hidden = source(tokens, source.new_cache(16))
    logits, _ = trunk(tokens, trunk.new_cache(16))
    assert torch.equal(logits, expected)
    want, _ = source.forward_mtp(hidden[:-1], tokens[1:], source.new_mtp_cache(16))
    got, _ = lean.forward_mtp(hidden[:-1], tokens[1:], lean.new_mtp_cache(16))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="without its trunk"):
        lean.new_cache(8)


def test_a_lean_drafter_of_a_checkpoint_without_mtp_loads_no_layer(tmp_path):
    """(It drafts by suffix lookup only: embeddings and lm_head, and nothing of the trunk.)"""
    write_checkpoint(tmp_path, pair("qwen3.5")[1])
    assert load_next(tmp_path).mtp is None
    lean = load_next(tmp_path, parts="mtp")
    assert lean.mtp is None and len(lean.layers) == 0
    with pytest.raises(ValueError, match="no MTP layer"):
        lean.new_mtp_cache(8)
