"""Triton code shared by the kernels that read block-scaled FP8 weights (kernels.fused.fp8;
imported only when a kernel runs)."""

import triton
import triton.language as tl


@triton.jit
def dequant_tile(w, s_ptr, s_rows, s_ok, k0, K, SBK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SUB: tl.constexpr):
    """A float8 weight tile w [BLOCK_N, BLOCK_K] (columns k0 ...) in float32 times its block scales:
    s_ptr + s_rows [BLOCK_N] (each row's scale row) + the column's block column. The tile is
    SUB-column pieces, each inside one block column (SUB = min(BLOCK_K, SBK)): a wide tile keeps
    as many bytes in flight per load as a bf16 one though a block is narrower."""
    NSC: tl.constexpr = BLOCK_K // SUB
    j = tl.arange(0, NSC)
    starts = k0 + j * SUB
    s = tl.load(s_ptr + s_rows[:, None] + (starts // SBK)[None, :], mask=s_ok[:, None] & (starts < K)[None, :],
                other=0.0)  # [BLOCK_N, NSC]
    scaled = tl.reshape(w.to(tl.float32), (BLOCK_N, NSC, SUB)) * s[:, :, None]
    return tl.reshape(scaled, (BLOCK_N, BLOCK_K))


@triton.jit
def e4m3_as_bf16(w):
    """Float8 e4m3 values w as exact bf16 values by integer bit moves and one bf16x2 multiply per
    pair, no conversion instructions (CUDA only: inline PTX; Hopper has no e4m3 -> bf16 convert).
    Each 16-bit lane takes a byte in its high half (prmt); sign | magnitude >> 4 puts e4m3's
    exponent and mantissa in bf16's, a value 2^-120 times the true one (bias 127 against 7);
    x 2^120 makes it exact, subnormals included (bf16 arithmetic does not flush them)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b, s, t, k, z;
        mov.b32 k, 0x7B807B80;
        mov.b32 z, 0x80008000;
        prmt.b32 a, $2, 0, 0x1404;
        prmt.b32 b, $2, 0, 0x3424;
        shr.b32 s, a, 4;
        and.b32 s, s, 0x07F007F0;
        and.b32 a, a, 0x80008000;
        or.b32 a, a, s;
        fma.rn.bf16x2 $0, a, k, z;
        shr.b32 t, b, 4;
        and.b32 t, t, 0x07F007F0;
        and.b32 b, b, 0x80008000;
        or.b32 b, b, t;
        fma.rn.bf16x2 $1, b, k, z;
        }""",
        constraints="=r,=r,r",
        args=[w.to(tl.int8, bitcast=True)],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def scaled_dot(a, w, acc, s_ptr, s_rows, s_ok, k0, SBK: tl.constexpr, IEEE: tl.constexpr, ASM: tl.constexpr):
    """acc + (a @ q^T) x scale for a float8 tile w [BLOCK_N, BLOCK_K] inside one block column
    (BLOCK_K divides SBK; k0 its first column): the e4m3 values exactly in a's dtype (ASM: by
    e4m3_as_bf16), the product, then each output column's block scale (at s_ptr + s_rows
    [BLOCK_N] + the block column) on the partial sum. Products of e4m3 and bf16 values are exact
    in float32, so no weight is rounded: per weight there are only bit moves, per output one
    multiply-add a block column."""
    if ASM:
        q = e4m3_as_bf16(w)
    else:
        q = w.to(a.dtype)
    if IEEE:
        part = tl.dot(a, tl.trans(q), input_precision="ieee")
    else:
        part = tl.dot(a, tl.trans(q))
    s = tl.load(s_ptr + s_rows + k0 // SBK, mask=s_ok, other=0.0)  # [BLOCK_N]
    return acc + part * s[None, :]


@triton.jit
def tile_dot(a, w, acc, s_ptr, s_rows, s_ok, k0, K, IEEE: tl.constexpr, FP8: tl.constexpr, SBK: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, EXACT: tl.constexpr,
             ASM: tl.constexpr):
    """acc + a @ w^T: the product of every step of the fused kernels' K loops (linear, the
    experts'). FP8: w [BLOCK_N, BLOCK_K] is float8 with its block scales at s_ptr + s_rows (the
    columns' scale rows): EXACT, the tile's e4m3 values multiplied and the partial product scaled
    (scaled_dot); else dequantised in registers, rounded to a's dtype (dequant_tile)."""
    if FP8 and EXACT:
        return scaled_dot(a, w, acc, s_ptr, s_rows, s_ok, k0, SBK, IEEE, ASM)
    if FP8:
        w = dequant_tile(w, s_ptr, s_rows, s_ok, k0, K, SBK, BLOCK_N, BLOCK_K, SUB).to(a.dtype)
    if IEEE:
        return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(w), acc)


@triton.jit
def exact_bf16_kernel(q_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = e4m3_as_bf16(q) elementwise (kernels.fused.fp8.exact_bf16: the bit moves tested alone)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    q = tl.load(q_ptr + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, e4m3_as_bf16(q), mask=ok)


@triton.jit
def dequantize_kernel(q_ptr, s_ptr, out_ptr, num_rows, N, K, NB, KB, SBN: tl.constexpr, SBK: tl.constexpr,
                      BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """out = q × its block's scale in float32, rounded once to out's dtype (kernels.fused.fp8.
    dequantize_fast: Fp8Weight.dequantize's values). q and out [num_rows, K] with num_rows = L × N (a
    stack of L weights [N, K]); the scales [L, NB, KB] in blocks of SBN × SBK. BF16: out holds
    bfloat16 bit patterns (int16), rounded to nearest even by integer arithmetic — as torch rounds,
    on any backend (Triton's interpreter truncates its own conversion)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (r < num_rows)[:, None] & (k < K)[None, :]
    s_rows = (r // N) * (NB * KB) + (r % N) // SBN * KB  # [BLOCK_R]: each row's scale row
    at = r.to(tl.int64)[:, None] * K + k[None, :]
    q = tl.load(q_ptr + at, mask=ok, other=0.0)
    s = tl.load(s_ptr + s_rows[:, None] + (k // SBK)[None, :], mask=ok, other=0.0)
    w = q.to(tl.float32) * s  # (finite: a product of finite values, or ±inf past float32's range)
    if BF16:
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + at, bits.to(tl.int16), mask=ok)
    else:
        tl.store(out_ptr + at, w.to(out_ptr.dtype.element_ty), mask=ok)
