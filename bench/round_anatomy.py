"""Where a verifier round's time goes, speculative and plain (issue 13's per-round overhead).

The drafter runs as its own process (`python -m shared.cli drafter`); the verifier runs in
this process, with timers wrapped around the steps of a round (`VerifierService._round`):

- wait: `DrafterLink.next_chain` (the chain's round trip after the commit was written; the
  drafter's own compute, `DraftChain.costs.draft_ms`, is reported beside it);
- checks: `_checked` + `retain` + the audit (the chain's validation and retention);
- submit: `RoundBatcher.submit` until the outcome is back on the loop, split into the
  engine's job on the model worker (`Engine.run_rounds`: forward, copies, the verdict) and
  the rest (the hop to the worker and back, the batcher's wake-ups);
- tell: `DrafterLink.tell` (the commit: hidden rows encoded, written);
- rest: the round's remaining host work (stats, metrics, span attributes, the event);
- between: from the end of one round to the start of the next (the event's way out to the
  client's stream, the Generate loop).

Each prompt runs speculative and plain (`speculation.disable`) back to back, alternating the
order; greedy; medians over the rounds after each request's first. The timers cost a few µs
a round themselves.

    python bench/round_anatomy.py [--device cuda] [--prompts 4] [--max-new-tokens 128] [--planner adaptive]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairbench import REPO  # noqa: E402  (puts the repository and protocol modules on sys.path)
from pairbench.common import free_port, log  # noqa: E402
from pairbench.services import Children  # noqa: E402
from pairbench.setups import text_prompts  # noqa: E402

import verifier_service.server as server_module  # noqa: E402
from shared.client import AsyncVerifierClient, GenerationConfig  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402
from verifier_service.batcher import RoundBatcher  # noqa: E402
from verifier_service.drafter_link import DrafterLink  # noqa: E402
from verifier_service.engine import Engine  # noqa: E402
from verifier_service.server import VerifierServer, VerifierService  # noqa: E402
from verifier_service.settings import VerifierSettings  # noqa: E402

STEPS = ("wait", "checks", "engine", "submit hop", "tell", "rest", "round", "between")


class Timers:
    """Per-round step times (ms) of the round in progress, and the finished rounds."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.rounds: list[dict[str, float]] = []
        self.last_end: float | None = None

    def add(self, step: str, ms: float) -> None:
        self.current[step] = self.current.get(step, 0.0) + ms


def timed_async(timers: Timers, step: str, fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            timers.add(step, (time.perf_counter() - started) * 1e3)
    return wrapper


def timed_sync(timers: Timers, step: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers.add(step, (time.perf_counter() - started) * 1e3)
    return wrapper


def instrument(timers: Timers) -> None:
    """Wrap the round's steps (class attributes: every instance made after this is timed)."""
    DrafterLink.next_chain = timed_async(timers, "wait", DrafterLink.next_chain)
    DrafterLink.tell = timed_async(timers, "tell", DrafterLink.tell)
    VerifierService._checked = timed_sync(timers, "checks", VerifierService._checked)
    VerifierService._audited = timed_sync(timers, "checks", VerifierService._audited)
    server_module.retain = timed_sync(timers, "checks", server_module.retain)
    RoundBatcher.submit = timed_async(timers, "submit", RoundBatcher.submit)
    Engine.run_rounds = timed_sync(timers, "engine", Engine.run_rounds)  # (on the worker: one round in flight here)
    round_fn = VerifierService._round

    @functools.wraps(round_fn)
    async def whole_round(self, session, link, governor, cap, completion, stats, round_id, span):
        started = time.perf_counter()
        if timers.last_end is not None and round_id > 0:
            between = (started - timers.last_end) * 1e3
        else:
            between = None
        timers.current = {}
        event, next_cap = await round_fn(self, session, link, governor, cap, completion, stats, round_id, span)
        ended = time.perf_counter()
        steps = dict(timers.current)
        steps["round"] = (ended - started) * 1e3
        steps["speculative"] = float(event.round.speculative and event.round.retained > 0)
        steps["round_id"] = round_id
        steps["tokens"] = len(event.token_ids)
        if between is not None:
            steps["between"] = between
        timers.rounds.append(steps)
        timers.last_end = ended
        return event, next_cap

    VerifierService._round = whole_round


def table(rounds: list[dict[str, float]], label: str) -> list[str]:
    rows = [r for r in rounds if r["round_id"] > 0]
    if not rows:
        return [f"| {label} | 0 |" + " |" * len(STEPS)]
    for r in rows:
        r["submit hop"] = r.get("submit", 0.0) - r.get("engine", 0.0)
        accounted = sum(r.get(s, 0.0) for s in ("wait", "checks", "submit", "tell"))
        r["rest"] = r["round"] - accounted
    cells = [f"{statistics.median(r.get(step, 0.0) for r in rows):.3f}" for step in STEPS]
    tokens = sum(r["tokens"] for r in rows) / len(rows)
    return [f"| {label} | {len(rows)} | {tokens:.2f} | " + " | ".join(cells) + " |"]


async def main_async(args) -> None:
    model_dir = resolve_model(args.model)
    prompts = text_prompts(model_dir, args.prompts)
    timers = Timers()
    instrument(timers)
    workdir = Path(tempfile.mkdtemp(prefix="anatomy-"))
    children = Children(workdir, threads=args.threads)
    d_port = free_port()
    drafter_args = ["--model", str(model_dir), "--device", args.device, "--dtype", args.dtype, "--port", str(d_port),
                    "--planner", args.planner, "--global-index-mb", "0"]
    children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", *drafter_args])
    verifier = None
    try:
        await children.wait_serving("drafter", f"127.0.0.1:{d_port}", timeout=600)
        import torch

        from shared.model import load_model

        if args.threads:
            torch.set_num_threads(args.threads)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        model = load_model(model_dir, device=args.device, dtype=dtype)
        settings = VerifierSettings(port=0, device=args.device, drafter=f"127.0.0.1:{d_port}",
                                    max_draft_tokens=args.max_draft_tokens, governor=False)
        verifier = VerifierServer(settings, model=model)
        port = await verifier.start()
        await verifier.wait_loaded()
        client = AsyncVerifierClient(f"127.0.0.1:{port}")
        runs: dict[str, list[dict[str, float]]] = {"speculative": [], "plain": []}
        for warm in (True, False):
            for index, prompt in enumerate(prompts):
                order = ("speculative", "plain") if index % 2 == 0 else ("plain", "speculative")
                for arm in order:
                    config = GenerationConfig(max_new_tokens=8 if warm else args.max_new_tokens,
                                              speculation=arm == "speculative", max_draft_tokens=args.max_draft_tokens)
                    timers.rounds, timers.last_end = [], None
                    await client.generate(prompt, config)
                    if not warm:
                        runs[arm] += timers.rounds
            log("warm-up done" if warm else "timed requests done")
        await client.close()
    finally:
        if verifier is not None:
            await verifier.stop(0)
        children.stop()
    spec_rounds = [r for r in runs["speculative"] if r["speculative"]]
    print(f"### round_anatomy: {time.strftime('%Y-%m-%d')}, device {args.device}, {args.dtype}, planner {args.planner}, "
          f"{args.prompts} prompts x {args.max_new_tokens} tokens, greedy, k = {args.max_draft_tokens}\n")
    print("Median ms per round (rounds after each request's first); submit hop = submit − engine.\n")
    print("| rounds | count | tokens/round | " + " | ".join(STEPS) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in STEPS) + " |")
    for line in table(spec_rounds, "speculative (with drafts)") + table(runs["plain"], "plain"):
        print(line)
    for arm, rows in runs.items():
        rows = [r for r in rows if r["round_id"] > 0]
        total_ms = sum(r["round"] + r.get("between", 0.0) for r in rows)
        tokens = sum(r["tokens"] for r in rows)
        print(f"\n{arm}: {tokens / total_ms * 1e3:.1f} tokens/s over the timed rounds" if total_ms else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--planner", default="adaptive", choices=("adaptive", "mtp", "suffix"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
