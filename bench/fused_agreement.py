"""Greedy outputs of the verifier service (fused path, CUDA graphs) against the reference
modules on the same model and device (issue 10's correctness check).

The embedded model by default (--dtype float32 or bfloat16): each built-in prompt is decoded
greedily by an in-process reference engine (`fused="off"`), then through a `tandem verifier`
child process (fused path) from the client; the table counts identical completions and the
first position where they part.

Usage: python bench/fused_agreement.py [--dtype float32] [--max-new-tokens 96] [--prompts 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench.common import PROMPTS, free_port, log  # noqa: E402  (puts the repo and protocol modules on sys.path)
from pairbench.services import Children  # noqa: E402

from shared.client import GenerationConfig, VerifierClient  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: a plumbing check (the service then runs the reference path too)")
    args = parser.parse_args()
    from bench.pairbench.common import request_spec
    from shared.model import load_model
    from shared.model.registry import resolve_model
    from shared.tokenizer import load_tokenizer
    from verifier_service.engine import Engine

    model_dir = resolve_model(None)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[: args.prompts]]
    model = load_model(model_dir, device=args.device, dtype=getattr(torch, args.dtype))
    engine = Engine(model, max_context=model.config.max_position_embeddings, prefill_chunk=2048, fused="off")
    reference = []
    for prompt in prompts:
        session = engine.open(request_spec(prompt, args.max_new_tokens, max_draft_tokens=0))
        while len(session.token_ids) - len(prompt) < args.max_new_tokens:
            engine.run_round(session, [], None)
        reference.append(session.token_ids[len(prompt) : len(prompt) + args.max_new_tokens])
    children = Children(Path(tempfile.mkdtemp(prefix="agreement-")))
    port = free_port()
    address = f"127.0.0.1:{port}"
    children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", "--device", args.device, "--dtype", args.dtype,
                                "--port", str(port), "--grace-s", "1"])
    try:
        asyncio.run(children.wait_serving("verifier", address, timeout=300))
        served = []
        with VerifierClient(address, timeout=300) as client:
            for prompt in prompts:
                result = client.generate(prompt, GenerationConfig(max_new_tokens=args.max_new_tokens, speculation=False))
                served.append(list(result.token_ids)[: args.max_new_tokens])
    finally:
        children.stop()
    # The service stops at the model's EOS; the reference loop does not: compare the served length.
    print(f"\n| prompt | {args.dtype}: service (fused) = reference | tokens compared | first differing position |")
    print("| ---: | :---: | ---: | ---: |")
    same = 0
    for i, (ref, got) in enumerate(zip(reference, served)):
        first = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        same += first is None
        print(f"| {i} | {'yes' if first is None else 'no'} | {len(got)} | {'-' if first is None else first} |")
    log(f"identical: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
