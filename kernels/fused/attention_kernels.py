"""Triton kernels of kernels.fused.attention (imported only when a kernel runs)."""

import triton
import triton.language as tl


@triton.jit
def _tile_offsets(n0, start, tile, tile_blocks, key_blocks, kv_head, stride_block, stride_pos, d,
                  D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, D] offsets of the keys n0..n0+BLOCK_N-1 (of a split starting at `start`) in the paged cache."""
    this = tile == (n0 - start) // BLOCK_N
    if BLOCK_SIZE % BLOCK_N == 0:
        block = tl.sum(tl.where(this, tile_blocks, 0), axis=0)
        return (block * stride_block + kv_head * D + (n0 % BLOCK_SIZE + tl.arange(0, BLOCK_N))[:, None] * stride_pos
                + d[None, :])
    else:
        n = n0 + tl.arange(0, BLOCK_N)
        block = tl.sum(tl.where(this[:, None], key_blocks, 0), axis=0)  # [BLOCK_N]
        return block[:, None] * stride_block + (n % BLOCK_SIZE)[:, None] * stride_pos + kv_head * D + d[None, :]

@triton.jit
def _attend(q, k, v, n, pos, m_i, l_i, acc, sm_scale, IEEE: tl.constexpr):
    """One tile of keys into the running softmax (m_i, l_i) and output acc of the rows."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
    else:
        s = tl.dot(q, tl.trans(k)) * sm_scale
    s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc

@triton.jit
def split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, seq_start_ptr, seq_slot_ptr, o_part_ptr, lse_part_ptr,
    stride_block, stride_pos, stride_table, sm_scale, num_splits, num_row_blocks,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    # (Reading the rows, block ids and first keys before the wait measured 2% slower: the kernel's
    # loop then starts a tile later and pipelines less; docs/PERFORMANCE.md, session 15.)
    if PDL:  # wait for the predecessor kernel before touching anything it may write or read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    row_block = pid % num_row_blocks
    kv_head = (pid // num_row_blocks) % NUM_KV
    seq = pid // (num_row_blocks * NUM_KV)
    first = tl.load(seq_start_ptr + seq)
    end_row = tl.load(seq_start_ptr + seq + 1)
    slot = tl.load(seq_slot_ptr + seq)
    m = tl.arange(0, BLOCK_M)
    row = first + row_block * ROWS_PER_BLOCK + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = (m < ROWS_PER_BLOCK * GROUP) & (row < end_row)
    pos = tl.load(pos_ptr + row, mask=row_ok, other=-1).to(tl.int32)
    start = split * SPLIT
    last = tl.max(pos, axis=0)
    if start <= last:
        stop = tl.minimum(start + SPLIT, last + 1)
        # The split's block ids first, in one load issued with q's: no load in the key loop
        # waits on another (a dependent load per tile cost ~2% of a decode step at context 512).
        table = table_ptr + slot * stride_table
        tile = tl.arange(0, TILES)
        if BLOCK_SIZE % BLOCK_N == 0:  # a tile lies in one block (tiles start at multiples of BLOCK_N)
            tile_blocks = tl.load(table + (start + tile * BLOCK_N) // BLOCK_SIZE, mask=start + tile * BLOCK_N <= last,
                                  other=0).to(tl.int64)  # [TILES]
            key_blocks = tile_blocks
        else:
            keys = start + tile[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            key_blocks = tl.load(table + keys // BLOCK_SIZE, mask=keys <= last, other=0).to(tl.int64)  # [TILES, BLOCK_N]
            tile_blocks = key_blocks
        d = tl.arange(0, D)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        q = tl.load(q_ptr + (row[:, None] * NUM_Q + head[:, None]) * D + d[None, :], mask=row_ok[:, None], other=0.0)
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < stop
            offs = _tile_offsets(n0, start, tile, tile_blocks, key_blocks, kv_head, stride_block, stride_pos, d,
                                 D, BLOCK_SIZE, BLOCK_N)
            k = tl.load(k_ptr + offs, mask=n_ok[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=n_ok[:, None], other=0.0)
            m_i, l_i, acc = _attend(q, k, v, n, pos, m_i, l_i, acc, sm_scale, IEEE)
        has = l_i > 0
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        part = (row * NUM_Q + head) * num_splits + split
        tl.store(o_part_ptr + part[:, None] * D + d[None, :], out, mask=row_ok[:, None])
        tl.store(lse_part_ptr + part, lse, mask=row_ok)

@triton.jit
def merge_kernel(
    o_part_ptr, lse_part_ptr, pos_ptr, out_ptr, num_splits, gate_ptr, stride_gate_row, stride_gate_head,
    NUM_Q: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr, SLICE: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr, HAS_GATE: tl.constexpr,
):
    # HAS_GATE: out = attn * sigmoid(gate) (GatedAttention: attn and the sigmoid rounded to the dtype, then
    # their product); the gate comes from the q/k/v projection, kernels before the split kernel.
    if PDL and not EARLY:  # wait for the predecessor kernel before touching anything it may write or read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    head = tl.program_id(1)
    column = tl.program_id(2) * SLICE
    used = tl.load(pos_ptr + row).to(tl.int32) // SPLIT + 1  # the splits this row's keys fall in
    d = column + tl.arange(0, SLICE)
    if HAS_GATE and EARLY:
        gate = tl.load(gate_ptr + row * stride_gate_row + head * stride_gate_head + d)
    if PDL and EARLY:  # (the position is the host's input, the gate a kernel's further back: read before the wait)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    base = (row * NUM_Q + head) * num_splits
    c = tl.arange(0, CHUNK)
    top = tl.full((CHUNK,), float("-inf"), tl.float32)
    for s0 in range(0, used, CHUNK):
        top = tl.maximum(top, tl.load(lse_part_ptr + base + s0 + c, mask=s0 + c < used, other=float("-inf")))
    top_all = tl.max(top, axis=0)
    acc = tl.zeros((SLICE,), tl.float32)
    total = tl.zeros((CHUNK,), tl.float32)
    for s0 in range(0, used, CHUNK):
        ok = s0 + c < used
        w = tl.exp(tl.load(lse_part_ptr + base + s0 + c, mask=ok, other=float("-inf")) - top_all)
        parts = tl.load(o_part_ptr + (base + s0 + c)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * parts, axis=0)
        total += w
    out = (acc / tl.sum(total, axis=0)).to(out_ptr.dtype.element_ty)
    if HAS_GATE:
        if not EARLY:
            gate = tl.load(gate_ptr + row * stride_gate_row + head * stride_gate_head + d)
        gate = gate.to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * sig.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (row * NUM_Q + head) * D + d, out)
