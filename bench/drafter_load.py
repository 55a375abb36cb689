"""One drafter serving many concurrent requests: load shedding on and off (issue 13).

Two drafter + verifier pairs on the same model and device (child processes): one drafter
with load shedding (the default), one with `--no-load-shedding`; the verifiers run without
the governor (every round asks the drafter) unless `--governor`. Each block sends the
built-in code prompts from `--concurrency` clients at once to one pair, then to the other,
and the same prompts without speculation to the first verifier (plain); the pair order
alternates between blocks. Reported per arm: aggregate output tokens/s (tokens / the
arm's wall time), the median over blocks and the median of the paired ratios to plain;
rounds with drafts, rounds that missed the deadline (faults `deadline`) or got a chain too
late (`stale_chain`), and the drafter's shed chains (its /metrics).

    python bench/drafter_load.py [--device cuda] [--concurrency 16] [--blocks 3] [--max-new-tokens 96] [--planner mtp]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.request import urlopen

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairbench.common import free_port, log  # noqa: E402  (puts the repository and protocol modules on sys.path)
from pairbench.services import Children  # noqa: E402
from pairbench.setups import text_prompts  # noqa: E402

from shared.client import AsyncVerifierClient, GenerationConfig  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402

ARMS = ("shedding", "no shedding")


async def burst(client: AsyncVerifierClient, prompts: list[list[int]], concurrency: int, config: GenerationConfig):
    """concurrency clients at once, each running prompts in turn from its own offset: (wall s, generations)."""
    async def one_client(offset: int):
        return [await client.generate(prompts[(offset + i) % len(prompts)], config) for i in range(len(prompts) // 2 or 1)]
    started = time.perf_counter()
    results = await asyncio.gather(*(one_client(c) for c in range(concurrency)))
    return time.perf_counter() - started, [g for per_client in results for g in per_client]


def counters(*ports: int) -> dict[str, float]:
    """The counters this bench reads from the services' /metrics: shed chains, faults by kind."""
    found = {"shed": 0.0, "deadline": 0.0, "stale_chain": 0.0}
    for port in ports:
        text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for name, pattern in (("shed", r"^tandem_drafter_shed_chains_total (\S+)$"),
                              ("deadline", r'^tandem_verifier_drafter_faults_total\{kind="deadline"\} (\S+)$'),
                              ("stale_chain", r'^tandem_verifier_drafter_faults_total\{kind="stale_chain"\} (\S+)$')):
            match = re.search(pattern, text, re.M)
            found[name] += float(match.group(1)) if match else 0.0
    return found


async def main_async(args) -> None:
    model_dir = resolve_model(args.model)
    prompts = text_prompts(model_dir, args.prompts)
    children = Children(Path(tempfile.mkdtemp(prefix="drafter-load-")), threads=args.threads)
    common = ["--model", str(model_dir), "--device", args.device, "--dtype", args.dtype]
    pairs = {}
    for arm in ARMS:
        d_port, v_port, m_port, vm_port = free_port(), free_port(), free_port(), free_port()
        drafter_args = [*common, "--port", str(d_port), "--planner", args.planner, "--global-index-mb", "0",
                        "--metrics-port", str(m_port), "--max-sessions", str(4 * args.concurrency)]
        if arm == "no shedding" and not args.same:
            drafter_args.append("--no-load-shedding")
        verifier_args = [*common, "--port", str(v_port), "--drafter", f"127.0.0.1:{d_port}",
                         "--max-sessions", str(args.concurrency), "--max-draft-tokens", str(args.max_draft_tokens),
                         "--metrics-port", str(vm_port),
                         *([] if args.governor else ["--no-governor"])]
        children.start(f"drafter ({arm})", [sys.executable, "-m", "shared.cli", "drafter", *drafter_args])
        children.start(f"verifier ({arm})", [sys.executable, "-m", "shared.cli", "verifier", *verifier_args])
        pairs[arm] = (d_port, v_port, m_port, vm_port)
    records: dict[str, list[dict]] = {arm: [] for arm in (*ARMS, "plain")}
    try:
        for arm, (d_port, v_port, _, _) in pairs.items():
            await children.wait_serving(f"drafter ({arm})", f"127.0.0.1:{d_port}", timeout=900)
            await children.wait_serving(f"verifier ({arm})", f"127.0.0.1:{v_port}", timeout=900)
        clients = {arm: AsyncVerifierClient(f"127.0.0.1:{v_port}") for arm, (_, v_port, _, _) in pairs.items()}
        spec = GenerationConfig(max_new_tokens=args.max_new_tokens, max_draft_tokens=args.max_draft_tokens)
        plain = GenerationConfig(max_new_tokens=args.max_new_tokens, speculation=False)
        for arm in ARMS:  # warm-up
            await burst(clients[arm], prompts, min(args.concurrency, 2), GenerationConfig(max_new_tokens=8))
        for block in range(args.blocks):
            order = ARMS if block % 2 == 0 else ARMS[::-1]
            for arm in (*order, "plain"):
                pair = pairs[ARMS[0] if arm == "plain" else arm]
                before = counters(pair[2], pair[3])
                wall, generations = await burst(clients[ARMS[0] if arm == "plain" else arm], prompts, args.concurrency,
                                                plain if arm == "plain" else spec)
                after = counters(pair[2], pair[3])
                records[arm].append({
                    "tokens_per_s": sum(len(g.token_ids) for g in generations) / wall,
                    "rounds": sum(g.stats["rounds"] for g in generations),
                    "drafted": sum(1 for g in generations for r in g.rounds if r["retained"] > 0),
                    **{name: after[name] - before[name] for name in after},
                })
            log(f"block {block + 1}/{args.blocks}: " + ", ".join(
                f"{arm} {records[arm][-1]['tokens_per_s']:.1f} tokens/s" for arm in records))
        for client in clients.values():
            await client.close()
    finally:
        children.stop()
    print(f"### drafter_load: {time.strftime('%Y-%m-%d')}, device {args.device}, {args.dtype}, planner {args.planner}, "
          f"concurrency {args.concurrency}, {args.blocks} blocks, {args.max_new_tokens} tokens, k = {args.max_draft_tokens}, "
          f"governor {'on' if args.governor else 'off'}{', A/A: both drafters shed' if args.same else ''}\n")
    print("| arm | output tokens/s (median of blocks) | / plain (median of paired ratios) | rounds with drafts | "
          "deadline misses / round | stale chains / round | shed chains / round |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for arm, rows in records.items():
        ratios = [r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(rows, records["plain"])]
        rounds = sum(r["rounds"] for r in rows) or 1
        print(f"| {arm} | {statistics.median(r['tokens_per_s'] for r in rows):.1f} | {statistics.median(ratios):.3f} | "
              f"{sum(r['drafted'] for r in rows) / rounds:.2f} | {sum(r['deadline'] for r in rows) / rounds:.3f} | "
              f"{sum(r['stale_chain'] for r in rows) / rounds:.3f} | {sum(r['shed'] for r in rows) / rounds:.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--planner", default="mtp", choices=("adaptive", "mtp", "suffix"))
    parser.add_argument("--governor", action="store_true", help="leave the verifiers' governor on")
    parser.add_argument("--same", action="store_true", help="both drafters shed (an A/A run: the spread between pairs)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per service (0: torch's default)")
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
