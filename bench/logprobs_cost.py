"""What asking for logprobs costs a request (DESIGN §2): the same requests with and without
`logprobs`, through one drafter and one verifier, measured from the client.

One drafter and one verifier (tandem's services, the embedded model by default) in child
processes; each request runs in every arm back to back, the arms' order alternating request
by request: none, raw logprobs with 5 alternatives, processed with 5. Reported per arm: output
tokens/s (sum of tokens / sum of request times) and the median over requests of the paired
ratio (arm's time per token / none's) — a ratio above 1 is the cost.

    python bench/logprobs_cost.py [--requests 16] [--new-tokens 64] [--temperature 0.8] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairbench.common import PROMPTS, free_port, log  # noqa: E402  (puts the repository on sys.path)
from pairbench.services import Children  # noqa: E402

from shared.client import AsyncVerifierClient, GenerationConfig  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

ARMS = {"none": {}, "raw, 5 alternatives": {"logprobs": 5}, "processed, 5 alternatives": {"logprobs": 5, "logprobs_mode": "processed"}}


async def main_async(args) -> None:
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(f"# variant {i}\n" + PROMPTS[i % len(PROMPTS)]).ids for i in range(args.requests)]
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    children = Children(Path(tempfile.mkdtemp(prefix="logprobs-cost-")))
    drafter_port, verifier_port = free_port(), free_port()
    common = ["--model", str(model_dir), "--device", args.device, "--dtype", dtype]
    children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", *common, "--port", str(drafter_port)])
    times = {arm: [] for arm in ARMS}  # seconds per token, per request
    tokens = {arm: 0 for arm in ARMS}
    seconds = {arm: 0.0 for arm in ARMS}
    try:
        await children.wait_serving("drafter", f"127.0.0.1:{drafter_port}", timeout=600)
        children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", *common, "--port", str(verifier_port),
                                    "--drafter", f"127.0.0.1:{drafter_port}"])
        await children.wait_serving("verifier", f"127.0.0.1:{verifier_port}", timeout=600)
        async with AsyncVerifierClient(f"127.0.0.1:{verifier_port}", timeout=600) as client:
            for extra in ARMS.values():  # warm-up
                await client.generate(prompts[0], GenerationConfig(max_new_tokens=8, **extra))
            for i, prompt in enumerate(prompts):
                order = list(ARMS) if i % 2 == 0 else list(ARMS)[::-1]
                for arm in order:
                    config = GenerationConfig(max_new_tokens=args.new_tokens, temperature=args.temperature, seed=i,
                                              **ARMS[arm])
                    started = time.perf_counter()
                    g = await client.generate(prompt, config)
                    elapsed = time.perf_counter() - started
                    times[arm].append(elapsed / max(len(g.token_ids), 1))
                    seconds[arm] += elapsed
                    tokens[arm] += len(g.token_ids)
                    if ARMS[arm] and len(g.logprobs or ()) != len(g.token_ids):
                        raise RuntimeError(f"{arm}: {len(g.logprobs or ())} logprobs for {len(g.token_ids)} tokens")
                log(f"  {i + 1}/{len(prompts)}")
    finally:
        children.stop()
    print(f"### logprobs_cost: {time.strftime('%Y-%m-%d')}, {model_dir.name}, {args.device} {dtype}, {args.requests} "
          f"requests (code prompts, T {args.temperature}, seeds 0..), {args.new_tokens} new tokens, speculation on "
          f"(default drafter and verifier), arms alternating\n")
    print("| logprobs | output tokens/s | time per token / none's, median of paired requests |")
    print("| --- | ---: | ---: |")
    for arm in ARMS:
        ratio = statistics.median(t / n for t, n in zip(times[arm], times["none"]))
        print(f"| {arm} | {tokens[arm] / seconds[arm]:.1f} | {ratio:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
