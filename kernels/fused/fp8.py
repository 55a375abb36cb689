"""Block-scaled FP8 weights as the fused kernels read them (issue 36; DESIGN §6).

A weight [..., N, K] is stored as float8 e4m3 values `q` and one float32 multiplier per block
of `block` = (rows, columns) — the published checkpoints' `weight_scale_inv` — in `scale`
[..., ceil(N / rows), ceil(K / columns)]: the weight is q × scale, block by block. Leading
dimensions (experts) index both alike.

The kernels read q and scale directly, one of two ways (kernels.fused.linear: LINEAR_ /
EXPERT_FP8_EXACT): each loaded tile dequantised in registers, a piece of at most one block
column at a time (fp8_kernels.dequant_tile), rounded to the activations' dtype as `dequantize`
rounds it, then multiplied as a bf16 tile would be; or a tile inside one block column
multiplied as its e4m3 values (exact in bf16: `exact_bf16`) and its partial product scaled
(fp8_kernels.scaled_dot), no weight rounded. A row finds its block
by integer division, so weights whose rows are concatenated (q|k|v, a gate and an up
projection) keep their blocks when every part's row count is a multiple of the block's rows,
and otherwise carry one scale per row (block (1, columns)); either way the values are the
checkpoint's, never re-quantised.

The CPU's reference dequantises (`dequantize`) and runs the plain path; prefill's dequantised
weights come from one kernel where Triton runs (`dequantize_fast`, the same values); `quantize`
makes the scheme from full-precision weights (`--quantize fp8`, tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.fused import cdiv

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_TILE = 16  # tl.dot's smallest K: a block's columns must be a multiple of it for the kernels


@dataclass(frozen=True)
class Fp8Weight:
    q: Tensor  # [..., N, K] float8_e4m3fn
    scale: Tensor  # [..., ceil(N / rows), ceil(K / columns)] float32
    block: tuple[int, int]  # (rows, columns)

    def __post_init__(self) -> None:
        if self.q.dtype != FP8_DTYPE:
            raise ValueError(f"Fp8Weight: q is {self.q.dtype}, not {FP8_DTYPE}")
        rows, columns = self.block
        expected = (*self.q.shape[:-2], math.ceil(self.q.shape[-2] / rows), math.ceil(self.q.shape[-1] / columns))
        if tuple(self.scale.shape) != expected:
            raise ValueError(f"Fp8Weight: scale {tuple(self.scale.shape)} does not fit q {tuple(self.q.shape)} in "
                             f"blocks of {list(self.block)} (expected {expected})")

    # -- what a tensor would answer -------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return self.q.dim()

    def __getitem__(self, index: int) -> Fp8Weight:
        """One matrix of a stack (an expert)."""
        return Fp8Weight(self.q[index], self.scale[index], self.block)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.q.to(device), self.scale.to(device), self.block)

    # -- the kernels' view ----------------------------------------------------------------------

    def kernel_ready(self) -> bool:
        """Whether the kernels read this weight as it is: the block's columns a multiple of
        MIN_TILE (a K tile's pieces fit them, tile_k), rows contiguous, scales contiguous."""
        columns = self.block[1]
        return columns % MIN_TILE == 0 and self.q.stride(-1) == 1 and self.scale.is_contiguous()

    def tile_k(self, wanted: int) -> int:
        """A K tile for the kernels: the largest power of two ≤ wanted made of whole pieces of
        block columns — any, where the block's columns are a power of two (the tile then spans
        several blocks or lies inside one), else one dividing them."""
        tile = 1 << (wanted.bit_length() - 1)
        columns = self.block[1]
        if columns & (columns - 1) == 0:
            return tile
        while columns % tile:
            tile //= 2
        return tile

    # -- full precision -------------------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight [..., N, K] in dtype: q × scale (float32), block by block, then rounded once
        (the scales broadcast over a blocked view: no full-size copy of them)."""
        rows, columns = self.block
        num_rows, num_cols = self.q.shape[-2:]
        block_rows, block_cols = self.scale.shape[-2:]
        q = self.q.float()
        if block_rows * rows != num_rows or block_cols * columns != num_cols:  # (partial last blocks)
            q = torch.nn.functional.pad(q, (0, block_cols * columns - num_cols, 0, block_rows * rows - num_rows))
        w = q.view(*q.shape[:-2], block_rows, rows, block_cols, columns).mul_(self.scale[..., :, None, :, None].float())
        return w.view(*q.shape[:-2], block_rows * rows, block_cols * columns)[..., :num_rows, :num_cols].to(dtype)


DEQUANT_TILE = (16, 256)  # (rows, columns) a program of dequantize_fast writes


def dequantize_fast(weight: Fp8Weight, dtype: torch.dtype) -> Tensor:
    """Fp8Weight.dequantize's values (q × scale in float32, rounded once to dtype) by one kernel
    (fp8_kernels.dequantize_kernel): a value read as its byte and written once, where the
    reference's torch ops make and read float32 copies of the whole weight — prefill's view of
    every expert of a layer (kernels.fused.linear.dense). Its caller picks it where Triton runs;
    dtype: bfloat16 or float32."""
    from kernels.fused.fp8_kernels import dequantize_kernel

    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dequantize_fast: dtype {dtype} (bfloat16 or float32)")
    q, scale = weight.q.contiguous(), weight.scale.contiguous()
    num_out, num_in = q.shape[-2:]
    num_rows = q.numel() // num_in if num_in else 0
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if num_rows:
        block_rows, block_cols = weight.block
        tile_rows, tile_cols = DEQUANT_TILE
        grid = (cdiv(num_rows, tile_rows), cdiv(num_in, tile_cols))
        bf16 = dtype == torch.bfloat16
        dequantize_kernel[grid](q, scale, out.view(torch.int16) if bf16 else out, num_rows, num_out, num_in,
                                scale.shape[-2], scale.shape[-1], SBN=block_rows, SBK=block_cols, BF16=bf16,
                                BLOCK_R=tile_rows, BLOCK_K=tile_cols)
    return out


def e4m3_bits_as_bf16(q: Tensor) -> Tensor:
    """e4m3 values q as bf16 by fp8_kernels.e4m3_as_bf16's bit moves (its reference, any device):
    each code's byte in the high half of a 16-bit lane, sign | magnitude >> 4 — bf16's exponent and
    mantissa fields then hold e4m3's, a value 2^-120 times the true one (biases 127 and 7) — times
    2^120 in bf16. Exact for every finite code, subnormals included."""
    lane = q.view(torch.uint8).to(torch.int32) << 8
    bits = (lane & 0x8000) | ((lane >> 4) & 0x07F0)
    return bits.to(torch.int16).view(torch.bfloat16) * torch.tensor(2.0**120, dtype=torch.bfloat16)


def exact_bf16(q: Tensor) -> Tensor:
    """e4m3 values q (any shape) in bf16 as the FP8 kernels make them: on a GPU by the kernels' own
    bit moves (fp8_kernels.e4m3_as_bf16), elsewhere by their reference."""
    if not q.is_cuda:
        return e4m3_bits_as_bf16(q)
    from kernels.fused.fp8_kernels import exact_bf16_kernel

    flat = q.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.bfloat16, device=q.device)
    block = 1024
    exact_bf16_kernel[(max(1, -(-flat.numel() // block)),)](flat, out, flat.numel(), BLOCK=block)
    return out.view(q.shape)


def quantize(weight: Tensor, block: tuple[int, int]) -> Fp8Weight:
    """Block-scaled e4m3 of weight [..., N, K]: each block's largest magnitude maps to FP8_MAX
    (the published checkpoints' scheme); an all-zero block gets scale 1."""
    rows, columns = block
    num_rows, num_cols = weight.shape[-2:]
    pad_rows, pad_cols = -num_rows % rows, -num_cols % columns
    w = torch.nn.functional.pad(weight.float(), (0, pad_cols, 0, pad_rows))
    lead = w.shape[:-2]
    blocks = w.reshape(*lead, w.shape[-2] // rows, rows, w.shape[-1] // columns, columns)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., N / rows, K / columns]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(w.shape)[..., :num_rows, :num_cols].to(FP8_DTYPE).contiguous()
    return Fp8Weight(q, scale.contiguous(), block)


def per_row(weight: Fp8Weight) -> Fp8Weight:
    """The same weight with one scale per row (block (1, columns)): rows may then be taken or
    concatenated in any grouping."""
    rows, columns = weight.block
    if rows == 1:
        return weight
    scale = weight.scale.repeat_interleave(rows, dim=-2)[..., : weight.q.shape[-2], :].contiguous()
    return Fp8Weight(weight.q, scale, (1, columns))


def cat_rows(parts: list[Fp8Weight], dim: int = -2) -> Fp8Weight:
    """The parts' rows (dim -2) concatenated — or, with dim 0, their stacks — keeping blocks where
    every part's rows are whole blocks, else one scale per row."""
    columns = {part.block[1] for part in parts}
    if len(columns) != 1:
        raise ValueError(f"cat_rows: the parts' block columns differ ({sorted(columns)})")
    rows = {part.block[0] for part in parts}
    if dim == 0:  # a stack: the same blocks in every part
        aligned = len(rows) == 1
    else:  # rows: every part but the last ends on a block boundary
        aligned = len(rows) == 1 and all(part.q.shape[-2] % part.block[0] == 0 for part in parts[:-1])
    if not aligned:
        parts = [per_row(part) for part in parts]
    q = torch.cat([part.q for part in parts], dim=dim).contiguous()
    scale = torch.cat([part.scale for part in parts], dim=dim).contiguous()
    return Fp8Weight(q, scale, parts[0].block)


def stack(parts: list[Fp8Weight]) -> Fp8Weight:
    """2-D weights of one shape and block stacked [len(parts), N, K] (experts)."""
    return cat_rows([Fp8Weight(p.q[None], p.scale[None], p.block) for p in parts], dim=0)


def row_slice(weight: Fp8Weight, start: int, stop: int) -> Fp8Weight:
    """Rows start:stop of a 2-D weight as views, when they are whole blocks (or the scale is per row)."""
    rows = weight.block[0]
    if start % rows or (stop % rows and stop != weight.q.shape[-2]):
        raise ValueError(f"row_slice: rows {start}:{stop} are not whole blocks of {rows}")
    return Fp8Weight(weight.q[start:stop], weight.scale[start // rows : math.ceil(stop / rows)], weight.block)


def take_rows(weight: Fp8Weight, index: Tensor) -> Fp8Weight:
    """Rows `index` (a permutation or selection) of a 2-D weight, with one scale per row."""
    weight = per_row(weight)
    return Fp8Weight(weight.q[index].contiguous(), weight.scale[index].contiguous(), weight.block)
