"""The Gated DeltaNet layer (shared.model.families.hybrid.deltanet) against transformers' Qwen3-Next layer on
the same weights: a whole sequence, the same rows fed in pieces from the carried state, and
rollback of a verify window to the state after its accepted rows."""

import pytest
import torch

from shared.model.families.hybrid.deltanet import GatedDeltaNet, RECURRENT_ROWS

SHAPES = dict(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4, eps=1e-6)


@pytest.fixture(scope="module")
def layers():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
                             layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    reference = Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(0, 0.3)
        reference.A_log.uniform_(-1, 1)
    ours = GatedDeltaNet(**SHAPES)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def hidden(rows, seed):
    return torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [5, RECURRENT_ROWS + 15])  # the recurrent form, and the chunked (prefill)
def test_a_sequence_matches_transformers(layers, rows):
    reference, ours = layers
    x = hidden(rows, rows)
    with torch.no_grad():
        expected = reference(x.unsqueeze(0))[0]
    out, _ = ours(x, ours.new_state())
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_rows_fed_in_pieces_from_the_carried_state_are_the_whole_sequences(layers):
    _, ours = layers
    x = hidden(60, 3)
    whole, final = ours(x, ours.new_state())
    state, parts = ours.new_state(), []
    for start, end in ((0, 40), (40, 41), (41, 46), (46, 60)):  # a prefill chunk, a decode row, windows
        out, state = ours(x[start:end], state)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.recurrent, final.recurrent, rtol=1e-4, atol=1e-5)
    assert torch.equal(state.conv, final.conv)


def test_a_verify_window_rolls_back_to_the_state_after_its_accepted_rows(layers):
    """A 5-row window (head + 4 drafts) of which 2 drafts are accepted: continuing from the
    window's state after row 2 gives what running only those 3 rows gives."""
    _, ours = layers
    x = hidden(30, 4)
    _, before = ours(x[:20], ours.new_state())
    _, states = ours(x[20:25], before, keep_states=True)
    assert len(states) == 5
    _, accepted = ours(x[20:23], before)
    kept = states[2]
    # (close, not equal: the projections of 5 rows and of 3 round differently on the CPU)
    torch.testing.assert_close(kept.conv, accepted.conv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kept.recurrent, accepted.recurrent, rtol=1e-5, atol=1e-6)
    after_kept, _ = ours(x[23:26], kept)  # the bonus token and the next window
    after_accepted, _ = ours(x[23:26], accepted)
    torch.testing.assert_close(after_kept, after_accepted, rtol=1e-5, atol=1e-6)


def test_value_heads_must_group_evenly():
    with pytest.raises(ValueError, match="linear_num_value_heads 5"):
        GatedDeltaNet(**(SHAPES | dict(num_v_heads=5)))
