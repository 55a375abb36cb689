"""KV caches: a preallocated static cache for one sequence (with rollback), and a paged pool
of fixed-size blocks that many sequences share through per-sequence block tables.

Shapes never change after construction, so decode and verify windows can run inside CUDA
graphs; `truncate(n)` after rejected drafts only moves the length (stale rows beyond it are
overwritten by the next window, in blocks the sequence keeps). A KVPool keeps every block in
one tensor per layer and every sequence's block table in one device tensor, so a captured
graph reads any sequence through the same addresses (its table row, the "slot", is an input).

A sequence holds the blocks for its whole reservation (prompt + completion + one window),
taken when it starts and returned when it ends: a request admitted never runs out of KV,
and memory follows what requests ask for rather than max_sessions x max_context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.fused import cdiv


class CacheLength:
    """The length bookkeeping of one sequence's cache: positions written and the limit."""

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"max_length {max_length} must be >= 1")
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


class KVCache(CacheLength):
    """One sequence's keys and values, [layers, max_length, kv_heads, head_dim] each."""

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
        super().__init__(max_length)
        shape = (num_layers, max_length, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [layers, max_length, kv_heads, head_dim]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._paged: PagedKV | None = None

    @classmethod
    def view(cls, keys: Tensor, values: Tensor) -> KVCache:
        """A cache over existing [layers, max_length, kv_heads, head_dim] tensors."""
        cache = cls.__new__(cls)
        CacheLength.__init__(cache, keys.shape[1])
        cache.keys, cache.values = keys, values
        cache._paged = None
        return cache

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        return self.keys[index], self.values[index]

    def paged(self) -> PagedKV:
        """This cache as the fused kernels read it: one block of max_length positions, slot 0."""
        if self._paged is None:  # (made once: the drafter's MTP steps read it every forward)
            table = torch.zeros((1, 1), dtype=torch.int32, device=self.keys.device)
            self._paged = PagedKV([(self.keys[i].unsqueeze(0), self.values[i].unsqueeze(0))
                                   for i in range(self.keys.shape[0])], table)
        return self._paged


@dataclass(frozen=True)
class PagedKV:
    """What the fused kernels read and write: per layer (keys, values), each [num_blocks,
    block_size, kv_heads, head_dim], and the block tables [num_slots, max_blocks] int32 —
    position p of slot s lives at row p % block_size of block block_tables[s, p // block_size]."""

    layers: list[tuple[Tensor, Tensor]]
    block_tables: Tensor

    @property
    def block_size(self) -> int:
        return self.layers[0][0].shape[1]

    def layer(self, index: int) -> PagedKV:
        """Layer `index` alone (the MTP layer's cache), with the same tables."""
        return PagedKV([self.layers[index]], self.block_tables)

    def gather(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """Positions 0..length-1 of `slot` in layer `layer`, as [length, kv_heads, head_dim] keys
        and values (a copy, in position order: prefill's attention reads them whole)."""
        keys, values = self.layers[layer]
        # (index_select even for one block: indexing by a device scalar would wait for the GPU)
        blocks = self.block_tables[slot, : cdiv(length, self.block_size)].long()
        return (keys.index_select(0, blocks).flatten(0, 1)[:length],
                values.index_select(0, blocks).flatten(0, 1)[:length])


class KVPool:
    """Fixed-size blocks of KV positions shared by up to num_slots sequences: keys and values
    [layers, num_blocks, block_size, kv_heads, head_dim] and block tables [num_slots,
    max_blocks]. A sequence takes a slot (a table row) and the blocks its length needs.

    block_size defaults to max_length (one block per slot: the contiguous layout), num_blocks
    to enough for every slot at max_length."""

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
        block_size: int | None = None,
        num_blocks: int | None = None,
    ) -> None:
        block_size = block_size or max_length
        if num_slots < 1 or max_length < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs num_slots, max_length and block_size >= 1 "
                             f"(got {num_slots}, {max_length}, {block_size})")
        self.max_length = max_length
        self.num_slots = num_slots
        self.block_size = block_size
        self.max_blocks = cdiv(max_length, block_size)  # table entries per slot
        num_blocks = num_slots * self.max_blocks if num_blocks is None else num_blocks
        if num_blocks < 1:
            raise ValueError(f"num_blocks {num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # Entries past a slot's blocks stay 0 (a real block): kernels never read past a row's
        # position, so they are never used.
        self.block_tables = torch.zeros((num_slots, self.max_blocks), dtype=torch.int32, device=device)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._held: dict[int, list[int]] = {}  # slot -> its blocks
        # Rows reach the device tables from a host copy (pinned on a GPU), one asynchronous copy
        # per acquire; a slot's host row is rewritten only once its last copy has run.
        self._host_tables = self._host_like(self.block_tables)
        self._copied: dict[int, torch.cuda.Event] = {}

    @staticmethod
    def bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_free(self) -> int:
        """Free slots."""
        return len(self._free_slots)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def blocks_for(self, length: int) -> int:
        return cdiv(length, self.block_size)

    def acquire(self, length: int) -> tuple[int, CacheLength]:
        """Take a free slot and the blocks for `length` positions; returns the slot and its
        length bookkeeping (the rows themselves are read and written through `paged()`)."""
        if not 1 <= length <= self.max_length:
            raise ValueError(f"cache length {length} must lie in [1, {self.max_length}]")
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} KV slots are in use")
        needed = self.blocks_for(length)
        if needed > len(self._free_blocks):
            raise RuntimeError(f"{length} positions need {needed} KV blocks of {self.block_size}; "
                               f"{len(self._free_blocks)} of {self.num_blocks} are free")
        slot = self._free_slots.pop()
        blocks = [self._free_blocks.pop() for _ in range(needed)]
        self._held[slot] = blocks
        self._write_row(slot, blocks)
        return slot, CacheLength(length)

    def _host_like(self, tables: Tensor) -> Tensor:
        return torch.zeros(tables.shape, dtype=tables.dtype, pin_memory=tables.is_cuda)

    def _write_row(self, slot: int, blocks: list[int]) -> None:
        """Write a slot's table row, in stream order (windows enqueued before read the old row)
        and without waiting for the device: a blocking copy would stall the host until every
        enqueued step had run (a step ahead included) each time a request starts."""
        copied = self._copied.pop(slot, None)
        if copied is not None:
            copied.synchronize()  # (long done: a slot is reused a request later)
        row = self._host_tables[slot, : len(blocks)]
        row.copy_(torch.tensor(blocks, dtype=torch.int32))
        self.block_tables[slot, : len(blocks)].copy_(row, non_blocking=row.is_pinned())
        if self.block_tables.is_cuda:
            self._copied[slot] = torch.cuda.Event()
            self._copied[slot].record()

    def release(self, slot: int) -> None:
        blocks = self._held.pop(slot, None)
        if blocks is None:
            raise ValueError(f"slot {slot} is not held")
        self._free_blocks.extend(reversed(blocks))
        self._free_slots.append(slot)

    def grow(self, *, num_blocks: int | None = None, num_slots: int | None = None) -> None:
        """Reallocate with more blocks and/or slots, keeping every held slot's rows and table
        (eager users only, such as the drafter's MTP pool: captured graphs hold the old addresses)."""
        num_blocks = max(num_blocks or 0, self.num_blocks)
        num_slots = max(num_slots or 0, self.num_slots)
        if num_blocks > self.num_blocks:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = torch.zeros((old.shape[0], num_blocks, *old.shape[2:]), dtype=old.dtype, device=old.device)
                new[:, : self.num_blocks].copy_(old)
                setattr(self, name, new)
            self._free_blocks = list(range(num_blocks - 1, self.num_blocks - 1, -1)) + self._free_blocks
            self.num_blocks = num_blocks
        if num_slots > self.num_slots:
            tables = torch.zeros((num_slots, self.max_blocks), dtype=torch.int32, device=self.block_tables.device)
            tables[: self.num_slots].copy_(self.block_tables)
            self.block_tables = tables
            for event in self._copied.values():  # (the old host rows' copies, before they go)
                event.synchronize()
            self._copied.clear()
            host = self._host_like(tables)
            host[: self.num_slots].copy_(self._host_tables)
            self._host_tables = host
            self._free_slots = list(range(num_slots - 1, self.num_slots - 1, -1)) + self._free_slots
            self.num_slots = num_slots

    def read(self, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """Positions 0..length-1 of a held slot, all layers: keys and values [layers, length,
        kv_heads, head_dim] (a copy in position order; for tests and inspection)."""
        blocks = self._held.get(slot)
        if blocks is None or length > len(blocks) * self.block_size:
            raise ValueError(f"slot {slot} does not hold {length} positions")
        index = torch.tensor(blocks, device=self.keys.device)
        return (self.keys[:, index].flatten(1, 2)[:, :length], self.values[:, index].flatten(1, 2)[:, :length])

    def paged(self) -> PagedKV:
        """Per-layer (keys, values), each [num_blocks, block_size, kv_heads, head_dim], and the tables."""
        return PagedKV([(self.keys[i], self.values[i]) for i in range(self.keys.shape[0])], self.block_tables)
