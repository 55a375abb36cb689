"""The Gated DeltaNet layers' memory on the fused path: a state per sequence, and rollback.

A linear-attention layer keeps no KV rows: a sequence's memory is, per layer, the last K - 1
inputs of the causal convolution and the delta rule's float32 state (DESIGN §6). On the fused
path these live here, beside the paged KV pool, indexed by the pool's slot:

- Two buffers per slot (ping-pong). A step reads the slot's current buffer and writes the state
  after its last row into the other one; only when the engine keeps the step (`settle`) does the
  other buffer become current. So a step computed ahead and then dropped (decode-ahead) leaves
  the committed state untouched, and nothing is copied in the usual case.
- A verify window also writes the state after each of its rows into `kept` (row t of the batch
  at kept row t). Committing `a` accepted drafts keeps the state after the window's row a: when
  that is not the last row, it is copied from `kept` into the new current buffer — one copy per
  rolled-back sequence, nothing re-run (DESIGN §11).

Buffers and kept rows are device tensors of fixed shape (CUDA graphs read them through fixed
addresses); which buffer a sequence reads and writes is an input of the step (`Rows.state_in`,
`Rows.state_out`). State and scheduling stay free of CUDA calls here beyond plain tensor copies.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LinearStates:
    def __init__(self, *, num_layers: int, num_slots: int, max_rows: int, conv_dim: int, conv_width: int,
                 num_v_heads: int, head_k_dim: int, head_v_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        """num_layers: the linear-attention layers; num_slots: the KV pool's slots (each gets two
        buffers); max_rows: the most rows of one step (kept states of a verify window or batch)."""
        if num_layers < 1 or num_slots < 1 or max_rows < 1:
            raise ValueError(f"linear states need num_layers, num_slots and max_rows >= 1 "
                             f"(got {num_layers}, {num_slots}, {max_rows})")
        self.num_slots = num_slots
        self.max_rows = max_rows
        conv = (conv_width - 1, conv_dim)
        rec = (num_v_heads, head_k_dim, head_v_dim)
        # Buffers 2s and 2s + 1 are slot s's.
        self.conv = torch.zeros((num_layers, 2 * num_slots, *conv), dtype=dtype, device=device)  # [L, 2S, K-1, C]
        self.rec = torch.zeros((num_layers, 2 * num_slots, *rec), dtype=torch.float32, device=device)  # [L, 2S, Hv, dk, dv]
        self.kept_conv = torch.zeros((num_layers, max_rows, *conv), dtype=dtype, device=device)  # [L, R, K-1, C]
        self.kept_rec = torch.zeros((num_layers, max_rows, *rec), dtype=torch.float32, device=device)  # [L, R, Hv, dk, dv]
        self._current = [0] * num_slots  # which of a slot's two buffers holds its committed state

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.rec, self.kept_conv, self.kept_rec))

    def buffers(self, slot: int) -> tuple[int, int]:
        """(read, write): the buffer holding the slot's committed state and the one a step writes."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside the {self.num_slots} slots with linear-attention states")
        current = self._current[slot]
        return 2 * slot + current, 2 * slot + 1 - current

    def reset(self, slot: int) -> None:
        """A new sequence at `slot`: its committed state is zeros (enqueued in stream order)."""
        self._current[slot] = 0
        read, _ = self.buffers(slot)
        self.conv[:, read].zero_()
        self.rec[:, read].zero_()

    def settle(self, slot: int, kept_row: int | None = None) -> None:
        """Keep the last step of `slot`: the buffer it wrote becomes current. kept_row: the step
        was a window rolled back to its row at batch row `kept_row`, whose state is copied in."""
        _, write = self.buffers(slot)
        if kept_row is not None:
            if not 0 <= kept_row < self.max_rows:
                raise ValueError(f"kept row {kept_row} outside the {self.max_rows} kept rows")
            self.conv[:, write].copy_(self.kept_conv[:, kept_row])
            self.rec[:, write].copy_(self.kept_rec[:, kept_row])
        self._current[slot] ^= 1

    def layer(self, index: int, *, keep: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """Linear layer `index`'s (conv buffers, recurrent buffers, kept conv, kept recurrent); the
        kept ones only when the step keeps each row's state (windows of several rows)."""
        if keep:
            return self.conv[index], self.rec[index], self.kept_conv[index], self.kept_rec[index]
        return self.conv[index], self.rec[index], None, None
