"""The CPU's decode/verify step in native calls, one per op for all rows (DESIGN §11): attention,
the routed experts, the products (whole and split-K), the residual add + RMS norm (after
partials or the experts' combine), q/k norms + RoPE + the KV write, the router's plain top-k,
the greedy ids. (kernels.fused.cpu_step chains them into one call for a whole step.)

On the CPU a window or a batch runs as one forward whose rows must keep their one-row bits.
The torch references (`attention_reference`, `experts_reference`, `torch_rowwise_linear`, ...)
get that by running each row (or each expert's routes) as its own small ops, and at the
embedded model's sizes the ops' dispatch, not their arithmetic, set the step's pace. The C
kernels here (`_cpu_rows.c`, compiled at install) compute the same functions in one call for
all rows: every row or route by the same loop, nothing shared between rows, every sum in a
fixed order, each rounding to the dtype where the reference rounds, so a row's bits do not
depend on the call's other rows. They are not the references' bits (BLAS and torch order their
sums their own way): the references stay the definition the tests compare them with, and the
path wherever these do not apply (FP8 weights, a dtype other than float32 or bfloat16, a
layout they do not read) or the extension was not built. Each function returns None then.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor

TYPES = {torch.float32: 0, torch.bfloat16: 1}  # _cpu_rows.c's element types
PAIRED = 2  # weights only: bfloat16 in kernels.fused.paired's layout, under float32 rows


@functools.cache
def _native() -> ModuleType | None:
    try:
        from kernels.fused import _cpu_rows
    except ImportError:  # not built (a source tree without `pip install -e .` or build_ext)
        return None
    return _cpu_rows


def native() -> ModuleType | None:
    """The compiled module (None where it was not built); kernels.fused.cpu_step calls its step."""
    return _native()


def available() -> bool:
    return _native() is not None


def _plain(*tensors: Tensor, dtype: torch.dtype) -> bool:
    return all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)


def _rows(positions: Tensor, slots: Tensor, block_tables: Tensor, max_positions: int, op: str) -> tuple[Tensor, Tensor]:
    """(positions, slots) as the kernels read them (int64, contiguous), checked against the
    tables: the C code indexes with them unchecked."""
    positions = positions.to(torch.int64).contiguous()  # [T]
    slots = slots.to(torch.int64).contiguous()  # [T]
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= max_positions
                              or int(slots.min()) < 0 or int(slots.max()) >= block_tables.shape[0]):
        raise ValueError(f"{op}: a row's position or slot is outside the block tables (or the rotary table)")
    return positions, slots


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
    positions, slots = _rows(positions, slots, block_tables, block_tables.shape[1] * block_size, "decode_attention")
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
    paired: bool = False,
) -> Tensor | None:
    """experts_reference's per-route outputs [T*k, H] float32 (zeros where the id is -1), or
    None where the kernel does not apply (FP8 weights among them). paired: gate_up and down are
    bfloat16 in kernels.fused.paired's layout under float32 x (the bits of their float32 values)."""
    native = _native()
    if native is None or not isinstance(gate_up, Tensor) or not isinstance(down, Tensor) or x.dtype not in TYPES:
        return None
    if paired and x.dtype != torch.float32:
        return None
    weight_dtype = torch.bfloat16 if paired else x.dtype
    if not _plain(gate_up, down, dtype=weight_dtype) or x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
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
                       top_k, num_experts, hidden, inter, TYPES[x.dtype], PAIRED if paired else TYPES[x.dtype])
    return out


def linear(
    x: Tensor,  # [M, K]
    weight: Tensor,  # [N, K]
) -> Tensor | None:
    """x @ weight^T [M, N] in x's dtype (each output summed in float32, rounded once), as
    rowwise_linear computes it, or None where the kernel does not apply: the split-K kernel with
    one split. x's and the weight's rows may be strided."""
    out = partials(x, weight, 1, max(x.shape[-1], 1))
    return None if out is None else out.view(x.shape[0], weight.shape[0]).to(x.dtype)


def partials(
    x: Tensor,  # [M, K]
    weight: Tensor,  # [N, K]
    splits: int,
    step: int,  # K columns a split (the last ones may be shorter or empty)
    paired: bool = False,
    wide: bool = True,
) -> Tensor | None:
    """linear_partials' split-K products [M, splits, N] float32 (partial s over K columns
    s·step ...), or None where the kernel does not apply. paired: the weight is bfloat16 in
    kernels.fused.paired's layout under float32 x (the bits of its float32 values). wide=False:
    never the wide kernel (`wide_products`), whose bits are the same."""
    native = _native()
    if native is None or not isinstance(weight, Tensor) or x.dtype not in TYPES:
        return None
    if weight.dtype != (torch.bfloat16 if paired else x.dtype) or (paired and x.dtype != torch.float32):
        return None
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    if x.device.type != "cpu" or weight.device.type != "cpu" or splits < 1 or step < 1:
        return None
    (num_rows, num_in), num_out = x.shape, weight.shape[0]
    out = torch.empty((num_rows, splits, num_out), dtype=torch.float32)
    if num_rows and num_out:
        native.partials(x.data_ptr(), weight.data_ptr(), out.data_ptr(), num_rows, num_out, num_in, x.stride(0),
                        weight.stride(0), splits, step, TYPES[x.dtype], PAIRED if paired else TYPES[x.dtype], not wide)
    return out


def wide_products() -> bool:
    """Whether products take the wide kernels on this machine (AVX-512: two input rows a
    register, or for one or two input rows over paired weights two weight rows a register; each
    sum in the 8-lane kernels' order — the same bits, fewer multiply-adds)."""
    native = _native()
    return native is not None and native.wide_products()


def set_wide(allowed: bool) -> None:
    """Allow (the default) or forbid the wide kernels for every call in this process from now on:
    the tests compare the two ways, whose bits are the same."""
    native = _native()
    if native is not None:
        native.set_wide(allowed)


def add_rmsnorm(
    x: Tensor,  # [T, H] in residual's dtype, split-K partials [T, S, H] float32, or routes' outputs [T*k, H] float32
    residual: Tensor | None,  # [T, H]
    weight: Tensor,  # [H]
    eps: float,
    centred: bool = False,
    route_weights: Tensor | None = None,  # [T, k] float32: x holds routes' outputs, weighted and summed in rank order
) -> tuple[Tensor, Tensor] | None:
    """(normed, new_residual) as add_rmsnorm_reference after add_rmsnorm's sum of partials or
    combine_reference's weighted sum of routes, or None where the kernel does not apply."""
    native = _native()
    dtype = x.dtype if residual is None else residual.dtype
    if native is None or dtype not in TYPES or weight.dtype != dtype or weight.dim() != 1:
        return None
    tensors = [x, weight] + ([] if residual is None else [residual]) + ([] if route_weights is None else [route_weights])
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    hidden = weight.shape[0]
    if route_weights is not None:
        num_rows, terms = route_weights.shape
        kind = 2
        if (residual is None or x.dtype != torch.float32 or route_weights.dtype != torch.float32
                or x.shape != (num_rows * terms, hidden)):
            return None
    elif x.dim() == 3:
        num_rows, terms, kind = x.shape[0], x.shape[1], 1
        if residual is None or x.dtype != torch.float32 or x.shape[2] != hidden:
            return None
    else:
        num_rows, terms, kind = x.shape[0], 1, 0
        if x.dtype != dtype or x.dim() != 2 or x.shape[1] != hidden:
            return None
    if residual is not None and residual.shape != (num_rows, hidden):
        return None
    normed = torch.empty((num_rows, hidden), dtype=dtype)
    # (no residual: x itself is the new residual, as the reference returns it)
    new_residual = x if residual is None else torch.empty((num_rows, hidden), dtype=dtype)
    if num_rows:
        native.add_norm(x.data_ptr(), kind, 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                        normed.data_ptr(), 0 if residual is None else new_residual.data_ptr(),
                        0 if route_weights is None else route_weights.data_ptr(), num_rows, hidden, terms, eps,
                        int(centred), TYPES[dtype])
    return normed, new_residual


def qk_norm_rope_store(
    qkv: Tensor,  # [T, >= (Hq + 2*Hkv) * D] (row stride free, columns contiguous)
    q_norm: Tensor,  # [D]
    k_norm: Tensor,  # [D]
    cos: Tensor,  # [max_positions, rot] float32
    sin: Tensor,
    positions: Tensor,  # [T]
    slots: Tensor,  # [T]
    cache_keys: Tensor,  # [num_blocks, block_size, Hkv, D]
    cache_values: Tensor,
    block_tables: Tensor,  # [num_slots, max_blocks] int32
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    centred: bool,
    rot: int,
    q_head_stride: int,
) -> Tensor | None:
    """norm.qk_norm_rope_store's q [T, Hq, D] (k and v written to the cache), or None where the
    kernel does not apply. The caller has checked the shapes and the rotary width."""
    native = _native()
    dtype = qkv.dtype
    if native is None or dtype not in TYPES or qkv.dim() != 2 or qkv.stride(1) != 1:
        return None
    if not (_plain(q_norm, k_norm, cache_keys, cache_values, dtype=dtype) and _plain(cos, sin, dtype=torch.float32)
            and _plain(block_tables, dtype=torch.int32)) or qkv.device.type != "cpu":
        return None
    num_rows = qkv.shape[0]
    head_dim = q_norm.shape[0]
    block_size = cache_keys.shape[1]
    positions, slots = _rows(positions, slots, block_tables, min(cos.shape[0], block_tables.shape[1] * block_size),
                             "qk_norm_rope_store")
    q = torch.empty((num_rows, num_heads, head_dim), dtype=dtype)
    if num_rows:
        native.qk_rope(qkv.data_ptr(), qkv.stride(0), q.data_ptr(), cache_keys.data_ptr(), cache_values.data_ptr(),
                       block_tables.data_ptr(), positions.data_ptr(), slots.data_ptr(), q_norm.data_ptr(),
                       k_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(), num_rows, num_heads, num_kv_heads, head_dim,
                       q_head_stride, rot, block_size, block_tables.shape[1], eps, int(centred), TYPES[dtype])
    return q


def route(
    router_logits: Tensor,  # [T, E] or split-K partials [T, S, E] float32
    top_k: int,
    round_to: torch.dtype | None,  # partials: the dtype their sum is rounded to
    normalize: bool,
    live: Tensor | None,  # [T]: 0 marks a padding row (its ids -1)
) -> tuple[Tensor, Tensor] | None:
    """kernels.fused.router.route's plain top-k (no residency map, no shared expert): expert_ids
    [T, k] int64 and weights [T, k] float32, or None where the kernel does not apply. The
    softmax is the kernel's own (libm's expf, sums in expert order), so a weight may differ from
    torch's in its last bits and two experts whose probabilities torch rounds apart may tie here
    (the lower id wins), as the reference's rule says."""
    native = _native()
    if native is None or router_logits.device.type != "cpu":
        return None
    if router_logits.dim() == 3:
        if router_logits.dtype != torch.float32 or round_to not in TYPES:
            return None
        splits, rounded = router_logits.shape[1], round_to == torch.bfloat16
    elif router_logits.dim() == 2 and router_logits.dtype in TYPES:
        splits, rounded = 1, False
        router_logits = router_logits.float()  # (bf16 logits are exact in float32)
    else:
        return None
    num_rows, num_experts = router_logits.shape[0], router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        return None
    partials = router_logits.contiguous()
    live = None if live is None else live.to(torch.int64).contiguous()  # [T]
    if live is not None and live.shape != (num_rows,):
        return None
    ids = torch.empty((num_rows, top_k), dtype=torch.int64)
    weights = torch.empty((num_rows, top_k), dtype=torch.float32)
    if num_rows:
        native.route(partials.data_ptr(), 0 if live is None else live.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                     num_rows, splits, num_experts, top_k, int(normalize), int(rounded), int(live is not None))
    return ids, weights


def argmax(logits: Tensor) -> Tensor | None:  # [T, V] float32
    """logits.argmax(dim=-1) [T] int64 (the first largest value; a NaN counts as the largest), or
    None where the kernel does not apply."""
    module = _native()
    if module is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0] and logits.shape[1]:
        module.argmax(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1])
    elif logits.shape[0]:
        return None  # (torch raises for an empty row; let it)
    return out
