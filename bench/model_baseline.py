"""Batch-1 decode baseline of the target trunk on a GPU (issue 3).

Random bf16 weights at Qwen3-30B-A3B shapes (or --small for a smoke run), one process,
measured side by side:
- decode tokens/s of our trunk: eager, and CUDA-graph-captured per expert path;
- transformers' Qwen3MoeForCausalLM on the same weights (generate, greedy);
- the bandwidth floor: active bytes per token / measured device copy bandwidth;
- verify-window cost curve time(w)/time(1), w = 1..8, with distinct experts touched;
- a profile summary of one graph-free decode step (top CUDA kernels).

Usage: python bench/model_baseline.py [--small] [--context 512] [--steps 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

from shared.model import ModelConfig, load_model

QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6, model_type="qwen3_moe",
)
SMALL = QWEN3_30B_A3B | dict(num_hidden_layers=4, vocab_size=32000)


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def cuda_time(fn, repeats: int) -> list[float]:
    """Per-call milliseconds of fn() over `repeats` calls, each timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), 4 GiB buffers."""
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = statistics.median(cuda_time(lambda: dst.copy_(src), 10))
    return 2 * n / (ms / 1e3)


def active_bytes_per_token(model, context: int) -> int:
    c = model.config
    total = 0
    per_layer_dense = 0
    for name, p in model.layers[0].named_parameters():
        if "mlp.gate" not in name:
            per_layer_dense += p.numel() * p.element_size()
    router = c.num_experts * c.hidden_size * 2
    expert = model.layers[0].mlp.experts.expert_bytes
    total += c.num_hidden_layers * (per_layer_dense + router + c.num_experts_per_tok * expert)
    total += model.lm_head.weight.numel() * 2 + model.norm.weight.numel() * 2 + c.hidden_size * 2
    total += c.num_hidden_layers * 2 * context * c.num_key_value_heads * c.head_dim * 2  # KV reads
    return total


class GraphDecoder:
    """Greedy decode of one token per replay, fully on the device (token fed back in-graph)."""

    def __init__(self, model, cache, first_token: int, position: int, window: int = 1):
        self.ids = torch.full((window,), first_token, dtype=torch.int64, device="cuda")
        self.positions = torch.arange(position, position + window, device="cuda")
        self.feedback = window == 1
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up outside the graph (allocator, autotuning)
                self._body(model, cache, advance=False)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._body(model, cache, advance=self.feedback)

    def _body(self, model, cache, advance: bool):
        logits, _ = model(self.ids, cache, positions=self.positions)
        if advance:
            self.ids.copy_(logits[-1:].argmax(-1))
            self.positions.add_(1)
        return logits

    def replay(self):
        self.graph.replay()


def hf_model_sharing_weights(model):
    """transformers' Qwen3MoeForCausalLM whose parameters are our tensors (no copy)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    c = model.config
    config = Qwen3MoeConfig(**{k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"} | dict(
        vocab_size=c.vocab_size, num_hidden_layers=c.num_hidden_layers, max_position_embeddings=c.max_position_embeddings))
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(config)
    state = {}
    for name, param in model.named_parameters():
        if name.startswith("mtp."):
            continue
        state[name if name.startswith("lm_head") else "model." + name] = param
    for i, layer in enumerate(model.layers):
        store = layer.mlp.experts
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = store.gate_up
        state[f"model.layers.{i}.mlp.experts.down_proj"] = store.down
    hf.load_state_dict(state, assign=True, strict=True)
    hf.model.rotary_emb = Qwen3MoeRotaryEmbedding(config, device="cuda")
    return hf.eval().to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="4 layers, for a smoke run")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    shapes = SMALL if args.small else QWEN3_30B_A3B
    config = ModelConfig.from_dict(shapes)
    log(f"building random bf16 model on cuda: {config.num_hidden_layers} layers, {config.num_experts} experts")
    t0 = time.perf_counter()
    model = load_model(config=config, random_weights=True, dtype=torch.bfloat16, device="cuda", seed=0)
    torch.cuda.synchronize()
    log(f"built in {time.perf_counter() - t0:.1f}s; GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    stores = [layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts")]
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (args.context,), generator=gen).cuda()
    cache_len = args.context + args.steps + 16
    rows = []

    def prefill():
        cache = model.new_cache(cache_len)
        logits, _ = model(prompt, cache)
        return cache, int(logits[-1].argmax())

    # The sync-free expert paths must agree with dispatch (bf16 rounding aside).
    reference, _ = model.score(prompt[:64])
    for path in ("gather", "grouped"):
        try:
            for store in stores:
                store.path = path
            logits, _ = model.score(prompt[:64])
            agree = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
            log(f"{path} vs dispatch: max |logit diff| {float((logits - reference).abs().max()):.4f}, argmax agreement {agree:.3f}")
        except Exception as error:
            log(f"{path} path failed: {type(error).__name__}: {error}")
    for store in stores:
        store.path = None

    # Eager decode (dispatch path: synchronises per MoE layer).
    for store in stores:
        store.path = "dispatch"
    cache, token = prefill()
    tok = torch.tensor([token], device="cuda")

    def eager_step():
        nonlocal tok
        logits, _ = model(tok, cache)
        tok = logits[-1:].argmax(-1)

    eager_step()
    ms = cuda_time(eager_step, 16)
    rows.append(("ours eager (dispatch experts)", statistics.median(ms)))
    log(f"eager: {statistics.median(ms):.2f} ms/token")

    graph_ms = {}
    for path in ("gather", "grouped"):
        try:
            for store in stores:
                store.path = path
            cache, token = prefill()
            decoder = GraphDecoder(model, cache, token, args.context)
            decoder.replay()
            ms = cuda_time(decoder.replay, args.steps)
            graph_ms[path] = statistics.median(ms)
            rows.append((f"ours CUDA graph ({path} experts)", graph_ms[path]))
            log(f"graph {path}: {graph_ms[path]:.2f} ms/token")
            del decoder, cache
        except Exception as error:  # report, keep measuring the rest
            log(f"graph {path} failed: {type(error).__name__}: {error}")
            traceback.print_exc(limit=-4)
    best_path = min(graph_ms, key=graph_ms.get) if graph_ms else "dispatch"
    for store in stores:
        store.path = best_path

    if not args.skip_hf:
        try:
            hf = hf_model_sharing_weights(model)
            ids = prompt[None]
            with torch.inference_mode():
                hf.generate(ids, max_new_tokens=2, do_sample=False)
                timings = {}
                for n in (1, 1 + args.steps // 2):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    hf.generate(ids, max_new_tokens=n, do_sample=False)
                    torch.cuda.synchronize()
                    timings[n] = time.perf_counter() - t
            hf_ms = (timings[1 + args.steps // 2] - timings[1]) / (args.steps // 2) * 1e3
            impl = getattr(hf.config, "_experts_implementation", "default")
            rows.append((f"transformers generate (greedy, experts: {impl})", hf_ms))
            log(f"hf: {hf_ms:.2f} ms/token")
            del hf
        except Exception as error:
            log(f"transformers failed: {type(error).__name__}: {error}")

    bandwidth = copy_bandwidth()
    active = active_bytes_per_token(model, args.context)
    floor_ms = active / bandwidth * 1e3
    rows.append(("bandwidth floor", floor_ms))

    print(f"\n| decode, batch 1, context {args.context} | ms/token | tokens/s | fraction of floor |")
    print("| --- | ---: | ---: | ---: |")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {1e3 / ms:.1f} | {floor_ms / ms:.2f} |")
    print(f"\nactive bytes/token {active / 1e9:.3f} GB; copy bandwidth {bandwidth / 1e12:.2f} TB/s")

    # Verify-window cost curve (graph-captured, best path) and distinct experts touched.
    seen: list[set[int]] = []
    originals = {}

    def recording(store):
        original = store.forward
        originals[store] = original

        def forward(hidden, expert_ids, weights, *, path=None):
            seen.append(set(expert_ids.reshape(-1).tolist()))
            return original(hidden, expert_ids, weights, path="dispatch")

        return forward

    print("\n| window w | ms | time(w)/time(1) | distinct experts per MoE layer (mean) |")
    print("| ---: | ---: | ---: | ---: |")
    base = None
    for w in range(1, 9):
        cache, token = prefill()
        window_ids = torch.randint(0, config.vocab_size, (w,), generator=gen).cuda()
        decoder = GraphDecoder(model, cache, token, args.context, window=w)
        decoder.ids.copy_(window_ids)
        ms = statistics.median(cuda_time(decoder.replay, 32))
        del decoder
        base = base or ms
        seen.clear()
        for store in stores:
            store.forward = recording(store)
        cache.truncate(args.context)
        model(window_ids, cache)
        for store in stores:
            del store.forward  # back to the class method
        distinct = statistics.mean(len(s) for s in seen)
        print(f"| {w} | {ms:.2f} | {ms / base:.2f} | {distinct:.1f} |")

    # Profile one eager step with the best sync-free path.
    cache, token = prefill()
    tok = torch.tensor([token], device="cuda")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            model(tok, cache)
        torch.cuda.synchronize()
    print("\nprofile (3 eager steps, %s experts), top CUDA kernels:" % best_path)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
