"""Preallocated static KV cache for one sequence, with rollback.

Shapes never change after construction, so decode and verify windows can run inside CUDA
graphs; `truncate(n)` after rejected drafts only moves the length (stale rows beyond it are
overwritten by the next window).
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        max_length: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if max_length < 1:
            raise ValueError(f"max_length {max_length} must be >= 1")
        shape = (num_layers, max_length, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [layers, max_length, kv_heads, head_dim]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_length = max_length
        self.length = 0  # committed + window rows written so far

    def reserve(self, num_rows: int) -> int:
        """Claim the next `num_rows` positions; returns the first one."""
        if self.length + num_rows > self.max_length:
            raise ValueError(
                f"window of {num_rows} rows at position {self.length} exceeds the cache length {self.max_length}"
            )
        start = self.length
        self.length += num_rows
        return start

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` rows (e.g. drop the rows of rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        return self.keys[index], self.values[index]
