"""The CPU step's native kernels against the torch references they replace (kernels/fused/cpu_rows.py).

At the embedded model's shapes (hidden 256, 4 query heads of 64 over 2 KV heads, 16 experts of
128, top 2, a vocabulary of 4,096), rows of 100–200 cache positions, for each op, dtype and row
count: µs a call of the reference and of the native kernel (median of --blocks blocks of --calls
calls, the two alternating block by block; one torch thread), their ratio, and whether every
row computed alone equals the row in the call (row invariance: it must).

    python bench/cpu_rows.py [--rows 1,8,40] [--blocks 5] [--calls 30]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.fused import cpu_rows  # noqa: E402
from kernels.fused.attention import attention_reference  # noqa: E402
from kernels.fused.linear import torch_rowwise_linear  # noqa: E402
from kernels.fused.moe import experts_reference  # noqa: E402
from kernels.fused.norm import add_rmsnorm_reference, qk_norm_rope_reference  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, INTER, TOP_K, VOCAB = 256, 4, 2, 64, 16, 128, 2, 4096
BLOCK_SIZE, SLOTS, BLOCKS_PER_SLOT = 64, 8, 8


def cases(num_rows: int, dtype: torch.dtype, g: torch.Generator):
    """(name, reference(), native(), alone(i) -> row i computed alone, its row of native())."""
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    num_seqs = min(num_rows, SLOTS)
    slots = torch.arange(num_seqs).repeat_interleave(num_rows // num_seqs)  # [T] windows of consecutive rows
    positions = torch.tensor([100 + 13 * (i // (num_rows // num_seqs)) + i % (num_rows // num_seqs)
                              for i in range(num_rows)])
    tables = torch.randperm(SLOTS * BLOCKS_PER_SLOT, generator=g).to(torch.int32).view(SLOTS, BLOCKS_PER_SLOT)
    keys = rand(SLOTS * BLOCKS_PER_SLOT, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    values = rand(SLOTS * BLOCKS_PER_SLOT, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    q = rand(num_rows, HEADS, HEAD_DIM)
    yield ("attention",
           lambda: attention_reference(q, keys, values, tables, positions, slots),
           lambda: cpu_rows.attention(q, keys, values, tables, positions, slots),
           lambda i: cpu_rows.attention(q[i : i + 1], keys, values, tables, positions[i : i + 1], slots[i : i + 1])[0])

    gate_up, down = rand(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5), rand(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5)
    x = rand(num_rows, HIDDEN)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(num_rows)])
    yield ("experts",
           lambda: experts_reference(x, ids, gate_up, down),
           lambda: cpu_rows.experts(x, ids, gate_up, down),
           lambda i: cpu_rows.experts(x[i : i + 1], ids[i : i + 1], gate_up, down))

    for name, num_out in (("linear [512, 256] (qkv)", 2 * HEADS * HEAD_DIM), ("linear [4096, 256] (lm_head)", VOCAB)):
        w = rand(num_out, HIDDEN)
        yield (name, lambda w=w: torch_rowwise_linear(x, w), lambda w=w: cpu_rows.linear(x, w),
               lambda i, w=w: cpu_rows.linear(x[i : i + 1], w)[0])

    residual, weight = rand(num_rows, HIDDEN), rand(HIDDEN, scale=0.1) + 1
    partials = torch.randn(num_rows, 2, HIDDEN, generator=g)
    yield ("add + RMS norm after 2 split-K partials",
           lambda: add_rmsnorm_reference((partials[:, 0] + partials[:, 1]).to(dtype), residual, weight, 1e-6)[0],
           lambda: cpu_rows.add_rmsnorm(partials, residual, weight, 1e-6)[0],
           lambda i: cpu_rows.add_rmsnorm(partials[i : i + 1], residual[i : i + 1], weight, 1e-6)[0][0])

    qkv = rand(num_rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q_norm, k_norm = rand(HEAD_DIM, scale=0.1) + 1, rand(HEAD_DIM, scale=0.1) + 1
    angles = torch.arange(2048).float()[:, None] / (10000 ** (torch.arange(HEAD_DIM // 2).float() / (HEAD_DIM // 2)))
    cos, sin = torch.cat([angles.cos()] * 2, dim=1), torch.cat([angles.sin()] * 2, dim=1)
    keys_out, values_out = keys.clone(), values.clone()

    def native_rope(rows=slice(None)):
        return cpu_rows.qk_norm_rope_store(qkv[rows], q_norm, k_norm, cos, sin, positions[rows], slots[rows], keys_out,
                                           values_out, tables, HEADS, KV_HEADS, 1e-6, False, HEAD_DIM, HEAD_DIM)

    yield ("q/k norms + RoPE (+ the KV write)",
           lambda: qk_norm_rope_reference(qkv, q_norm, k_norm, cos, sin, positions, HEADS, KV_HEADS, 1e-6)[0],
           native_rope, lambda i: native_rope(slice(i, i + 1))[0])


def timed(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,40")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not cpu_rows.available():
        raise SystemExit("the native kernels are not built: pip install -e . (or python setup.py build_ext --inplace)")
    torch.set_num_threads(1)
    print(f"### cpu_rows: {datetime.date.today()}, {platform.node()}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, one thread, median of {args.blocks} blocks of {args.calls} calls\n")
    print("| op | dtype | rows | reference µs | native µs | reference / native | rows alone = in the call |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        for num_rows in rows:
            g = torch.Generator().manual_seed(num_rows)
            for name, reference, native, alone in cases(num_rows, dtype, g):
                out = native()
                same = all(torch.equal(alone(i), out[i] if name != "experts" else out[TOP_K * i : TOP_K * i + TOP_K])
                           for i in range(num_rows))
                reference(), native()  # warm
                times = {"reference": [], "native": []}
                for _ in range(args.blocks):
                    for arm, fn in (("reference", reference), ("native", native)):
                        times[arm].append(timed(fn, args.calls))
                ref, nat = statistics.median(times["reference"]), statistics.median(times["native"])
                print(f"| {name} | {str(dtype).split('.')[-1]} | {num_rows} | {ref:,.0f} | {nat:,.0f} | {ref / nat:.2f} | "
                      f"{'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
