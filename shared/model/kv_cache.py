"""KV caches: a preallocated static cache for one sequence (with rollback), and a pool of
fixed slots whose per-slot views are such caches.

Shapes never change after construction, so decode and verify windows can run inside CUDA
graphs; `truncate(n)` after rejected drafts only moves the length (stale rows beyond it are
overwritten by the next window). A KVPool keeps every slot in one tensor per layer, so a
captured graph reads any slot through the same addresses (the slot is an input).
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

    @classmethod
    def view(cls, keys: Tensor, values: Tensor) -> KVCache:
        """A cache over existing [layers, max_length, kv_heads, head_dim] tensors (e.g. a pool slot)."""
        cache = cls.__new__(cls)
        cache.keys, cache.values = keys, values
        cache.max_length = keys.shape[1]
        cache.length = 0
        return cache

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


class KVPool:
    """num_slots caches of max_length positions in one [layers, slots, max_length, kv_heads,
    head_dim] tensor each for keys and values; a request holds one slot while it runs."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_length: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots < 1 or max_length < 1:
            raise ValueError(f"a KV pool needs num_slots >= 1 and max_length >= 1 (got {num_slots}, {max_length})")
        shape = (num_layers, num_slots, max_length, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_length = max_length
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def acquire(self, length: int) -> tuple[int, KVCache]:
        """Take a free slot; returns it and a KVCache view of its first `length` positions."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} KV slots are in use")
        if not 1 <= length <= self.max_length:
            raise ValueError(f"cache length {length} must lie in [1, {self.max_length}]")
        slot = self._free.pop()
        return slot, KVCache.view(self.keys[:, slot, :length], self.values[:, slot, :length])

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)

    def layers(self) -> list[tuple[Tensor, Tensor]]:
        """Per-layer (keys, values), each [slots, max_length, kv_heads, head_dim]."""
        return [(self.keys[i], self.values[i]) for i in range(self.keys.shape[0])]
