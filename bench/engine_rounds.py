"""The verifier engine's rounds, timed on the worker's side of the service (Engine.run_rounds:
the step, its copies, the verdict and the commit), one tree against another.

The embedded model (or --model) on --device, the engine as the service builds it (its
defaults: the fused path, CUDA graphs on CUDA). Arms, each a median of µs per round over
--rounds rounds after a warm-up:
- `plain`: one greedy session decoding with decode-ahead (the service's plain rounds);
- `plain sampled`: the same at temperature 0.8 (draws made on the device);
- `verify`: one greedy session verifying 4 random drafts a round (a window of 5 rows);
- `plain x8` / `verify x8`: eight sessions in one step;
- `plain mixed x8` / `verify mixed x8`: the same, every other session sampled (temperature 0.8,
  exact mode: its window's own tokens drawn; the random drafts are mostly rejected at once).
With --against-tree DIR every pair runs a worker process importing this tree and one importing
DIR, in alternating order; the table gives each tree's median and the median of the paired
ratios (this / other). Host work is what differs between trees here: with the small embedded
model on a GPU a round is mostly host time.

With --busy-share S each arm is timed a second time beside a Python thread of the same process
that runs pure Python S of every 4 ms (as the service's event loop does beside its engine
thread): what the interpreter lock costs the step (the `arm @ S` rows). --threads sets torch's
CPU threads (the service's verifier takes 1 while its requests draft; 0: torch's default).

    python bench/engine_rounds.py --device cuda [--pairs 5] [--rounds 200] [--against-tree /tmp/base]
    python bench/engine_rounds.py --device cpu --dtype float32 --threads 1 --busy-share 0.3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = ("plain", "plain sampled", "verify", "plain x8", "verify x8", "plain mixed x8", "verify mixed x8")


def spec(prompt: list[int], new_tokens: int, *, temperature: float, seed: int, request_id: str):
    from kernels.retention import RetentionPolicy
    from kernels.sampling import SamplingParams
    from kernels.speculative import Gate, Mode
    from verifier_service.requests import RequestSpec

    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0)
    return RequestSpec(
        request_id=request_id, prompt_ids=tuple(prompt), max_new_tokens=new_tokens, sampling=sampling, seed=seed,
        mode=Mode.EXACT, gate=Gate.TOP, speculate=True, coupled=False, max_draft_tokens=4,
        retention=RetentionPolicy(), retention_schedule="", retention_min_cum=0.0, eos_token_ids=frozenset(),
        stop_sequences=(),
    )


def worker(args) -> dict[str, float]:
    """µs per round of each arm, in this process's tree."""
    import torch

    from shared.model import load_model
    from shared.model.registry import resolve_model
    from verifier_service.engine import Engine
    from verifier_service.rounds import RoundRequest

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model), device=args.device, dtype=getattr(torch, args.dtype))
    vocab = model.config.vocab_size
    new_tokens = args.rounds + args.warmup + 8
    engine = Engine(model, max_context=min(model.config.max_position_embeddings, 64 + 5 * new_tokens + 8),
                    prefill_chunk=512, fused="auto", max_sessions=8, max_window=5, verify_window=5)
    gen = torch.Generator().manual_seed(1)

    def prompt() -> list[int]:
        return torch.randint(0, vocab, (64,), generator=gen).tolist()

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def timed(sessions, drafts: int, decode_ahead: bool) -> float:
        times = []
        for i in range(args.warmup + args.rounds):
            rounds = [RoundRequest(s, torch.randint(0, vocab, (drafts,), generator=gen).tolist(), None,
                                   decode_ahead) for s in sessions]
            started = time.perf_counter()
            engine.run_rounds(rounds)
            if i >= args.warmup:
                times.append(time.perf_counter() - started)
        sync()
        for s in sessions:
            engine.close(s)
        return statistics.median(times) * 1e6

    out = {}
    for share in [0.0] + ([args.busy_share] if args.busy_share else []):
        busy = BusyThread(share) if share else None
        for arm in ARMS:
            count = 8 if arm.endswith("x8") else 1
            sampled = [arm == "plain sampled" or ("mixed" in arm and i % 2 == 1) for i in range(count)]
            sessions = [engine.open(spec(prompt(), 5 * new_tokens, temperature=0.8 if sampled[i] else 0.0, seed=i,
                                         request_id=str(i)))
                        for i in range(count)]
            out[arm_name(arm, share)] = timed(sessions, 4 if arm.startswith("verify") else 0,
                                              decode_ahead=arm.startswith("plain"))
        if busy is not None:
            busy.stop()
    return out


def arm_name(arm: str, share: float) -> str:
    return f"{arm} @ {share:g}" if share else arm


class BusyThread:
    """A thread running pure Python `share` of every 4 ms period, sleeping the rest."""

    PERIOD_S = 0.004

    def __init__(self, share: float) -> None:
        import threading

        self.share, self._stop = share, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            until = time.perf_counter() + self.share * self.PERIOD_S
            while time.perf_counter() < until:
                sum(range(200))
            time.sleep((1 - self.share) * self.PERIOD_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_worker(tree: Path, args) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "protos"), os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--device", args.device, "--dtype", args.dtype,
            "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--threads", str(args.threads),
            "--busy-share", str(args.busy_share)] + (["--model", args.model] if args.model else [])
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"worker in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--against-tree", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads in the workers (0: torch's default)")
    parser.add_argument("--busy-share", type=float, default=0.0,
                        help="also time each arm beside a Python thread busy this share of the time (0: not)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 <= args.busy_share < 1:
        parser.error("--busy-share lies in [0, 1)")
    if args.worker:
        print(json.dumps(worker(args)))
        return
    trees = {"this": REPO} | ({"other": args.against_tree.resolve()} if args.against_tree else {})
    results = {name: [] for name in trees}
    for pair in range(args.pairs):
        order = list(trees) if pair % 2 == 0 else list(trees)[::-1]
        for name in order:
            results[name].append(run_worker(trees[name], args))
        print(f"pair {pair + 1}/{args.pairs}: " + "; ".join(
            f"{name} " + " / ".join(f"{value:.0f}" for value in results[name][-1].values()) for name in trees),
            file=sys.stderr, flush=True)
    print(f"\n### engine_rounds: {time.strftime('%Y-%m-%d')}, device {args.device}, {args.dtype}, "
          f"{args.rounds} rounds after {args.warmup}, {args.pairs} worker pairs, torch threads "
          f"{args.threads or 'default'}; µs per round (median of the workers' medians)\n")
    head = "| arm | this tree |" + (" other tree | this / other (median of pairs) |" if "other" in trees else "")
    print(head)
    print("| --- | ---: |" + (" ---: | ---: |" if "other" in trees else ""))
    for arm in results["this"][0]:
        row = f"| {arm} | {statistics.median(r[arm] for r in results['this']):.1f} |"
        if "other" in trees:
            ratio = statistics.median(a[arm] / b[arm] for a, b in zip(results["this"], results["other"]))
            row += f" {statistics.median(r[arm] for r in results['other']):.1f} | {ratio:.3f} |"
        print(row)


if __name__ == "__main__":
    main()
