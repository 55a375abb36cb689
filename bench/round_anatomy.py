"""Where a verifier round's time goes, speculative and plain (issues 13 and 35).

The drafter runs as its own process — tandem's (`python -m shared.cli drafter`, the embedded
model) or, with --alpha, the synthetic replay drafter (bench/replay_drafter.py) proposing the
verifier's own continuation, each draft corrupted with probability 1 − alpha. The verifier
runs in this process, with timers wrapped around the steps of a round
(`RequestRounds.begin_round` to `end_round`, per request: a context variable):

- wait: `DrafterLink.next_chain` (the chain's round trip after the commit was written; the
  drafter's own compute, `DraftChain.costs.draft_ms`, is reported beside it);
- checks: `_checked` + `retain` + the audit (the chain's validation and retention);
- outcome: `Lane.outcome` (from the round handed to the engine loop, or granted to it, until
  its outcome is read: ~0 when the loop ran the round before the coroutine asked for it);
- tell: `DrafterLink.tell` (the commit: hidden rows encoded, written);
- rest: the round's remaining host work (stats, metrics, span attributes, the event);
- between: from the end of one round to the start of the next (the next round's first half
  starts before the event goes out to the client, so this is the Generate loop's own hop).

The engine loop's thread is timed apart: its steps (`Engine.run_rounds`: launch, the
device's work it waits for, the verdict, the commit), steps per second, rounds per step, and
the share of the wall time it spent in them ("busy": near 1, the device sets the pace).

Each prompt runs speculative and plain (`speculation` off) back to back, alternating the
order, `--concurrency` requests at a time; greedy (or sampled: --temperature); medians over the rounds after each
request's first. The timers cost a few µs a round themselves.

    python bench/round_anatomy.py [--device cuda] [--prompts 4] [--max-new-tokens 128] [--link local]
        [--random-shapes qwen3-30b-a3b --alpha 0.8] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairbench import REPO  # noqa: E402  (puts the repository and protocol modules on sys.path)
from pairbench.common import SHAPES, free_port, log  # noqa: E402
from pairbench.services import Children, link_flags  # noqa: E402
from pairbench.setups import text_prompts  # noqa: E402

import verifier_service.request_rounds as rounds_module  # noqa: E402
from shared.client import AsyncVerifierClient, GenerationConfig  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402
from verifier_service.drafter_link import DrafterLink  # noqa: E402
from verifier_service.engine import Engine  # noqa: E402
from verifier_service.lane import Lane  # noqa: E402
from verifier_service.request_rounds import RequestRounds  # noqa: E402
from verifier_service.server import VerifierServer  # noqa: E402
from verifier_service.settings import VerifierSettings  # noqa: E402

STEPS = ("wait", "checks", "outcome", "tell", "rest", "round", "between")
CURRENT: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("round_timers", default=None)


class Timers:
    """Finished rounds' step times (ms), and the engine loop's steps."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, float]] = []
        self.steps: list[tuple[float, float, int]] = []  # (start, ms, rounds) of each run_rounds
        self.last_end: dict[str, float] = {}  # a request's last round's end (by request id)
        self.open: dict[int, tuple[dict[str, float], float]] = {}  # rounds begun: their steps and start


def add(step: str, ms: float) -> None:
    current = CURRENT.get()
    if current is not None:
        current[step] = current.get(step, 0.0) + ms


def timed_async(step: str, fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            add(step, (time.perf_counter() - started) * 1e3)
    return wrapper


def timed_sync(step: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add(step, (time.perf_counter() - started) * 1e3)
    return wrapper


def instrument(timers: Timers) -> None:
    """Wrap the round's steps (class attributes: every instance made after this is timed)."""
    DrafterLink.next_chain = timed_async("wait", DrafterLink.next_chain)
    DrafterLink.tell = timed_async("tell", DrafterLink.tell)
    RequestRounds._checked = timed_sync("checks", RequestRounds._checked)
    RequestRounds._audited = timed_sync("checks", RequestRounds._audited)
    rounds_module.retain = timed_sync("checks", rounds_module.retain)
    Lane.outcome = timed_async("outcome", Lane.outcome)
    run_rounds = Engine.run_rounds

    @functools.wraps(run_rounds)
    def step(self, rounds):  # (on the engine loop's thread)
        started = time.perf_counter()
        try:
            return run_rounds(self, rounds)
        finally:
            timers.steps.append((started, (time.perf_counter() - started) * 1e3, len(rounds)))

    Engine.run_rounds = step
    begin_fn, end_fn = RequestRounds.begin_round, RequestRounds.end_round

    @functools.wraps(begin_fn)
    async def begin(self, running, parent):  # (in its own task: the timers are its context's)
        steps: dict[str, float] = {}
        timers.open[id(running)] = (steps, time.perf_counter())
        CURRENT.set(steps)
        return await begin_fn(self, running, parent)

    @functools.wraps(end_fn)
    async def end(self, running, begun):
        steps, started = timers.open.pop(id(running))
        request_id = running.session.spec.request_id
        last = timers.last_end.get(request_id)
        token = CURRENT.set(steps)
        try:
            event = await end_fn(self, running, begun)
        finally:
            CURRENT.reset(token)
        ended = time.perf_counter()
        steps["round"] = (ended - started) * 1e3
        steps["speculative"] = float(event.round.speculative and event.round.retained > 0)
        steps["asked"] = float(event.round.speculative)  # (the drafter was asked: with drafts or not)
        steps["round_id"] = running.round_id
        steps["tokens"] = len(event.token_ids)
        if last is not None:
            steps["between"] = (started - last) * 1e3
        timers.rounds.append(steps)
        timers.last_end[request_id] = ended
        return event

    RequestRounds.begin_round, RequestRounds.end_round = begin, end


def table(rounds: list[dict[str, float]], label: str) -> list[str]:
    rows = [r for r in rounds if r["round_id"] > 0]
    if not rows:
        return [f"| {label} | 0 |" + " |" * (len(STEPS) + 3)]
    for r in rows:
        accounted = sum(r.get(s, 0.0) for s in ("wait", "checks", "outcome", "tell"))
        r["rest"] = r["round"] - accounted
    cells = [f"{statistics.median(r.get(step, 0.0) for r in rows):.3f}" for step in STEPS]
    tokens = sum(r["tokens"] for r in rows) / len(rows)
    means = f"{statistics.fmean(r.get('wait', 0.0) for r in rows):.3f} | {statistics.fmean(r['round'] for r in rows):.3f}"
    return [f"| {label} | {len(rows)} | {tokens:.2f} | " + " | ".join(cells) + f" | {means} |"]


def random_model(workdir: Path, shapes: str, prompt_length: int, new_tokens: int) -> Path:
    model_dir = workdir / f"{shapes}-shapes"
    model_dir.mkdir()
    config = SHAPES[shapes] | {"max_position_embeddings": max(4096, prompt_length + new_tokens + 64)}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


async def main_async(args) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="anatomy-"))
    if args.random_shapes:
        model_dir = random_model(workdir, args.random_shapes, args.prompt_length, args.max_new_tokens)
        vocab = SHAPES[args.random_shapes]["vocab_size"]
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_length)] for _ in range(args.prompts)]
    else:
        model_dir = resolve_model(args.model)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = text_prompts(model_dir, args.prompts)
    timers = Timers()
    instrument(timers)
    children = Children(workdir, threads=args.threads)
    d_port = free_port()
    verifier = None
    try:
        import torch

        from shared.model import load_model

        if args.threads:
            torch.set_num_threads(args.threads)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        log("loading the verifier's model ...")
        model = load_model(model_dir, device=args.device, dtype=dtype, random_weights=bool(args.random_shapes),
                           parts="trunk")
        link = str(workdir / "d.sock") if args.link == "local" else None  # (shared.local_stream)
        drafter_link = link_flags(args.link, workdir / "d.sock")[1]
        settings = VerifierSettings(port=0, device=args.device, drafter=f"127.0.0.1:{d_port}", drafter_socket=link,
                                    max_draft_tokens=args.max_draft_tokens, governor=False,
                                    max_sessions=max(8, *args.levels),
                                    max_context=args.prompt_length + args.max_new_tokens + 64 if args.random_shapes else 0)
        verifier = VerifierServer(settings, model=model)
        port = await verifier.start()
        await verifier.wait_loaded()
        client = AsyncVerifierClient(f"127.0.0.1:{port}", timeout=1800)

        def config(arm: str, tokens: int | None) -> GenerationConfig:
            return GenerationConfig(max_new_tokens=tokens or args.max_new_tokens, speculation=arm == "speculative",
                                    max_draft_tokens=args.max_draft_tokens, temperature=args.temperature,
                                    top_p=0.95 if args.temperature > 0 else 1.0, seed=7)

        if args.alpha is not None:  # the replay drafter proposes the verifier's own continuations
            log("recording the references ...")
            outs = [await client.generate(p, config("plain", args.max_new_tokens)) for p in prompts]
            reference = workdir / "reference.json"
            reference.write_text(json.dumps({"vocab_size": vocab, "references": [
                {"prompt_ids": p, "token_ids": list(o.token_ids)} for p, o in zip(prompts, outs)]}))
            children.start("drafter", [sys.executable, str(REPO / "bench" / "replay_drafter.py"), "--port", str(d_port),
                                       "--reference", str(reference), "--alpha", str(args.alpha),
                                       "--max-drafts", str(args.max_draft_tokens), *drafter_link])
        else:
            children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", "--model", str(model_dir),
                                       "--device", args.device, "--dtype", args.dtype, "--port", str(d_port),
                                       "--planner", args.planner, "--global-index-mb", "0", *drafter_link])
        await children.wait_serving("drafter", f"127.0.0.1:{d_port}", timeout=600)
        results: dict[int, dict] = {}
        for level in args.levels:
            results[level] = await measure(client, prompts, level, config, timers)
        await client.close()
    finally:
        if verifier is not None:
            await verifier.stop(0)
        children.stop()
    drafter = f"replay drafter, alpha {args.alpha:g}" if args.alpha is not None else f"tandem's drafter ({args.planner})"
    model_name = f"random {args.dtype} weights at {args.random_shapes} shapes" if args.random_shapes else model_dir.name
    for level, (runs, walls, busy, step_log) in results.items():
        print(f"### round_anatomy: {time.strftime('%Y-%m-%d')}, device {args.device}, {model_name}, {drafter}, "
              f"{args.prompts} prompts x {args.max_new_tokens} tokens, {level} at a time, greedy, "
              f"k = {args.max_draft_tokens}\n")
        print("Median ms per round (rounds after each request's first).\n")
        print("| rounds | count | tokens/round | " + " | ".join(STEPS) + " | wait (mean) | round (mean) |")
        print("| --- | ---: | ---: | " + " | ".join("---:" for _ in STEPS) + " | ---: | ---: |")
        spec_rounds = [r for r in runs["speculative"] if r["speculative"]]
        empty = [r for r in runs["speculative"] if r["asked"] and not r["speculative"]]
        for line in (table(spec_rounds, "speculative (with drafts)") + table(empty, "asked the drafter, no drafts")
                     + table(runs["plain"], "plain")):
            print(line)
        print("\n| arm | tokens/s (wall, all requests) | ms per token | engine steps | rounds per step | "
              "ms per step (median) | loop thread busy |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for arm in ("speculative", "plain"):
            seconds = sum(s for s, _ in walls[arm])
            tokens = sum(t for _, t in walls[arm])
            steps = step_log[arm]
            if not tokens or not steps:
                continue
            print(f"| {arm} | {tokens / seconds:.1f} | {seconds / tokens * 1e3:.3f} | {len(steps)} | "
                  f"{statistics.fmean(n for _, _, n in steps):.2f} | {statistics.median(ms for _, ms, _ in steps):.3f} | "
                  f"{statistics.median(busy[arm]):.2f} |")
        print()


async def measure(client, prompts, level: int, config, timers: Timers):
    """Each group of `level` prompts speculative and plain, alternating the order; a warm-up pass first."""
    runs: dict[str, list[dict[str, float]]] = {"speculative": [], "plain": []}
    walls: dict[str, list[tuple[float, int]]] = {"speculative": [], "plain": []}  # (seconds, tokens) per group
    busy: dict[str, list[float]] = {"speculative": [], "plain": []}  # the loop thread's share, per group
    step_log: dict[str, list[tuple[float, float, int]]] = {"speculative": [], "plain": []}
    groups = [prompts[i:i + level] for i in range(0, len(prompts), level)]
    for warm in (True, False):
        for index, group in enumerate(groups):
            for arm in (("speculative", "plain") if index % 2 == 0 else ("plain", "speculative")):
                timers.rounds, timers.steps = [], []
                started = time.perf_counter()
                outs = await asyncio.gather(*(client.generate(p, config(arm, 8 if warm else None)) for p in group))
                seconds = time.perf_counter() - started
                if not warm:
                    runs[arm] += timers.rounds
                    walls[arm].append((seconds, sum(len(o.token_ids) for o in outs)))
                    busy[arm].append(sum(ms for _, ms, _ in timers.steps) / 1e3 / seconds)
                    step_log[arm] += timers.steps
        log(f"{level} at a time: " + ("warm-up done" if warm else "timed requests done"))
    return runs, walls, busy, step_log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--random-shapes", choices=sorted(SHAPES), default=None,
                        help="random weights at these shapes (random prompts of --prompt-length ids)")
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--alpha", type=float, default=None, help="the synthetic replay drafter at this acceptance")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--concurrency", default="1", help="requests at a time (each arm), comma separated levels")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled (top-p 0.95, seed 7)")
    parser.add_argument("--planner", default="adaptive", choices=("adaptive", "mtp", "suffix"))
    parser.add_argument("--link", default="grpc", choices=("grpc", "local"),
                        help="the drafter's Draft streams: gRPC, or its Unix socket (--drafter-socket)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    args = parser.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    if args.random_shapes and args.alpha is None:
        parser.error("--random-shapes needs --alpha (tandem's drafter needs a checkpoint)")
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
