"""The MTP layer both families' checkpoints carry (`mtp.*`), on the reference and fused paths.

x = fc(cat([norm_e(embed(token)), norm_h(h)])) → one decoder layer → mtp.norm → lm_head, h
the trunk's final-norm hidden row at the token's position (or the MTP's own output when it
chains drafts). The families differ only in the norm (qwen3_moe's RMSNorm, the hybrid's
zero-centred one) and in the decoder layer, which each passes in.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.fused.linear import linear
from kernels.fused.norm import add_rmsnorm
from shared.model.quantize import weight_of


class MTPLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, norm: type[nn.Module], layer: nn.Module) -> None:
        """norm: the family's RMSNorm class, (size, eps); layer: its decoder layer (attention + MoE)."""
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = norm(hidden_size, eps)
        self.pre_fc_norm_hidden = norm(hidden_size, eps)
        self.layers = nn.ModuleList([layer])
        self.norm = norm(hidden_size, eps)

    def inputs(self, embedded: Tensor, hidden: Tensor) -> Tensor:
        """The decoder layer's input [T, hidden] from the next tokens' embeddings and the hidden rows."""
        prior = self.pre_fc_norm_hidden(hidden.to(embedded.dtype))
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), prior], dim=-1))


def fused_mtp_inputs(mtp: MTPLayer, embedded: Tensor, hidden: Tensor, input_norm: Tensor, eps: float, *,
                     centred: bool, pdl: bool) -> tuple[Tensor, Tensor]:
    """MTPLayer.inputs through the fused kernels, then the decoder layer's input norm:
    (normed, residual) [T, hidden] entering its attention."""
    embedded, _ = add_rmsnorm(embedded, None, mtp.pre_fc_norm_embedding.weight, eps, centred=centred, pdl=pdl)
    prior, _ = add_rmsnorm(hidden.to(embedded.dtype), None, mtp.pre_fc_norm_hidden.weight, eps, centred=centred,
                           pdl=pdl)
    x = linear(torch.cat([embedded, prior], dim=-1), weight_of(mtp.fc), pdl=pdl)
    return add_rmsnorm(x, None, input_norm, eps, centred=centred, pdl=pdl)
