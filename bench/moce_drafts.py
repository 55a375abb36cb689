"""Does draft-row MoCE pay (issue 18)? Drafter expert-slot misses against MTP acceptance.

The embedded model (16 experts per MoE layer, top-2) through the real pair, in-process: a
verifier with every expert resident and a drafter whose model keeps only `slots` experts per
layer on the device (an LRU expert store), drafting with MTP only. For each slot budget
(25% and 50% of the experts) and each MoCE base scale b (1 = plain routing: the LRU store
alone; b > 1 multiplies a resident expert's router probability by m = b·b on draft rows, so
a slightly less likely expert already in a slot can win a rank), the built-in code
prompts are decoded greedily in exact mode (so every configuration emits the same tokens:
checked) and the bench reports the drafter's expert-slot misses per draft token and the MTP
acceptance (accepted / proposed drafts).

Usage: python bench/moce_drafts.py [--max-new-tokens 64] [--scales 1,1.25,1.5,2,3] [--slots 4,8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench.common import PROMPTS, log  # noqa: E402  (puts the repo and protocol modules on sys.path)

import torch  # noqa: E402

from drafter_service.server import DrafterServer  # noqa: E402
from drafter_service.settings import DrafterSettings  # noqa: E402
from shared.client import AsyncVerifierClient, GenerationConfig  # noqa: E402
from shared.model import load_model  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402
from verifier_service.server import VerifierServer  # noqa: E402
from verifier_service.settings import VerifierSettings  # noqa: E402


async def run_config(target, model_dir: Path, slots: int, scale: float, prompts, max_new_tokens: int) -> dict:
    drafter_model = load_model(model_dir, num_expert_slots=slots, progress=False)
    drafter = DrafterServer(DrafterSettings(port=0, planner="mtp", expert_slots=slots, moce_scale=scale),
                            model=drafter_model)
    d_port = await drafter.start()
    await drafter.wait_loaded()
    verifier = VerifierServer(VerifierSettings(port=0, drafter=f"127.0.0.1:{d_port}", drafter_deadline_ms=5000.0,
                                               governor=False),
                              model=target)
    v_port = await verifier.start()
    await verifier.wait_loaded()
    outputs, proposed, accepted = [], 0, 0
    try:
        async with AsyncVerifierClient(f"127.0.0.1:{v_port}") as client:
            for prompt in prompts:
                config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, max_draft_tokens=4)
                result = await client.generate(prompt, config)
                outputs.append(result.token_ids)
                proposed += result.stats["proposed"]
                accepted += result.stats["accepted"]
        registry = drafter.metrics_registry
        misses = registry.get_sample_value("tandem_drafter_expert_slot_misses_total") or 0.0
        drafts = registry.get_sample_value("tandem_drafter_draft_tokens_total", {"source": "MTP"}) or 0.0
    finally:
        await verifier.stop(0)
        await drafter.stop(0)
    return {"slots": slots, "scale": scale, "outputs": outputs, "misses": misses, "drafts": drafts,
            "proposed": proposed, "accepted": accepted}


async def main_async(args) -> None:
    torch.set_num_threads(1)
    model_dir = resolve_model(None)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    target = load_model(model_dir, progress=False)
    experts = target.config.num_experts
    results = []
    for slots in args.slots:
        for scale in args.scales:
            log(f"  slots {slots}/{experts}, b = {scale} ...")
            results.append(await run_config(target, model_dir, slots, scale, prompts, args.max_new_tokens))
    reference = results[0]["outputs"]
    same = all(r["outputs"] == reference for r in results)
    print(f"\n| slots per layer (of {experts}) | MoCE b | drafter misses per draft token | MTP acceptance (accepted / proposed) "
          f"| misses vs b = 1 | acceptance vs b = 1 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for slots in args.slots:
        rows = [r for r in results if r["slots"] == slots]
        base = next((r for r in rows if r["scale"] == 1.0), rows[0])
        base_misses = base["misses"] / max(base["drafts"], 1)
        base_acceptance = base["accepted"] / max(base["proposed"], 1)
        for r in rows:
            misses = r["misses"] / max(r["drafts"], 1)
            acceptance = r["accepted"] / max(r["proposed"], 1)
            print(f"| {slots} | {r['scale']:g} | {misses:.3f} | {acceptance:.3f} ({r['accepted']}/{r['proposed']}) | "
                  f"{misses / base_misses - 1:+.1%} | {acceptance / base_acceptance - 1:+.1%} |")
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} greedy tokens per configuration; "
          f"exact-mode outputs identical across configurations: {same}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--scales", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 1.25, 1.5, 2.0, 3.0])
    parser.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
