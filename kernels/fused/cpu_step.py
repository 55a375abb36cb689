"""The CPU's decode/verify step as one native call (DESIGN §11): a qwen3_moe trunk's rows
through every layer and the logits, by the row kernels of `cpu_rows` in the per-op path's order
and with its roundings (`_cpu_step.c`), so a row's bits are the per-op path's.

Why: the per-op path makes ~15 native calls a layer from Python, each dropping and retaking the
interpreter lock. In the service the event loop is a thread of the same process; while it runs,
every retake waits, and a step beside it took ~1.5× its time alone (docs/PERFORMANCE.md,
session 32). The step program takes the lock back once, and its Python glue (~half of a small
step) goes with it.

A `StepPlan` holds the weights' and the paged cache's addresses, checked once (`plan`: None
where the step does not apply — no native build, a dtype other than float32 / bfloat16, FP8
weights, a layout it does not read); `run` takes a step's rows as tensors and returns new ones;
`run_into` takes them as lists and writes a `StepOutput`'s reused buffers, greedy ids included
(a runner's step: no torch call on the way, so the interpreter lock is dropped once a step —
each torch call drops and retakes it, and retaking waits while the event loop holds it). The
plan keeps its tensors alive; the caller must not replace them (the paged pool's tensors never
are).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.fused import cpu_rows
from kernels.fused.linear import MAX_FUSED_ROWS
from kernels.fused.moe import MAX_FUSED_TOKENS

MAX_ROWS = min(MAX_FUSED_ROWS, MAX_FUSED_TOKENS)  # the per-op path's native kernels' domain


@dataclass(frozen=True)
class StepLayer:
    """One MoE decoder layer as the step reads it (the fused layout's tensors; qkv, o, gate_up
    and down paired where the plan says so)."""

    input_norm: Tensor  # [H]
    qkv: Tensor  # [(Hq + 2 Hkv) D, H]
    q_norm: Tensor  # [D]
    k_norm: Tensor  # [D]
    o: Tensor  # [H, Hq D]
    o_splits: int
    o_step: int  # K columns of an o split
    post_norm: Tensor  # [H]
    router: Tensor  # [E, H]
    router_splits: int
    router_step: int
    top_k: int
    normalize: bool
    gate_up: Tensor  # [E, 2I, H]
    down: Tensor  # [E, H, I]
    next_norm: Tensor  # [H]: the next layer's input norm, or the final norm
    keys: Tensor  # [num_blocks, block_size, Hkv, D]: this layer's paged cache
    values: Tensor
    eps: float


def _contiguous(dtype: torch.dtype, *tensors: Tensor) -> bool:
    return all(isinstance(t, Tensor) and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
               for t in tensors)


def _threads(threads: int | None) -> int:
    """A step's threads: those given, else torch's count (which the service sets)."""
    return torch.get_num_threads() if threads is None else threads


class StepPlan:
    def __init__(self, native, capsule, keep: tuple, hidden: int, vocab: int, dtype: torch.dtype) -> None:
        self._native, self._capsule, self._keep = native, capsule, keep
        self.hidden, self.vocab, self.dtype = hidden, vocab, dtype

    def run(self, token_ids: Tensor, positions: Tensor, slots: Tensor,
            live: Tensor | None, threads: int | None = None) -> tuple[Tensor, Tensor]:
        """(logits [T, vocab] float32, final-norm hidden [T, H]) of rows at (slot, position), their
        K and V written to the cache; T <= MAX_ROWS. live [T]: 0 marks a padding row (no experts).
        threads: the step's threads (default torch's, which the service sets: shared/threads.py);
        the bits do not depend on them."""
        num_rows = token_ids.shape[0]
        if num_rows > MAX_ROWS:
            raise ValueError(f"step: {num_rows} rows is more than the step's {MAX_ROWS}")
        token_ids = token_ids.to(torch.int64).contiguous()  # [T]
        positions = positions.to(torch.int64).contiguous()  # [T]
        slots = slots.to(torch.int64).contiguous()  # [T]
        if live is not None:
            live = live.to(torch.int64).contiguous()  # [T]
        if positions.shape != (num_rows,) or slots.shape != (num_rows,) or (live is not None and live.shape != (num_rows,)):
            raise ValueError("step: token_ids, positions, slots (and live) must be [T] each")
        logits = torch.empty((num_rows, self.vocab), dtype=torch.float32)
        hidden = torch.empty((num_rows, self.hidden), dtype=self.dtype)
        self._native.step_run(self._capsule, token_ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                              0 if live is None else live.data_ptr(), num_rows, logits.data_ptr(), hidden.data_ptr(),
                              _threads(threads), 0)
        return logits, hidden

    def run_into(self, token_ids: list[int], positions: list[int], slots: list[int], out: StepOutput,
                 threads: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """`run` of rows given as lists (every row live), into `out`'s first rows: (logits [T, vocab]
        float32, hidden [T, H], greedy ids [T] int64) as views of its buffers, valid until the next
        step writes them. The same bits as `run`."""
        num_rows = len(token_ids)
        if len(positions) != num_rows or len(slots) != num_rows:
            raise ValueError("step: token_ids, positions and slots must have one entry a row each")
        if num_rows > out.max_rows:
            raise ValueError(f"step: {num_rows} rows is more than the output's {out.max_rows}")
        if (out.vocab, out.hidden_size, out.dtype) != (self.vocab, self.hidden, self.dtype):
            raise ValueError("step: the output's shapes or dtype are not the plan's")
        ids, at, where = array("q", token_ids), array("q", positions), array("q", slots)
        logits, hidden, greedy_ids = out.rows(num_rows)
        self._native.step_run(self._capsule, ids.buffer_info()[0], at.buffer_info()[0], where.buffer_info()[0], 0,
                              num_rows, out.logits_address, out.hidden_address,
                              _threads(threads), out.greedy_ids_address)
        return logits, hidden, greedy_ids

    def prompt_rows(self, token_ids: list[int], positions: list[int], slots: list[int],
                    threads: int | None = None) -> Tensor:
        """Final-norm hidden [T, H] of prompt rows at (slot, position), their K and V written to
        the cache; no logits. Rows go in steps of at most MAX_ROWS in the order given, so a row
        attends to the rows given before it; a row's bits are its one-row step's whatever the
        others (DESIGN §11), so a prompt's rows do not depend on how it is chunked or batched."""
        num_rows = len(token_ids)
        if len(positions) != num_rows or len(slots) != num_rows:
            raise ValueError("step: token_ids, positions and slots must have one entry a row each")
        hidden = torch.empty((num_rows, self.hidden), dtype=self.dtype)  # [T, H]
        ids, at, where = array("q", token_ids), array("q", positions), array("q", slots)
        size = ids.itemsize
        for first in range(0, num_rows, MAX_ROWS):
            count = min(MAX_ROWS, num_rows - first)
            self._native.step_run(self._capsule, ids.buffer_info()[0] + first * size, at.buffer_info()[0] + first * size,
                                  where.buffer_info()[0] + first * size, 0, count, 0, hidden[first].data_ptr(),
                                  _threads(threads), 0)
        return hidden


class StepOutput:
    """Output buffers of steps of up to `max_rows` rows, written step after step (`run_into`):
    a step's rows are views of them, valid until the next step."""

    def __init__(self, max_rows: int, vocab: int, hidden_size: int, dtype: torch.dtype) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows {max_rows} must be >= 1")
        self.max_rows, self.vocab, self.hidden_size, self.dtype = max_rows, vocab, hidden_size, dtype
        self.logits = torch.empty((max_rows, vocab), dtype=torch.float32)  # [R, vocab]
        self.hidden = torch.empty((max_rows, hidden_size), dtype=dtype)  # [R, H]
        self.greedy_ids = torch.empty(max_rows, dtype=torch.int64)  # [R]
        self.logits_address = self.logits.data_ptr()
        self.hidden_address = self.hidden.data_ptr()
        self.greedy_ids_address = self.greedy_ids.data_ptr()
        self._views: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def rows(self, num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
        """The first num_rows rows of each buffer (views made once per count)."""
        views = self._views.get(num_rows)
        if views is None:
            views = self._views[num_rows] = (self.logits[:num_rows], self.hidden[:num_rows], self.greedy_ids[:num_rows])
        return views


def plan(
    embed: Tensor,  # [V, H]
    lm_head: Tensor,  # [V, H]
    cos: Tensor,  # [max_positions, D] float32 (the whole head rotated)
    sin: Tensor,
    block_tables: Tensor,  # [num_slots, max_blocks] int32
    layers: list[StepLayer],
    num_heads: int,
    num_kv_heads: int,
    paired: bool = False,
) -> StepPlan | None:
    """The step's plan over these tensors, or None where the step does not apply. paired: the
    products' and experts' weights (each layer's qkv, o, gate_up and down, and lm_head) are
    bfloat16 in kernels.fused.paired's layout under float32 rows (the embedding, the norms and the
    routers float32): the bits of their float32 values, from half the bytes."""
    native = cpu_rows.native()
    if native is None or not layers or embed.dtype not in cpu_rows.TYPES or (paired and embed.dtype != torch.float32):
        return None
    dtype = embed.dtype
    weight_dtype = torch.bfloat16 if paired else dtype
    hidden, vocab = embed.shape[1], lm_head.shape[0]
    head_dim = layers[0].q_norm.shape[0]
    num_experts, inter = layers[0].down.shape[0], layers[0].down.shape[2]
    keys = layers[0].keys
    if embed.dim() != 2 or embed.stride(1) != 1 or lm_head.dim() != 2 or lm_head.shape[1] != hidden or lm_head.stride(1) != 1:
        return None
    if lm_head.dtype != weight_dtype or not _contiguous(torch.float32, cos, sin) or not _contiguous(torch.int32, block_tables):
        return None
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim or keys.dim() != 4:
        return None
    if num_heads % num_kv_heads or keys.shape[2:] != (num_kv_heads, head_dim):
        return None
    width = (num_heads + 2 * num_kv_heads) * head_dim
    for layer in layers:
        tensors = (layer.input_norm, layer.q_norm, layer.k_norm, layer.post_norm, layer.router, layer.next_norm,
                   layer.keys, layer.values)
        if not _contiguous(dtype, *tensors) or not _contiguous(weight_dtype, layer.qkv, layer.o, layer.gate_up, layer.down):
            return None
        if (layer.qkv.shape != (width, hidden) or layer.o.shape != (hidden, num_heads * head_dim)
                or layer.router.shape != (num_experts, hidden) or layer.gate_up.shape != (num_experts, 2 * inter, hidden)
                or layer.down.shape != (num_experts, hidden, inter) or layer.keys.shape != keys.shape
                or layer.values.shape != keys.shape or not 1 <= layer.top_k <= num_experts
                or any(t.shape != (hidden,) for t in (layer.input_norm, layer.post_norm, layer.next_norm))
                or any(t.shape != (head_dim,) for t in (layer.q_norm, layer.k_norm))):
            return None
    model = (embed.data_ptr(), lm_head.data_ptr(), cos.data_ptr(), sin.data_ptr(), block_tables.data_ptr(), hidden,
             vocab, num_heads, num_kv_heads, head_dim, num_experts, inter, keys.shape[1], block_tables.shape[1],
             block_tables.shape[0], cos.shape[0], embed.stride(0), lm_head.stride(0), cpu_rows.TYPES[dtype],
             cpu_rows.PAIRED if paired else cpu_rows.TYPES[dtype])
    rows = [(layer.input_norm.data_ptr(), layer.qkv.data_ptr(), layer.q_norm.data_ptr(), layer.k_norm.data_ptr(),
             layer.o.data_ptr(), layer.post_norm.data_ptr(), layer.router.data_ptr(), layer.gate_up.data_ptr(),
             layer.down.data_ptr(), layer.next_norm.data_ptr(), layer.keys.data_ptr(), layer.values.data_ptr(),
             layer.o_splits, layer.o_step, layer.router_splits, layer.router_step, layer.top_k, int(layer.normalize),
             layer.eps) for layer in layers]
    capsule = native.step_plan(model, rows)
    return StepPlan(native, capsule, (embed, lm_head, cos, sin, block_tables, list(layers)), hidden, vocab, dtype)
