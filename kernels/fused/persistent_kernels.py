"""Triton kernels of kernels.fused.persistent (imported only when a kernel runs)."""

import triton
import triton.language as tl

from kernels.fused.fp8_kernels import tile_dot

# A stage's entry in the chain's table: int64 fields (weight, out, in) addresses, num_out, num_in,
# splits, k_per_split, in_splits (kernels.fused.persistent.ChainPlan builds it).
FIELDS: tl.constexpr = 8


@triton.jit
def grid_barrier(counter_ptr, target):
    """Every program waits here until `target` arrivals were counted (the counter only grows: the
    n-th barrier of a launch waits for n × programs, so it never needs resetting between stages).
    The CTA barrier before the arrival orders this program's stores before it (the release makes
    them visible GPU-wide); the acquire before leaving orders the next stage's loads after the
    other programs' stores."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while arrived < target:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def prefetch_l2(ptrs):
    """One L2 prefetch per pointer (a cache line each): the weights a program reads next start
    streaming from HBM before the data they multiply exists."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_share(entry, pid, num_programs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                   LINE: tl.constexpr):
    """Prefetch into L2 every weight line of a stage that this program will multiply."""
    w_ptr = tl.load(entry + 0).to(tl.pointer_type(DTYPE))
    num_out = tl.load(entry + 3).to(tl.int32)
    num_in = tl.load(entry + 4).to(tl.int32)
    splits = tl.load(entry + 5).to(tl.int32)
    k_per_split = tl.load(entry + 6).to(tl.int32)
    ns = tl.arange(0, BLOCK_N)
    lines = tl.arange(0, BLOCK_K // LINE) * LINE
    for item in range(pid, tl.cdiv(num_out, BLOCK_N) * splits, num_programs):
        cols = (item // splits) * BLOCK_N + ns
        k_start = (item % splits) * k_per_split
        k_stop = tl.minimum(num_in, k_start + k_per_split)
        for k0 in range(k_start, k_stop, BLOCK_K):
            prefetch_l2(w_ptr + tl.minimum(cols, num_out - 1)[:, None] * num_in
                        + tl.minimum(k0 + lines, num_in - 1)[None, :])


@triton.jit
def chain_kernel(
    table_ptr, counter_ptr, chain_length, M,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
    IEEE: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, MAX_IN_SPLITS: tl.constexpr,
):
    """Every stage of a chain of products in one launch: stage s multiplies the sum of stage s-1's
    split-K partials (in split order, rounded to DTYPE) by its weight and writes its own partials;
    the programs stay resident, each taking the stage's (column block, split) items round-robin,
    and meet at a grid barrier between stages. A K loop is linear_kernel's (same tiles, same
    order, the same product), so with the same tiles a stage's partials are linear_partials'.
    PREFETCH: 0 none; 1 the next stage's share of weights prefetched into L2 before the barrier;
    2 at the stage's start, so HBM streams the next stage's weights while this one runs."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ns = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    for stage in range(chain_length):
        entry = table_ptr + stage * FIELDS
        if PREFETCH == 2:
            if stage + 1 < chain_length:
                prefetch_share(entry + FIELDS, pid, num_programs, BLOCK_N, BLOCK_K, DTYPE, LINE)
        w_ptr = tl.load(entry + 0).to(tl.pointer_type(DTYPE))
        out_ptr = tl.load(entry + 1).to(tl.pointer_type(tl.float32))  # [splits, M, num_out]
        in_ptr = tl.load(entry + 2).to(tl.pointer_type(tl.float32))  # [in_splits, M, num_in]
        num_out = tl.load(entry + 3).to(tl.int32)
        num_in = tl.load(entry + 4).to(tl.int32)
        splits = tl.load(entry + 5).to(tl.int32)
        k_per_split = tl.load(entry + 6).to(tl.int32)
        in_splits = tl.load(entry + 7).to(tl.int32)
        for item in range(pid, tl.cdiv(num_out, BLOCK_N) * splits, num_programs):
            split = item % splits
            cols = (item // splits) * BLOCK_N + ns
            col_ok = cols < num_out
            k_start = split * k_per_split
            k_stop = tl.minimum(num_in, k_start + k_per_split)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(k_start, k_stop, BLOCK_K):
                kk = k0 + ks
                k_ok = kk < num_in
                x_ok = row_ok[:, None] & k_ok[None, :]
                # (the other programs' partials: read through L2, never a stale L1 line)
                xs = tl.load(in_ptr + rows[:, None] * num_in + kk[None, :], mask=x_ok, other=0.0, cache_modifier=".cg")
                # (unrolled, masked past in_splits: a loop nested in the K loop would keep the
                # compiler from pipelining the weight loads)
                for j in tl.static_range(1, MAX_IN_SPLITS):
                    xs += tl.load(in_ptr + j * M * num_in + rows[:, None] * num_in + kk[None, :],
                                  mask=x_ok & (j < in_splits), other=0.0, cache_modifier=".cg")
                w = tl.load(w_ptr + cols[:, None] * num_in + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc = tile_dot(xs.to(DTYPE), w, acc, w_ptr, cols, col_ok, k0, num_in, IEEE, False, 1, BLOCK_N, BLOCK_K,
                               BLOCK_K, False, False)
            tl.store(out_ptr + split * M * num_out + rows[:, None] * num_out + cols[None, :], acc,
                     mask=row_ok[:, None] & col_ok[None, :])
        if PREFETCH == 1:
            if stage + 1 < chain_length:
                prefetch_share(entry + FIELDS, pid, num_programs, BLOCK_N, BLOCK_K, DTYPE, LINE)
        grid_barrier(counter_ptr, (stage + 1) * num_programs)
