"""Plain decoding through the verifier service, measured from the client (issue 10).

One run, random bf16 weights at Qwen3-30B-A3B shapes (or --small; with --compare, --shapes
picks others, e.g. qwen3.5-35b-a3b), on one GPU:
- the service (`tandem verifier --random-weights`, fused path, CUDA graphs) in a child
  process, a greedy request per context (512-token prompt by default), timed on the client:
  decode tokens/s = (tokens after the first) / (last token's arrival − first token's);
- in this process, on the same weights (same seed): the raw captured 1-row step (graph
  replays timed by CUDA events) and the engine's round loop without gRPC;
- transformers' Qwen3MoeForCausalLM on those weights (generate, greedy), context 512;
- the pre-issue baseline, the service with `--fused off` (reference modules, eager), in a
  fresh child process, a short request;
- a sampled request (temperature 0.8, top-p 0.95) through the fused service.

The service arm and the raw-step arm alternate block by block (order reversed each block);
quoted ratios are medians of per-block ratios. With --compare FLAGS the run is instead two
services on the same weights, the defaults and the defaults plus FLAGS (e.g. "--pdl off",
"--epilogues off"), alternating the same way; --against-tree DIR runs the second service from
another checkout (the code before a change); --requests greedy,sampled times both kinds of
request (sampled: temperature 0.8, top-p 0.95, the block's seed) and reports whether the two
services sent the same tokens.
Usage:
  python bench/serve_decode.py [--small] [--contexts 512,4096,32768] [--new-tokens 256] [--blocks 3]
      [--compare FLAGS] [--against-tree DIR] [--requests greedy,sampled]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench.common import SHAPES, free_port, log, request_spec  # noqa: E402  (puts the repo and protocol modules on sys.path)
from pairbench.services import Children  # noqa: E402

from bench.model_baseline import SMALL, hf_model_sharing_weights  # noqa: E402
from shared.client import GenerationConfig, VerifierClient  # noqa: E402


def client_decode(address: str, prompt: list[int], config: GenerationConfig) -> dict:
    """One request; arrival time of every token event, on the client."""
    arrivals: list[tuple[float, int]] = []
    token_ids: list[int] = []
    with VerifierClient(address, timeout=600) as client:
        sent = time.perf_counter()
        stats = None
        for event in client.stream(prompt, config):
            if event.token_ids:
                arrivals.append((time.perf_counter(), len(event.token_ids)))
                token_ids.extend(event.token_ids)
            if event.HasField("final"):
                stats = event.final.stats
    tokens = sum(n for _, n in arrivals)
    first, last = arrivals[0][0], arrivals[-1][0]
    return {
        "tokens": tokens, "ttft_ms": (first - sent) * 1e3, "e2e_s": last - sent,
        "server_ttft_ms": stats.ttft_ms if stats else float("nan"),
        "decode_tokens_per_s": (tokens - arrivals[0][1]) / (last - first) if last > first else float("nan"),
        "server_tokens_per_s": stats.tokens_per_s if stats else float("nan"), "token_ids": token_ids,
    }


def raw_step_tokens_per_s(runner, context: int, steps: int) -> float:
    """Captured 1-row step replayed `steps` times back to back (device time, CUDA events), at
    position `context` of a slot holding the blocks of that context (as a request's would)."""
    slot, _ = runner.pool.acquire(context + 1)
    try:
        runner.run([(slot, [1], context)])
        graph = runner.last_graph()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        end.synchronize()
        return steps / (start.elapsed_time(end) / 1e3)
    finally:
        runner.pool.release(slot)


def engine_loop(engine, spec) -> tuple[float, float]:
    """The engine's plain rounds in this process (host loop, one sync per token, no gRPC):
    (tokens/s after the first, ms to the first token: prefill + first round)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    session = engine.open(spec)
    try:
        engine.run_round(session, [], None)
        first_ms = (time.perf_counter() - started) * 1e3
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(spec.max_new_tokens - 1):
            engine.run_round(session, [], None)
        return (spec.max_new_tokens - 1) / (time.perf_counter() - t), first_ms
    finally:
        engine.close(session)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--baseline-tokens", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="raw results as JSON")
    parser.add_argument("--compare", default=None, metavar="FLAGS",
                        help='only: the default service against one started with these verifier flags, paired '
                             '(e.g. "--epilogues off"; "" for none, with --against-tree)')
    parser.add_argument("--against-tree", type=Path, default=None, metavar="DIR",
                        help="compare with a service started from this checkout (its defaults, or --compare FLAGS)")
    parser.add_argument("--requests", default="greedy", help="with --compare: greedy, sampled, or both")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                        help="the random model's shapes (others than the default: with --compare / --against-tree)")
    args = parser.parse_args()
    if args.against_tree is not None and args.compare is None:
        args.compare = ""  # another tree's service with its defaults
    if args.shapes != "qwen3-30b-a3b" and args.compare is None:
        parser.error("--shapes other than qwen3-30b-a3b runs with --compare or --against-tree only")
    contexts = [int(c) for c in args.contexts.split(",")]
    max_positions = max(contexts) + args.new_tokens + 64
    shapes = (SMALL if args.small else SHAPES[args.shapes]) | dict(max_position_embeddings=max(max_positions, 4096))
    workdir = Path(tempfile.mkdtemp(prefix="serve-decode-"))
    model_dir = workdir / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(shapes))
    children = Children(workdir)
    rng = random.Random(0)
    prompts = {c: [rng.randrange(shapes["vocab_size"]) for _ in range(c)] for c in contexts}
    results: dict = {"contexts": {}}
    greedy = GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.0, speculation=False)

    def start_service(name: str, extra: list[str], tree: Path | None = None) -> str:
        port = free_port()
        children.start(name, [sys.executable, "-m", "shared.cli", "verifier", "--model", str(model_dir), "--random-weights",
                              "--device", "cuda", "--dtype", "bfloat16", "--port", str(port), "--max-sessions", "1",
                              "--prefill-chunk", "2048", "--grace-s", "2", *extra], tree=tree)
        return f"127.0.0.1:{port}"

    import asyncio

    if args.compare is not None:
        try:
            compare_flags(start_service, children, prompts, contexts, greedy, args, results)
        finally:
            children.stop()
        return

    try:
        address = start_service("verifier", [])
        log("building the in-process model (same weights: seed 0) ...")
        from shared.model import ModelConfig, load_model
        from verifier_service.engine import Engine

        config = ModelConfig.from_dict(shapes)
        model = load_model(config=config, random_weights=True, dtype=torch.bfloat16, device="cuda", seed=0)
        engine = Engine(model, max_context=config.max_position_embeddings, prefill_chunk=2048, fused="on",
                        max_sessions=1, max_window=1)
        asyncio.run(children.wait_serving("verifier", address, timeout=600))
        client_decode(address, prompts[contexts[0]][:64], GenerationConfig(max_new_tokens=8))  # warm-up
        for context in contexts:
            prompt = prompts[context]
            rows = []
            for block in range(args.blocks):
                arms = ["service", "raw"] if block % 2 == 0 else ["raw", "service"]
                row = {}
                for arm in arms:
                    if arm == "service":
                        row["service"] = client_decode(address, prompt, greedy)
                    else:
                        row["raw"] = raw_step_tokens_per_s(engine.runner, context, args.new_tokens)
                row["engine"], row["engine_ttft_ms"] = engine_loop(engine, request_spec(prompt, min(args.new_tokens, 64), max_draft_tokens=0))
                rows.append(row)
                log(f"  context {context} block {block}: service {row['service']['decode_tokens_per_s']:.1f} tok/s, "
                    f"raw step {row['raw']:.1f}, engine loop {row['engine']:.1f}; TTFT ms client "
                    f"{row['service']['ttft_ms']:.0f}, server {row['service']['server_ttft_ms']:.0f}, "
                    f"engine {row['engine_ttft_ms']:.0f}")
            results["contexts"][context] = rows
        sampled = GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.8, top_p=0.95, seed=1, speculation=False)
        results["sampled"] = client_decode(address, prompts[contexts[0]], sampled)
        children.stop("verifier")
        if not args.skip_hf:
            try:
                hf = hf_model_sharing_weights(model)
                ids = torch.tensor([prompts[contexts[0]]], device="cuda")
                with torch.inference_mode():
                    hf.generate(ids, max_new_tokens=2, do_sample=False)
                    timings = {}
                    for n in (1, 33):
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        hf.generate(ids, max_new_tokens=n, do_sample=False)
                        torch.cuda.synchronize()
                        timings[n] = time.perf_counter() - t
                results["transformers_tokens_per_s"] = 32 / (timings[33] - timings[1])
                del hf
            except Exception as error:  # report, keep the rest
                log(f"transformers failed: {type(error).__name__}: {error}")
        del engine, model
        torch.cuda.empty_cache()
        if not args.skip_baseline:
            address = start_service("baseline", ["--fused", "off"])
            asyncio.run(children.wait_serving("baseline", address, timeout=600))
            short = GenerationConfig(max_new_tokens=args.baseline_tokens, temperature=0.0, speculation=False)
            client_decode(address, prompts[contexts[0]][:64], GenerationConfig(max_new_tokens=4))
            results["baseline"] = client_decode(address, prompts[contexts[0]], short)
            children.stop("baseline")
    finally:
        children.stop()
    report(results, args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))


def compare_flags(start_service, children, prompts, contexts, greedy, args, results) -> None:
    import asyncio
    import shlex

    variant = " ".join(filter(None, [f"tree {args.against_tree}" if args.against_tree else "", args.compare])) or "defaults"
    addresses = {"default": start_service("default", []),
                 variant: start_service("variant", shlex.split(args.compare), args.against_tree)}
    for child, address in zip(["default", "variant"], addresses.values()):
        asyncio.run(children.wait_serving(child, address, timeout=900))
        client_decode(address, prompts[contexts[0]][:64], GenerationConfig(max_new_tokens=8))  # warm-up
    kinds = args.requests.split(",")
    print(f"\n| context | request | service tokens/s, this tree | service tokens/s, `{variant}` | this / that (median "
          f"of {args.blocks} paired blocks) | same tokens |")
    print("| ---: | --- | ---: | ---: | ---: | --- |")
    for context in contexts:
        for kind in kinds:
            rows = []
            for block in range(args.blocks):
                config = greedy if kind == "greedy" else GenerationConfig(
                    max_new_tokens=args.new_tokens, temperature=0.8, top_p=0.95, seed=block, speculation=False)
                arms = list(addresses) if block % 2 == 0 else list(reversed(addresses))
                rows.append({arm: client_decode(addresses[arm], prompts[context], config) for arm in arms})
                log(f"  context {context} {kind} block {block}: " + ", ".join(
                    f"{arm} {rows[-1][arm]['decode_tokens_per_s']:.1f} tok/s" for arm in addresses))
            results["contexts"][f"{context} {kind}"] = rows
            on = statistics.median(r["default"]["decode_tokens_per_s"] for r in rows)
            off = statistics.median(r[variant]["decode_tokens_per_s"] for r in rows)
            ratio = statistics.median(r["default"]["decode_tokens_per_s"] / r[variant]["decode_tokens_per_s"] for r in rows)
            same = all(r["default"]["token_ids"] == r[variant]["token_ids"] for r in rows)
            print(f"| {context} | {kind} | {on:.1f} | {off:.1f} | {ratio:.3f} | {same} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))


def report(results: dict, args) -> None:
    print(f"\n| context | service decode tokens/s (client) | TTFT ms (client / server / engine in-process) | raw graph step tokens/s "
          f"| engine loop tokens/s | service / raw (median of {args.blocks} paired blocks) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for context, rows in results["contexts"].items():
        service = statistics.median(r["service"]["decode_tokens_per_s"] for r in rows)
        ttft = statistics.median(r["service"]["ttft_ms"] for r in rows)
        server_ttft = statistics.median(r["service"].get("server_ttft_ms", float("nan")) for r in rows)
        engine_ttft = statistics.median(r.get("engine_ttft_ms", float("nan")) for r in rows)
        raw = statistics.median(r["raw"] for r in rows)
        loop = statistics.median(r["engine"] for r in rows)
        ratio = statistics.median(r["service"]["decode_tokens_per_s"] / r["raw"] for r in rows)
        print(f"| {context} | {service:.1f} | {ttft:.0f} / {server_ttft:.0f} / {engine_ttft:.0f} | {raw:.1f} | {loop:.1f} | {ratio:.3f} |")
    if "sampled" in results:
        s = results["sampled"]
        print(f"\nsampled (temperature 0.8, top-p 0.95), context {next(iter(results['contexts']))}: "
              f"{s['decode_tokens_per_s']:.1f} tokens/s decode")
    if "transformers_tokens_per_s" in results:
        print(f"transformers generate (greedy, same weights), context 512: {results['transformers_tokens_per_s']:.1f} tokens/s")
    if "baseline" in results:
        b = results["baseline"]
        print(f"baseline service (--fused off: reference modules, eager): {b['decode_tokens_per_s']:.1f} tokens/s decode "
              f"({b['tokens']} tokens)")


if __name__ == "__main__":
    main()
