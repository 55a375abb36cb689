"""Where the rows of a fused step sit: positions, KV slots, sequences, and (families with
linear-attention layers) state buffers — what the fused forwards of every family read; and
what every family's prefill does with a step's chunks: their rows' positions and slots, and
their causal attention over the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from shared.model.kv_cache import PagedKV

# Prefill attention backends. cuDNN's is left out: it builds an execution plan for every new
# (query, key) length, which cost 0.4-1 s on the first prompt of each length (H200), and prompt
# lengths rarely repeat; flash attention has no per-shape setup.
PREFILL_ATTENTION = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


@dataclass(frozen=True)
class Rows:
    """Where the rows of a window (or ragged batch) sit: one position and slot per row."""

    positions: Tensor  # [T] int64
    slots: Tensor  # [T] int64
    seq_starts: Tensor  # [num_seqs + 1] int32: rows of sequence s are seq_starts[s]:seq_starts[s+1]
    seq_slots: Tensor  # [num_seqs] int64
    max_rows_per_seq: int
    live: Tensor | None = None  # [T] int: 0 marks padding rows (batch graphs), which run no experts
    # Families with linear-attention layers: the state buffer each sequence reads, and the one it
    # writes its state after its last row to (shared.model.families.hybrid.states)
    state_in: Tensor | None = None  # [num_seqs] int64
    state_out: Tensor | None = None  # [num_seqs] int64

    @staticmethod
    def window(start: int, num_rows: int, slot: int, device: torch.device | str) -> Rows:
        """One sequence's rows at positions start..start+num_rows-1 of `slot`."""
        return Rows(
            positions=torch.arange(start, start + num_rows, device=device),
            slots=torch.full((num_rows,), slot, dtype=torch.int64, device=device),
            seq_starts=torch.tensor([0, num_rows], dtype=torch.int32, device=device),
            seq_slots=torch.tensor([slot], dtype=torch.int64, device=device),
            max_rows_per_seq=num_rows,
        )


def one_row(rows: Rows, index: int) -> Rows:
    """Row `index` of a window or batch as a one-row sequence (same position and slot)."""
    slot = rows.slots[index : index + 1]
    return Rows(positions=rows.positions[index : index + 1], slots=slot,
                seq_starts=torch.tensor([0, 1], dtype=rows.seq_starts.dtype, device=slot.device), seq_slots=slot,
                max_rows_per_seq=1, live=None if rows.live is None else rows.live[index : index + 1])


def prefill_rows(spans: list[tuple[int, int, int]], num_rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(positions [T], slots [T]) of prefill chunks back to back: spans[i] = (start, count, slot),
    chunk i at positions start..start+count-1 of `slot`."""
    if sum(count for _, count, _ in spans) != num_rows:
        raise ValueError(f"spans cover {sum(c for _, c, _ in spans)} rows, token_ids has {num_rows}")
    positions = torch.cat([torch.arange(start, start + count) for start, count, _ in spans]).to(device)
    slots = torch.tensor([slot for _, count, slot in spans for _ in range(count)], device=device)
    return positions, slots


def prefill_attention(q: Tensor, kv: PagedKV, layer: int, spans: list[tuple[int, int, int]]) -> Tensor:
    """Causal attention of each chunk's rows (q [T, heads, head_dim], chunks back to back) over
    its slot's first start + count positions of KV layer `layer` (bottom-right aligned; gathered
    from their blocks): [T, heads, head_dim]."""
    parts, row = [], 0
    with sdpa_kernel(list(PREFILL_ATTENTION)):
        for start, count, slot in spans:
            visible = start + count
            keys, values = kv.gather(layer, slot, visible)  # [visible, kv_heads, head_dim]
            parts.append(F.scaled_dot_product_attention(
                q[row : row + count].transpose(0, 1).unsqueeze(0),  # [1, heads, count, head_dim]
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=causal_lower_right(count, visible),
                enable_gqa=q.shape[1] != keys.shape[1],
            ).squeeze(0).transpose(0, 1))  # [count, heads, head_dim]
            row += count
    return parts[0] if len(parts) == 1 else torch.cat(parts)
