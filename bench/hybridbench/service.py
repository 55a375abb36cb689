"""`--part service` of bench/hybrid_fast.py: `tandem verifier --random-weights` at the hybrid
shapes (`--shapes`, with `--verifier-args`, e.g. "--quantize fp8") in a child process, measured
from the client."""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from hybridbench.common import elapsed
from pairbench.common import SHAPES, free_port, log

def run_service(args) -> dict:
    from pairbench.services import Children

    from bench.serve_decode import client_decode
    from shared.client import GenerationConfig

    import asyncio

    workdir = Path(tempfile.mkdtemp(prefix="hybrid-service-"))
    model_dir = workdir / "model"
    model_dir.mkdir()
    shapes = SHAPES[args.shapes] | dict(max_position_embeddings=args.long_context + args.new_tokens + 64)
    (model_dir / "config.json").write_text(json.dumps(shapes))
    children = Children(workdir)
    port = free_port()
    out: dict = {}
    try:
        children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", "--model", str(model_dir),
                                    "--random-weights", "--device", "cuda", "--dtype", "bfloat16", "--port", str(port),
                                    "--max-sessions", "2", "--grace-s", "2", *shlex.split(args.verifier_args)])
        address = f"127.0.0.1:{port}"
        asyncio.run(children.wait_serving("verifier", address, timeout=400))
        out["startup_s"] = elapsed()
        log(f"[{elapsed():.0f}s] service up")
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, shapes["vocab_size"], (args.long_context,), generator=gen).tolist()
        client_decode(address, prompt[:32], GenerationConfig(max_new_tokens=8))  # warm-up
        greedy = []
        for block in range(args.blocks):
            r = client_decode(address, prompt[block * 7 : block * 7 + 512],
                              GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.0, speculation=False))
            greedy.append(r)
            log(f"  [{elapsed():.0f}s] greedy, context 512: {r['decode_tokens_per_s']:.1f} tokens/s, TTFT {r['ttft_ms']:.0f} ms")
        out["greedy_512"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in greedy]
        r = client_decode(address, prompt[:512], GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.8,
                                                                  top_p=0.95, seed=3, speculation=False))
        out["sampled_512"] = {k: v for k, v in r.items() if k != "token_ids"}
        log(f"  [{elapsed():.0f}s] sampled, context 512: {r['decode_tokens_per_s']:.1f} tokens/s")
        r = client_decode(address, prompt, GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.0,
                                                            speculation=False))
        out["greedy_long"] = {k: v for k, v in r.items() if k != "token_ids"}
        log(f"  [{elapsed():.0f}s] greedy, context {args.long_context}: {r['decode_tokens_per_s']:.1f} tokens/s, "
            f"TTFT {r['ttft_ms']:.0f} ms")
    finally:
        children.stop()
    return out
