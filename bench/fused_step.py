"""The fused, graph-captured decode/verify step of the target trunk on a GPU (issue 10).

Random bf16 weights at Qwen3-30B-A3B shapes (or --small), one process. Reports:
- correctness: fused-path logits against the reference modules at several windows and
  contexts (relative error, argmax agreement);
- row invariance: the fraction of verify-window rows whose logits are bit-identical to the
  one-row steps at the same positions;
- decode ms/token (1-row graph replay) at each context, against the bandwidth floor
  (active weight bytes + KV bytes read, over the measured copy bandwidth);
- the verify-window cost curve time(T)/time(1) with the distinct experts per MoE layer;
- per-kernel device time at 1 row (graph-timed) and, with --sweep, launch-configuration sweeps;
- prefill throughput of a long prompt through the reference modules, by chunk size.

Usage: python bench/fused_step.py [--small] [--contexts 512,4096,32768] [--sweep]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import traceback

import torch

from bench.model_baseline import QWEN3_30B_A3B, SMALL, GraphDecoder, copy_bandwidth, cuda_time
from shared.model import KVCache, ModelConfig, load_model
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model.rows import Rows
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def graph_time(fn, calls: int = 20, repeats: int = 20) -> float:
    """Device milliseconds per fn() call: `calls` calls captured in one graph, median of replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return statistics.median(cuda_time(graph.replay, repeats)) / calls


def replay_time(runner: FusedRunner, rows: int, position: int, repeats: int = 50) -> float:
    """Median ms of one captured window of `rows` rows at `position` (inputs set once)."""
    runner.run([(0, [1] * rows, position)])
    graph, _ = runner.graphs[rows]
    return statistics.median(cuda_time(graph.replay, repeats))


def weight_bytes_per_token(model) -> int:
    c = model.config
    layer = model.layers[0]
    dense = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if "mlp.gate" not in n)
    router = c.num_experts * c.hidden_size * 2
    experts = c.num_experts_per_tok * layer.mlp.experts.expert_bytes
    return c.num_hidden_layers * (dense + router + experts) + model.lm_head.weight.numel() * 2


def kv_bytes(model, context: int) -> int:
    c = model.config
    return c.num_hidden_layers * 2 * context * c.num_key_value_heads * c.head_dim * 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--windows", default="1,2,3,4,5,8,17")
    parser.add_argument("--sweep", action="store_true", help="launch-configuration sweeps of the big kernels")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--check-only", action="store_true", help="correctness and invariance only")
    parser.add_argument("--tables", default="pdl,reference,windows,kernels",
                        help="which timing tables to print (comma-separated)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    max_length = max(contexts) + max(windows) + 8
    shapes = (SMALL if args.small else QWEN3_30B_A3B) | dict(max_position_embeddings=max(max_length, 4096 + 64))
    config = ModelConfig.from_dict(shapes)
    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    model = load_model(config=config, random_weights=True, dtype=dtype, device="cuda", seed=0)
    torch.cuda.synchronize()
    log(f"model built in {time.perf_counter() - t0:.1f}s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    c = config
    pool = KVPool(num_layers=c.num_hidden_layers, num_slots=1, max_length=max_length, num_kv_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    pool.keys.normal_(0, 1, generator=gen)  # stand-in context: attention cost does not depend on the values
    pool.values.normal_(0, 1, generator=gen)
    fused = FusedModel(model, max_rows=max(windows), max_length=max_length)
    runner = FusedRunner(fused, pool, max_rows=max(windows))
    t0 = time.perf_counter()
    runner.capture(windows, progress=lambda what, s: log(f"  captured {what} in {s:.2f}s"))
    log(f"captured {len(windows)} windows in {time.perf_counter() - t0:.1f}s")
    token_gen = torch.Generator().manual_seed(5)

    def random_tokens(n):
        return torch.randint(0, c.vocab_size, (n,), generator=token_gen).tolist()

    # -- correctness and invariance -----------------------------------------------------------
    # The reference modules run the same window through each CUDA expert path; "ref window vs
    # ref 1-row" is the reference's own spread between a window and single rows (its bf16
    # numerical noise floor, against which the fused path's error is read).
    stores = [layer.mlp.experts for layer in model.layers]

    def reference(tokens, context, path):
        for store in stores:
            store.path = path
        cache = KVCache.view(pool.keys[:, 0], pool.values[:, 0])
        cache.length = context
        logits, _ = model(torch.tensor(tokens, device="cuda"), cache)
        for store in stores:
            store.path = None
        return logits

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    def agree(a, b):
        return float((a.argmax(-1) == b.argmax(-1)).float().mean())

    print(f"\n{args.dtype}: | context | window | fused vs ref (dispatch): rel. error, argmax agreement | fused vs ref (grouped) "
          "| ref grouped vs dispatch | ref window vs ref 1-row steps | fused rows bit-identical to fused 1-row steps |")
    print("| ---: | ---: | --- | --- | --- | --- | ---: |")
    for context in contexts[:2]:
        for rows in [w for w in (1, 5, max(windows)) if w in windows]:
            tokens = random_tokens(rows)
            singles = torch.cat([reference(tokens[j : j + 1], context + j, "dispatch") for j in range(rows)])
            ref = {path: reference(tokens, context, path) for path in ("grouped", "dispatch")}
            fused_logits = runner.run([(0, tokens, context)]).logits.clone()  # rewrites the window's KV rows
            same = 0
            for j in range(rows):  # the window wrote rows context..; re-run each as a 1-row step
                single = runner.run([(0, tokens[j : j + 1], context + j)])
                same += int(torch.equal(single.logits[0], fused_logits[j]))
            d, g = ref["dispatch"], ref["grouped"]
            print(f"| {context} | {rows} | {rel(fused_logits, d):.2e}, {agree(fused_logits, d):.2f} "
                  f"| {rel(fused_logits, g):.2e}, {agree(fused_logits, g):.2f} | {rel(g, d):.2e}, {agree(g, d):.2f} "
                  f"| {rel(d, singles):.2e}, {agree(d, singles):.2f} | {same}/{rows} |")
    if args.check_only:
        return

    # -- decode and the window curve ----------------------------------------------------------
    bandwidth = copy_bandwidth()
    weights = weight_bytes_per_token(model)
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; active weight bytes/token {weights / 1e9:.3f} GB")
    print("\n| context | decode ms/token (graph) | tokens/s | floor ms | fraction of floor |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    decode_ms = {}
    for context in contexts:
        ms = replay_time(runner, 1, context)
        decode_ms[context] = ms
        floor = (weights + kv_bytes(model, context)) / bandwidth * 1e3
        print(f"| {context} | {ms:.3f} | {1e3 / ms:.1f} | {floor:.3f} | {floor / ms:.2f} |")

    tables = set(args.tables.split(","))
    if "pdl" in tables:
        try:
            pdl_table(runner, pool, contexts, max_length, random_tokens)
        except Exception:
            traceback.print_exc()

    try:  # the previous best: the reference modules captured whole (gather experts), same weights
        stores = [layer.mlp.experts for layer in model.layers]
        for store in stores:
            store.path = "gather"
        for context in contexts[:1] if "reference" in tables else []:
            # a cache just past the steps timed: the static-shape reference attends over all of it
            cache = KVCache.view(pool.keys[:, 0, : context + 64], pool.values[:, 0, : context + 64])
            cache.length = context
            decoder = GraphDecoder(model, cache, 1, context)
            ms = statistics.median(cuda_time(decoder.graph.replay, 50))
            fused_ms = replay_time(runner, 1, context)
            print(f"\nreference modules, CUDA graph (gather experts), context {context}: {ms:.3f} ms/token; "
                  f"fused graph {fused_ms:.3f} ms/token; ratio {ms / fused_ms:.2f}x")
            del decoder
        for store in stores:
            store.path = None
    except Exception:
        traceback.print_exc()

    distinct = distinct_experts(fused, runner, windows, contexts[0], random_tokens) if "windows" in tables else {}
    print("\n| context | window T | ms | time(T)/time(1) | distinct experts per MoE layer |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for context in contexts if "windows" in tables else []:
        for rows in windows:
            ms = replay_time(runner, rows, context)
            print(f"| {context} | {rows} | {ms:.3f} | {ms / decode_ms[context]:.2f} | {distinct.get(rows, float('nan')):.1f} |")

    try:
        if "kernels" in tables:
            kernel_table(model, fused, pool, contexts, args.sweep)
    except Exception:
        traceback.print_exc()
    if not args.skip_prefill:
        try:
            prefill_table(model, pool)
        except Exception:
            traceback.print_exc()


def paired_table(label: str, runner, other, sizes, contexts, random_tokens, pairs: int = 9) -> None:
    """The default graphs against a variant's (`other`) on the same weights and pool: timed
    interleaved (median of paired ratios), logits compared bit for bit."""
    print(f"\n| context | window T | default ms | {label} ms | {label}/default (median of paired ratios) "
          "| logits bit-identical |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for context in contexts:
        for rows in sizes:
            tokens = random_tokens(rows)
            same = torch.equal(runner.run([(0, tokens, context)]).logits.clone(), other.run([(0, tokens, context)]).logits)
            on, off = [], []
            for _ in range(pairs):
                on.append(replay_time(runner, rows, context, repeats=20))
                off.append(replay_time(other, rows, context, repeats=20))
            ratio = statistics.median(b / a for a, b in zip(on, off))
            print(f"| {context} | {rows} | {statistics.median(on):.3f} | {statistics.median(off):.3f} | {ratio:.3f} "
                  f"| {same} |")


def variant_runner(runner, pool, max_length, **fused_options):
    """Window graphs of the same model through a FusedModel built with other options."""
    fused = FusedModel(runner.fused.model, max_rows=runner.max_rows, max_length=max_length, **fused_options)
    return FusedRunner(fused, pool, max_rows=runner.max_rows)


def pdl_table(runner, pool, contexts, max_length, random_tokens) -> None:
    """Programmatic dependent launch (the default where supported) against plain launches.
    (Weight prefetch into L2 before the wait and a late trigger were tried the same way and
    measured slower: docs/PERFORMANCE.md.)"""
    if not runner.fused.pdl:
        log("no programmatic dependent launch on this GPU: no PDL table")
        return
    plain = variant_runner(runner, pool, max_length, pdl=False)
    sizes = [1, 5] if runner.max_rows >= 5 else [1]
    plain.capture(sizes)
    paired_table("plain launches", runner, plain, sizes, contexts, random_tokens)


@contextlib.contextmanager
def distinct_experts_seen():
    """While open, every eager fused forward appends each MoE layer's count of distinct
    experts (over its rows' routes; padding ids -1 excluded) to the yielded list."""
    import shared.model.families.qwen3_moe.fused as fast

    seen: list[int] = []
    original = fast.route

    def recording(*a, **k):
        ids, weights = original(*a, **k)
        seen.append(len({e for e in ids.reshape(-1).tolist() if e >= 0}))
        return ids, weights

    fast.route = recording
    try:
        yield seen
    finally:
        fast.route = original


def distinct_experts(fused, runner, windows, context, random_tokens) -> dict[int, float]:
    """Mean distinct experts per MoE layer a window of random tokens selects (eager fused run)."""
    out = {}
    with distinct_experts_seen() as seen:
        for rows in windows:
            seen.clear()
            tokens = torch.tensor(random_tokens(rows), device="cuda")
            fused.forward(tokens, Rows.window(context, rows, 0, "cuda"), runner.kv)
            out[rows] = statistics.mean(seen)
    return out


def kernel_table(model, fused, pool, contexts, sweep: bool) -> None:
    import kernels.fused.linear as lin
    import kernels.fused.moe as moe
    from kernels.fused.attention import decode_attention
    from kernels.fused.norm import add_rmsnorm, qk_norm_rope_store
    from kernels.fused.router import route

    c = model.config
    layer = fused.layers[0]
    x1 = torch.randn(1, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    print("\n| kernel (1 row unless noted) | µs | GB/s |")
    print("| --- | ---: | ---: |")

    def row(name, fn, nbytes):
        us = graph_time(fn) * 1e3
        print(f"| {name} | {us:.1f} | {nbytes / us / 1e3:.0f} |")
        return us

    mats = {"qkv": layer.qkv, "o_proj": layer.o, "router": layer.router, "lm_head": model.lm_head.weight}
    for name, w in mats.items():
        x = torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16)
        nbytes = w.numel() * 2
        row(f"linear {name} {tuple(w.shape)} triton", lambda: lin.linear(x, w), nbytes)
        row(f"linear {name} cuBLAS", lambda: torch.nn.functional.linear(x, w), nbytes)
        x5 = torch.randn(5, w.shape[1], device="cuda", dtype=torch.bfloat16)
        row(f"linear {name} triton, 5 rows", lambda: lin.linear(x5, w), nbytes)
        row(f"linear {name} cuBLAS, 5 rows", lambda: torch.nn.functional.linear(x5, w), nbytes)
        if sweep:
            original = lin.linear_config
            for bn in (32, 64, 128):
                for bk in (256, 512):
                    for stages in (3,):
                        lin.linear_config = lambda n, k, bn=bn, bk=bk, st=stages: (bn, bk, 4, st)
                        try:
                            row(f"  sweep {name} BN={bn} BK={bk} stages={stages}", lambda: lin.linear(x, w), nbytes)
                        except Exception as error:
                            print(f"|  sweep {name} BN={bn} BK={bk} stages={stages} failed: {type(error).__name__} | | |")
            lin.linear_config = original

    store = layer.store
    ids = torch.tensor([[3, 17, 29, 40, 55, 70, 101, 120]], device="cuda")[:, : c.num_experts_per_tok] % c.num_experts
    expert_bytes = ids.shape[1] * store.expert_bytes
    row("fused experts (gate_up + down), 8 experts", lambda: moe.fused_experts(x1, ids, store.gate_up, store.down),
        expert_bytes)
    weights = torch.full(ids.shape, 1.0 / ids.shape[1], device="cuda")
    row("grouped_mm experts (reference CUDA path)", lambda: store.forward(x1, ids, weights.to(torch.bfloat16), path="grouped"), expert_bytes)
    if sweep:
        original = moe.moe_config
        gate_up_shape = (store.gate_up.shape[1], store.gate_up.shape[2])
        for matrix in ("gate_up", "down"):
            for bn in (16, 32, 64, 128):
                for bk in (64, 128, 256):
                    for warps in (4, 8):
                        def config(n, k, bn=bn, bk=bk, warps=warps, matrix=matrix):
                            if ((n, k) == gate_up_shape) == (matrix == "gate_up"):
                                return bn, bk, warps, 4
                            return original(n, k)

                        moe.moe_config = config
                        try:
                            row(f"  sweep experts {matrix} BN={bn} BK={bk} warps={warps}",
                                lambda: moe.fused_experts(x1, ids, store.gate_up, store.down), expert_bytes)
                        except Exception as error:
                            print(f"|  sweep experts {matrix} BN={bn} BK={bk} failed: {type(error).__name__} | | |")
        moe.moe_config = original
    route_out = torch.randn(ids.shape[1], c.hidden_size, device="cuda")
    row("combine + residual + rmsnorm", lambda: moe.combine_add_rmsnorm(route_out, weights, x1, layer.post_norm, 1e-6), 0)
    row("add + rmsnorm", lambda: add_rmsnorm(x1, x1, layer.post_norm, 1e-6), 0)
    router_logits = torch.randn(1, c.num_experts, device="cuda", dtype=torch.bfloat16)
    row("router softmax/top-k", lambda: route(router_logits, c.num_experts_per_tok, normalize=True), 0)
    qkv = torch.randn(1, layer.qkv.shape[0], device="cuda", dtype=torch.bfloat16)
    keys, values = pool.keys[0], pool.values[0]
    pos = torch.tensor([100], device="cuda")
    slot = torch.zeros(1, dtype=torch.int64, device="cuda")
    row("q/k norm + rope + kv write", lambda: qk_norm_rope_store(
        qkv, layer.q_norm, layer.k_norm, fused.cos, fused.sin, pos, slot, keys, values, pool.block_tables,
        c.num_attention_heads,
        c.num_key_value_heads, 1e-6), 0)
    q = torch.randn(5, c.num_attention_heads, c.head_dim, device="cuda", dtype=torch.bfloat16)
    for context in contexts:
        for rows in (1, 5):
            positions = torch.arange(context, context + rows, device="cuda")
            slots = torch.zeros(rows, dtype=torch.int64, device="cuda")
            starts = torch.tensor([0, rows], dtype=torch.int32, device="cuda")
            row(f"attention, context {context}, {rows} rows", lambda: decode_attention(
                q[:rows], keys, values, pool.block_tables, positions, slots, starts, slots[:1], rows, fused.workspace),
                2 * context * c.num_key_value_heads * c.head_dim * 2)


def prefill_table(model, pool) -> None:
    c = model.config
    length = min(4096, pool.max_length - 1)
    prompt = torch.randint(0, c.vocab_size, (length,), device="cuda")
    print(f"\n| prefill, {length}-token prompt, reference modules | chunk | s | tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    for chunk in (256, 1024, 2048):
        for attempt in range(2):  # the first run warms up
            cache = KVCache.view(pool.keys[:, 0], pool.values[:, 0])
            torch.cuda.synchronize()
            t = time.perf_counter()
            for start in range(0, length, chunk):
                model(prompt[start : start + chunk], cache)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t
        print(f"| | {chunk} | {seconds:.3f} | {length / seconds:.0f} |")


if __name__ == "__main__":
    main()
