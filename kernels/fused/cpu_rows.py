"""The CPU's decode/verify attention and routed experts in one native call each (DESIGN §11).

On the CPU a window or a batch runs as one forward whose rows must keep their one-row bits.
The torch references (`attention_reference`, `experts_reference`) get that by running each
row (or each expert's routes) as its own small ops, and at the embedded model's sizes the
ops' dispatch, not their arithmetic, set the step's pace. The C kernels here
(`_cpu_rows.c`, compiled at install) compute the same functions in one call for all rows:
every row or route by the same loop, nothing shared between rows, every sum in a fixed order,
so a row's bits do not depend on the call's other rows. They are not the references' bits
(BLAS orders its sums its own way): the references stay the definition the tests compare
them with, and the path wherever these do not apply (FP8 weights, a dtype other than float32
or bfloat16, a layout they do not read) or the extension was not built.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor

TYPES = {torch.float32: 0, torch.bfloat16: 1}  # _cpu_rows.c's element types


@functools.cache
def _native() -> ModuleType | None:
    try:
        from kernels.fused import _cpu_rows
    except ImportError:  # not built (a source tree without `pip install -e .` or build_ext)
        return None
    return _cpu_rows


def available() -> bool:
    return _native() is not None


def _plain(*tensors: Tensor, dtype: torch.dtype) -> bool:
    return all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)


def attention(
    q: Tensor,  # [T, Hq, D]
    cache_keys: Tensor,  # [num_blocks, block_size, Hkv, D]
    cache_values: Tensor,
    block_tables: Tensor,  # [num_slots, max_blocks] int32
    positions: Tensor,  # [T]
    slots: Tensor,  # [T]
) -> Tensor | None:
    """attention_reference's output [T, Hq, D] in q's dtype (without a gate), or None where the
    kernel does not apply."""
    native = _native()
    if native is None or q.dtype not in TYPES or q.dim() != 3 or cache_keys.dim() != 4:
        return None
    if not (_plain(cache_keys, cache_values, dtype=q.dtype) and _plain(block_tables, dtype=torch.int32)):
        return None
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv, cache_dim = cache_keys.shape
    if cache_values.shape != cache_keys.shape or cache_dim != head_dim or num_heads % num_kv:
        return None
    q = q.contiguous()
    positions = positions.to(torch.int64).contiguous()  # [T]
    slots = slots.to(torch.int64).contiguous()  # [T]
    if num_rows and (int(positions.min()) < 0 or int(positions.max()) >= block_tables.shape[1] * block_size
                     or int(slots.min()) < 0 or int(slots.max()) >= block_tables.shape[0]):
        raise ValueError("decode_attention: a row's position or slot is outside the block tables")
    out = torch.empty((num_rows, num_heads, head_dim), dtype=torch.float32)
    if num_rows:
        native.attention(q.data_ptr(), cache_keys.data_ptr(), cache_values.data_ptr(), block_tables.data_ptr(),
                         positions.data_ptr(), slots.data_ptr(), out.data_ptr(), num_rows, num_heads, num_kv,
                         head_dim, block_size, block_tables.shape[1], TYPES[q.dtype])
    return out.to(q.dtype)


def experts(
    x: Tensor,  # [T, H]
    expert_ids: Tensor,  # [T, k]
    gate_up: Tensor,  # [E, 2I, H]
    down: Tensor,  # [E, H, I]
) -> Tensor | None:
    """experts_reference's per-route outputs [T*k, H] float32 (zeros where the id is -1), or
    None where the kernel does not apply (FP8 weights among them)."""
    native = _native()
    if native is None or not isinstance(gate_up, Tensor) or not isinstance(down, Tensor) or x.dtype not in TYPES:
        return None
    if not _plain(gate_up, down, dtype=x.dtype) or x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        return None
    num_tokens, hidden = x.shape
    num_experts, inter = down.shape[0], down.shape[2]
    if gate_up.shape != (num_experts, 2 * inter, hidden) or down.shape[1] != hidden:
        return None
    x = x.contiguous()
    ids = expert_ids.to(torch.int64).contiguous()  # [T, k]
    top_k = ids.shape[1]
    if ids.numel() and int(ids.max()) >= num_experts:
        raise ValueError(f"fused_experts: an expert id is >= the {num_experts} experts")
    out = torch.empty((num_tokens * top_k, hidden), dtype=torch.float32)
    if ids.numel():
        native.experts(x.data_ptr(), ids.data_ptr(), gate_up.data_ptr(), down.data_ptr(), out.data_ptr(), num_tokens,
                       top_k, num_experts, hidden, inter, TYPES[x.dtype])
    return out


def linear(
    x: Tensor,  # [M, K]
    weight: Tensor,  # [N, K]
) -> Tensor | None:
    """x @ weight^T [M, N] in x's dtype (each output summed in float32, rounded once), as
    rowwise_linear computes it, or None where the kernel does not apply. x's and the weight's
    rows may be strided (a K range of a wider tensor: linear_partials' splits)."""
    native = _native()
    if native is None or not isinstance(weight, Tensor) or x.dtype not in TYPES or weight.dtype != x.dtype:
        return None
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.device.type != "cpu":
        return None
    if weight.device.type != "cpu" or x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    (num_rows, num_in), num_out = x.shape, weight.shape[0]
    out = torch.empty((num_rows, num_out), dtype=torch.float32)
    if num_rows and num_out:
        native.linear(x.data_ptr(), weight.data_ptr(), out.data_ptr(), num_rows, num_out, num_in, x.stride(0),
                      weight.stride(0), TYPES[x.dtype])
    return out.to(x.dtype)
