"""Decode/verify attention against a paged KV cache, split along the sequence.

Rows are grouped into sequences (ragged: `seq_starts` offsets, one cache slot each); row i
attends to cache positions 0..positions[i] of its sequence's slot, found through the slot's
block table (position p: row p % block_size of block block_tables[slot, p // block_size]). The keys are cut into
fixed splits of SPLIT positions; one program takes one split for one KV head and a block
of the sequence's rows × the query heads sharing that KV head (GQA), so a verify window
reads each key once. A second kernel merges the splits of each row in a fixed order.

Row invariance: a split's bounds depend only on the cache position, masked keys add exact
zeros, and the merge walks the splits a row needs in order, so a row's output is the same
bits alone or in any window.

An output gate (Qwen3-Next's GatedAttention, off by default) is applied in the merge's
epilogue: out = (attn * sigmoid(gate)) with the module's rounding (attn and sigmoid(gate)
each rounded to the dtype, then their product).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from kernels.fused import cdiv, cpu_rows, early_reads, launch_options, next_power_of_2, use_triton

MIN_BLOCK_M = 16  # query rows × heads per program: a multiple of the GQA group (tl.dot needs >= 16)
MERGE_SLICE = 32  # head-dim columns per merge program
BLOCK_N = 64  # keys per inner step


SPLIT = 128  # keys per split: short contexts still spread over many programs (H200: 13 µs at
# context 512 with 512-key splits, latency-bound in one program per KV head)
MERGE_CHUNK = 32  # splits merged per step
SPLIT_WARPS, SPLIT_STAGES, MERGE_WARPS = 4, 3, 1  # (H200, bench/config_sweep.py: 3 stages beat 2 by ~2%)


def attention_reference(
    q: Tensor,  # [T, Hq, D]
    cache_keys: Tensor,  # [num_blocks, block_size, Hkv, D]
    cache_values: Tensor,
    block_tables: Tensor,  # [num_slots, max_blocks] int32
    positions: Tensor,  # [T]
    slots: Tensor,  # [T]
    gate: Tensor | None = None,  # [T, Hq * D] or [T, Hq, D] in q's dtype (strided views of a wider tensor too)
) -> Tensor:
    """[T, Hq, D]: each row attends to positions 0..positions[i] of its slot (float32 softmax);
    with a gate, times sigmoid(gate) as GatedAttention rounds it."""
    num_rows, num_heads, head_dim = q.shape
    block_size, num_kv = cache_keys.shape[1], cache_keys.shape[2]
    group = num_heads // num_kv
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    # Row by row (a row's bits are its own whatever shares the batch: the CPU runs batches
    # through here), in as few ops as a row allows: its blocks' keys in one gather, the query
    # heads of a KV head as one matrix (GQA) instead of keys repeated per query head.
    for i, (position, slot) in enumerate(zip(positions.tolist(), slots.tolist())):
        length = position + 1
        blocks = block_tables[slot, : cdiv(length, block_size)].long()
        keys = cache_keys[blocks].flatten(0, 1)[:length].float()  # [L, Hkv, D]
        values = cache_values[blocks].flatten(0, 1)[:length].float()
        heads = q[i].view(num_kv, group, head_dim).float()  # [Hkv, group, D]
        scores = torch.matmul(heads, keys.permute(1, 2, 0)) * scale  # [Hkv, group, L]
        mixed = torch.matmul(torch.softmax(scores, dim=-1), values.transpose(0, 1))  # [Hkv, group, D]
        out[i] = mixed.view(num_heads, head_dim).to(q.dtype)
    return _gated(out, gate, q)


def _gated(out: Tensor, gate: Tensor | None, q: Tensor) -> Tensor:
    """out [T, Hq, D] times sigmoid(gate) as GatedAttention: on [T, Hq * D] rows (CPU ops' bits follow the layout)."""
    if gate is None:
        return out
    num_rows, num_heads, head_dim = q.shape
    rows = _gate_heads(gate, q).reshape(num_rows, num_heads * head_dim)
    return (out.view(num_rows, -1) * torch.sigmoid(rows)).to(q.dtype).view(num_rows, num_heads, head_dim)


def _gate_heads(gate: Tensor, q: Tensor) -> Tensor:
    """The gate as a [T, Hq, D] view (columns of each row contiguous; rows and heads may be strided)."""
    num_rows, num_heads, head_dim = q.shape
    if gate.dtype != q.dtype:
        raise ValueError(f"decode_attention: gate dtype {gate.dtype} is not q's {q.dtype}")
    heads = gate.unflatten(1, (num_heads, head_dim)) if gate.dim() == 2 else gate
    if tuple(heads.shape) != (num_rows, num_heads, head_dim):
        raise ValueError(f"decode_attention: gate {tuple(gate.shape)} is not [T, Hq * D] or [T, Hq, D] of q "
                         f"{tuple(q.shape)}")
    return heads


@functools.cache
def _kernels():
    """Triton is imported on first use, so CPU-only installs never need it."""
    from kernels.fused import attention_kernels

    return attention_kernels.split_kernel, attention_kernels.merge_kernel


class AttentionWorkspace:
    """Scratch for the split partials of up to max_rows rows (allocated once: graph-safe)."""

    def __init__(self, max_rows: int, num_heads: int, head_dim: int, max_length: int, device: torch.device | str):
        self.split = SPLIT
        self.num_splits = cdiv(max_length, self.split)
        self.max_rows = max_rows
        self.o_part = torch.empty((max_rows, num_heads, self.num_splits, head_dim), dtype=torch.float32, device=device)
        self.lse_part = torch.empty((max_rows, num_heads, self.num_splits), dtype=torch.float32, device=device)


def decode_attention(
    q: Tensor,  # [T, Hq, D]
    cache_keys: Tensor,  # [num_blocks, block_size, Hkv, D]
    cache_values: Tensor,
    block_tables: Tensor,  # [num_slots, max_blocks] int32
    positions: Tensor,  # [T] int64: row i attends to 0..positions[i]
    slots: Tensor,  # [T] int64: cache slot of each row (reference path)
    seq_starts: Tensor,  # [num_seqs + 1] int32: rows of sequence s are seq_starts[s]:seq_starts[s+1]
    seq_slots: Tensor,  # [num_seqs] int64
    max_rows_per_seq: int,
    workspace: AttentionWorkspace | None,
    *,
    pdl: bool = False,  # launch as programmatic dependents (kernels.fused.pdl_supported)
    gate: Tensor | None = None,  # [T, Hq * D] or [T, Hq, D] in q's dtype, rows (heads) strided: out *= sigmoid(gate)
) -> Tensor:
    """Attention output [T, Hq, D]; the keys/values of this window must already be in the cache.
    With a gate, the merge multiplies it by sigmoid(gate) (GatedAttention's rounding)."""
    if not use_triton(q):
        out = cpu_rows.attention(q, cache_keys, cache_values, block_tables, positions, slots)
        if out is None:
            return attention_reference(q, cache_keys, cache_values, block_tables, positions, slots, gate)
        return _gated(out, gate, q)
    num_rows, num_heads, head_dim = q.shape
    num_kv = cache_keys.shape[2]
    if cache_keys.stride() != cache_values.stride() or cache_keys.stride(2) != head_dim or cache_keys.stride(3) != 1:
        raise ValueError("decode_attention: cache keys/values must share a [blocks, block_size, heads, D] layout")
    if workspace is None or workspace.max_rows < num_rows:
        max_length = block_tables.shape[1] * cache_keys.shape[1]
        workspace = AttentionWorkspace(num_rows, num_heads, head_dim, max_length, q.device)
    group = num_heads // num_kv
    block_m = max(MIN_BLOCK_M, next_power_of_2(group))  # a function of the model only (row invariance)
    rows_per_block = block_m // group
    num_row_blocks = cdiv(max_rows_per_seq, rows_per_block)
    num_seqs = seq_slots.shape[0]
    split_kernel, merge_kernel = _kernels()
    ieee = q.dtype == torch.float32
    split_kernel[(num_seqs * num_kv * num_row_blocks, workspace.num_splits)](
        q.contiguous(), cache_keys, cache_values, block_tables, positions, seq_starts, seq_slots, workspace.o_part,
        workspace.lse_part, cache_keys.stride(0), cache_keys.stride(1), block_tables.stride(0),
        1.0 / math.sqrt(head_dim), workspace.num_splits, num_row_blocks,
        NUM_Q=num_heads, NUM_KV=num_kv, D=head_dim, GROUP=group, ROWS_PER_BLOCK=rows_per_block,
        SPLIT=workspace.split, BLOCK_SIZE=cache_keys.shape[1], TILES=workspace.split // BLOCK_N, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, IEEE=ieee, PDL=pdl,
        num_warps=SPLIT_WARPS, num_stages=SPLIT_STAGES, **launch_options(pdl),
    )
    out = torch.empty_like(q)
    if gate is not None:
        gate = _gate_heads(gate, q)
        if gate.stride(2) != 1:
            gate = gate.contiguous()
    slice_ = min(head_dim, MERGE_SLICE)
    merge_kernel[(num_rows, num_heads, head_dim // slice_)](
        workspace.o_part, workspace.lse_part, positions, out, workspace.num_splits,
        gate if gate is not None else out, gate.stride(0) if gate is not None else 0,
        gate.stride(1) if gate is not None else 0,
        NUM_Q=num_heads, D=head_dim, SPLIT=workspace.split, CHUNK=MERGE_CHUNK, SLICE=slice_, PDL=pdl,
        EARLY=early_reads(), HAS_GATE=gate is not None,
        num_warps=MERGE_WARPS, **launch_options(pdl),
    )
    return out
