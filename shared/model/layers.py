"""Building blocks both families use: RMSNorm, the rotary tables, the dense SwiGLU MLP, and
how a forward routes its rows (DESIGN §5)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.model.quantize import Fp8Linear, fuse_fp8_rows


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

class Rotary(nn.Module):
    """cos/sin tables for every position up to max_positions, computed once in float32."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x [T, heads, head_dim] at positions [T]."""
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor, routing: RoutingOptions | None = None) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

@dataclass(frozen=True)
class RoutingOptions:
    """How one forward routes its rows (DESIGN §5). The default is full (exact) routing.

    moce: route with the expert store's residency map and these scales; draft_rows [T]
    marks the rows that get the draft-row rule. prompt_packed: the opt-in, lossy packed
    prompt value for prefill chunks (None = off).
    """

    moce: bool = False
    scale: float = 1.0
    r1_scale: float = 1.0
    protect: int = 0
    draft_rows: Tensor | None = None
    prompt_packed: float | None = None

    def row(self, index: int) -> RoutingOptions:
        """The options of row `index` alone (its draft-row flag, if any)."""
        if self.draft_rows is None:
            return self
        return replace(self, draft_rows=self.draft_rows[index : index + 1])


FULL_ROUTING = RoutingOptions()


def fuse_linear_rows(linears: list[nn.Module]):
    """Concatenate nn.Linear weights by rows and re-point each module at its view (the fused
    forwards' one GEMV for several projections; no copy kept, the reference modules unchanged).
    FP8 projections (shared.model.quantize.Fp8Linear) give an Fp8Weight, all or none of them."""
    fp8 = [isinstance(m, Fp8Linear) for m in linears]
    if any(fp8):
        if not all(fp8):
            raise ValueError("projections fused into one matrix are FP8 all or none (the loaders keep a group "
                             "FP8 only whole: shared.model.quantize.whole_groups)")
        return fuse_fp8_rows(linears)
    fused = torch.cat([m.weight.detach() for m in linears], dim=0).contiguous()
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused
