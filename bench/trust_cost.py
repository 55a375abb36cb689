"""What the safe default costs (DESIGN §10): probabilistic requests whose drafter is not
trusted are verified by the coupled exact rule; trusted, by the probabilistic rule.

One drafter (tandem's, on the embedded model by default: MTP and suffix drafts) and two
verifiers on the same model, one started with `--probabilistic-drafters any` (the drafter
trusted) and one with the default (`none`). The same probabilistic requests (the built-in code
prompts, temperature `--temperature`, seeds 0..) go to each, alternating request by request;
reported per arm: drafts proposed and accepted, acceptance, mean accepted length, tokens per
round and output tokens/s (sum of tokens / sum of request times).

    python bench/trust_cost.py [--requests 24] [--new-tokens 64] [--temperature 0.8] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

ARMS = {"trusted (probabilistic rule)": ["--probabilistic-drafters", "any"],
        "not trusted (coupled exact rule, the default)": []}


async def main_async(args) -> None:
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(f"# variant {i}\n" + PROMPTS[i % len(PROMPTS)]).ids for i in range(args.requests)]
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    children = Children(Path(tempfile.mkdtemp(prefix="trust-cost-")))
    drafter_port = free_port()
    common = ["--model", str(model_dir), "--device", args.device, "--dtype", dtype]
    children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", *common, "--port", str(drafter_port),
                               "--global-index-mb", "0"])
    addresses = {}
    try:
        await children.wait_serving("drafter", f"127.0.0.1:{drafter_port}", timeout=600)
        for index, (arm, flags) in enumerate(ARMS.items()):
            port = free_port()
            children.start(f"verifier-{index}", [sys.executable, "-m", "shared.cli", "verifier", *common, "--port",
                                                 str(port), "--drafter", f"127.0.0.1:{drafter_port}", "--no-governor",
                                                 *flags])
            await children.wait_serving(f"verifier-{index}", f"127.0.0.1:{port}", timeout=600)
            addresses[arm] = f"127.0.0.1:{port}"
        totals = {arm: dict(proposed=0, accepted=0, rounds=0, tokens=0, seconds=0.0) for arm in ARMS}
        clients = {arm: AsyncVerifierClient(address, timeout=600) for arm, address in addresses.items()}
        for client in clients.values():
            await client.__aenter__()
        try:
            for arm, client in clients.items():  # warm-up
                await client.generate(prompts[0], GenerationConfig(max_new_tokens=8, mode="probabilistic",
                                                                   temperature=args.temperature))
            for i, prompt in enumerate(prompts):
                order = list(ARMS) if i % 2 == 0 else list(ARMS)[::-1]
                for arm in order:
                    config = GenerationConfig(max_new_tokens=args.new_tokens, temperature=args.temperature, seed=i,
                                              mode="probabilistic", max_draft_tokens=args.max_draft_tokens)
                    started = time.perf_counter()
                    g = await clients[arm].generate(prompt, config)
                    t = totals[arm]
                    t["seconds"] += time.perf_counter() - started
                    t["tokens"] += len(g.token_ids)
                    t["rounds"] += len(g.rounds)
                    t["proposed"] += sum(r["proposed"] for r in g.rounds)
                    t["accepted"] += sum(r["accepted"] for r in g.rounds)
                log(f"  {i + 1}/{len(prompts)}")
        finally:
            for client in clients.values():
                await client.__aexit__(None, None, None)
    finally:
        children.stop()
    print(f"### trust_cost: {time.strftime('%Y-%m-%d')}, {model_dir.name}, {args.device} {dtype}, {args.requests} "
          f"probabilistic requests (code prompts, T {args.temperature}, seeds 0..), {args.new_tokens} new tokens, "
          f"k <= {args.max_draft_tokens}, governor off, arms alternating\n")
    print("| drafter | drafts proposed | accepted | acceptance | tokens per round | output tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for arm, t in totals.items():
        print(f"| {arm} | {t['proposed']} | {t['accepted']} | {t['accepted'] / max(t['proposed'], 1):.3f} "
              f"| {t['tokens'] / max(t['rounds'], 1):.2f} | {t['tokens'] / max(t['seconds'], 1e-9):.1f} |")
    if args.out:
        args.out.write_text(json.dumps(totals, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
