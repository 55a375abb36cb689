"""Speedup of speculation through the two services (verifier + drafter over loopback gRPC, or
the drafter's Unix socket: --link local).

Method (DESIGN §7): interleaved paired blocks. Each block runs the same prompts and seeds
once per arm — with speculation (the verifier configured with a drafter) and without (the
same verifier process, requests with speculation.disable = True) — with the arm order
reversed on alternate blocks; within a block the arms run back to back per prompt (block
1: spec, plain for prompt 0, then prompt 1, ...; block 2: plain, spec), so a drift in
machine load lands on both arms of a pair. Per block: ratio = tokens/s(spec) /
tokens/s(plain), tokens/s = the block's completion tokens / its requests' wall time
(client side, send → final event; prefill included). One warm-up request per arm first. Quoted: the MEDIAN OF PAIRED RATIOS (not the ratio of medians); the same from the
verifier's own tokens_per_s as a cross-check.

Also reported (all from the timed runs unless said otherwise):
- mean accepted length = completion tokens / rounds (bonus/correction token included),
  acceptance by source (accepted / retained drafts, from RoundInfo), rounds per request;
- per-round time: wall, verify (RoundInfo.verify_ms), draft wait (RoundInfo.draft_wait_ms);
- drafter compute per round and bytes per round each way:
  * real drafter (embedded setups): a byte-counting tap (a pass-through gRPC proxy in this
    process) sits between a SECOND verifier process and the same drafter; after the timed
    blocks every prompt runs once through it (untimed). Bytes = serialized DraftUp /
    DraftDown payloads (no gRPC/HTTP2 framing). The captured up-stream messages are then
    replayed into an in-process `drafter_service.server.Drafter` on the same model and
    device, timing commit + propose per round (open + propose for round 0);
  * replay drafter (synthetic setups): measured inside bench/replay_drafter.py during the
    timed runs (protobuf ByteSize, compute = message received → chain built);
- hop + service overhead per round = median draft_wait_ms (rounds >= 1) − median drafter
  compute per round (medians: robust to bursts of load on a shared machine);
- the ideal speedup (DESIGN §7 cost model, verify cost only: no draft cost, no hop, no
  per-round host overhead): C1 = mean verify_ms of the plain arm's 1-row rounds, C(w) =
  mean verify_ms of the spec arm's w-row windows; ideal = (spec tokens / spec verify ms) /
  (plain tokens / plain verify ms), i.e. R / (C_mix / C1); fraction realised = measured
  median ratio / ideal; the same from each request's first tokens on ("from the first token":
  tokens after the first event / the wall after it, both arms — the prompt's prefill, the same
  work in both and left out of the ideal, weighs on short requests' ratio). Per k,
  R_k = 1 + sum_i prod_{j<=i} a_j from the measured per-step acceptance a_j, and R_k / (C(k+1) / C1) where C(k+1) was measured.

Setups:
  cpu-embedded (default)  tandem drafter + tandem verifier --drafter, embedded model, CPU
  gpu-embedded            the same with --device cuda
  cpu-synthetic           embedded model on CPU, bench/replay_drafter.py (SYNTHETIC drafts)
  gpu-synthetic           random bf16 weights at Qwen3-30B-A3B shapes on CUDA, replay drafter
                          (--random-shapes smoke: a tiny random model, for a quick check)
CPU setups start each service with OMP_NUM_THREADS=1 (--threads): on a small CPU two
services with two OpenMP threads each stall on barriers whenever another process holds a
core, which turns a 10 ms verify window into 300-600 ms at random.

Synthetic setups: one verifier (--drafter = the replay drafter's port) first records each
prompt's output without speculation (the reference), then one replay drafter serves every
alpha: the request id carries "@alpha=A", which the replay drafter reads. Each block runs
the plain arm once and one spec arm per alpha (all paired with that block's plain arm).

The drafter's cross-session suffix index is OFF by default (--global-index-mb 0):
every block repeats the same prompts, and the index would replay earlier blocks' outputs
as drafts. --global-index keeps the drafter's default.

Usage: python bench/pair_speedup.py [--setup cpu-embedded] [--blocks 5] [--max-new-tokens 96] [--out raw.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `pairbench` lies beside this script (python -m, runpy, importlib)
    sys.path.insert(0, str(HERE))

from pairbench.common import SETUPS, SHAPES, ServiceError, log  # noqa: E402
from pairbench.report import analyse, report  # noqa: E402
from pairbench.services import Children  # noqa: E402
from pairbench.setups import run_embedded, run_synthetic  # noqa: E402


def parse_alphas(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid alpha list {text!r}") from None
    if not values or any(not 0.0 <= a <= 1.0 for a in values):
        raise argparse.ArgumentTypeError(f"alphas must lie in [0, 1]: {text!r}")
    return values



async def main_async(args) -> int:
    synthetic = args.setup.endswith("synthetic")
    with tempfile.TemporaryDirectory(prefix="pair_speedup_") as tmp:
        workdir = Path(tmp)
        children = Children(workdir, args.threads)
        started = time.perf_counter()
        load_before = os.getloadavg()[0]
        try:
            runner = run_synthetic if synthetic else run_embedded
            records, header, arms, plain, more = await runner(args, children, workdir)
        except (ServiceError, FileNotFoundError) as error:
            log(f"error: {error}")
            return 1
        finally:
            children.stop()
        header = {
            **header, "blocks": args.blocks, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
            "max_draft_tokens": args.max_draft_tokens, "temperature": args.temperature, "mode": args.mode,
            "seed": args.seed, "threads per service": args.threads or "torch default", "wall": f"{time.perf_counter() - started:.0f}s", "cpus": os.cpu_count(),
            "1-min load average before/after": f"{load_before:.1f}/{os.getloadavg()[0]:.1f}",
        }
    payload = {"label": "synthetic" if synthetic else "real drafter", "setup": args.setup, "header": header,
               "args": dict(vars(args)), "costs": more["costs"], "records": records, **more["extra"]}
    if args.out:  # raw records first: they survive a failure of the analysis
        Path(args.out).write_text(json.dumps(payload, indent=1, default=str))
    summaries = []
    for arm in arms:
        if arm is plain:
            continue
        summary = analyse(records, arm, plain, args.blocks, args.max_draft_tokens)
        summary["name"] = arm.name
        summaries.append(summary)
    print(report(args.setup, header, summaries, more["costs"], plain, synthetic))
    if args.out:
        payload["summaries"] = summaries
        Path(args.out).write_text(json.dumps(payload, indent=1, default=str))
        log(f"raw records written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--setup", choices=SETUPS, default="cpu-embedded")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4, help="built-in Python-code prompts (random ids for gpu-synthetic)")
    parser.add_argument("--prompt-set", choices=("code", "repeat"), default="code",
                        help="code: short code openings; repeat: a piece of real code, then the start of it again with a "
                             "name changed (repeat-with-edits)")
    parser.add_argument("--prompt-length", type=int, default=128, help="random-weight models: random prompt length")
    parser.add_argument("--random-shapes", choices=sorted(SHAPES), default=None,
                        help="synthetic setups: random weights at these shapes (gpu-synthetic default: qwen3-30b-a3b; "
                             "cpu-synthetic default: the embedded model)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--mode", choices=("exact", "probabilistic"), default="exact")
    parser.add_argument("--seed", type=int, default=0, help="request seeds are seed + prompt index")
    parser.add_argument("--alpha", type=parse_alphas, default=[0.6, 0.8, 0.9], help="synthetic setups: acceptance per draft")
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model; gpu-synthetic: random 30B shapes)")
    parser.add_argument("--dtype", default=None, help="default float32 (embedded) / bfloat16 (gpu-synthetic)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per service (OMP_NUM_THREADS); default 1 on CPU setups "
                             "(two services on a small shared CPU: OpenMP barriers stall under oversubscription), "
                             "torch's default on GPU setups; 0 = torch's default")
    parser.add_argument("--link", default="grpc", choices=("grpc", "local"),
                        help="the verifier's Draft streams: over gRPC, or the drafter's Unix socket (--drafter-socket, as "
                             "`tandem demo` starts the pair); the tap pass stays on gRPC")
    parser.add_argument("--global-index", action="store_true", help="keep the drafter's cross-session suffix index")
    parser.add_argument("--no-tap", action="store_true", help="embedded setups: skip the tap pass (no bytes/compute)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a service gets to become SERVING")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="deadline of one request, seconds")
    parser.add_argument("--verifier-arg", action="append", default=[],
                        help="extra flag for the verifier(s), e.g. --verifier-arg=--no-governor (repeatable)")
    parser.add_argument("--drafter-arg", action="append", default=[],
                        help="embedded setups: extra flag for the drafter, e.g. --drafter-arg=--device --drafter-arg=cuda:1 "
                             "(a GPU of its own; the last --device wins) (repeatable)")
    parser.add_argument("--drafter-delay-ms", type=float, default=0.0,
                        help="synthetic setups: the replay drafter sends each chain this late (a slow drafter)")
    parser.add_argument("--ahead-ab", action="store_true",
                        help="synthetic setups: also each alpha without chains drafted ahead (interleaved arms)")
    parser.add_argument("--out", default=None, help="write the raw per-request records (JSON) here")
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = 1 if args.setup.startswith("cpu") else 0
    args.dtype_given = args.dtype is not None
    args.dtype = args.dtype or "float32"
    if args.mode == "probabilistic" and not any("probabilistic-drafters" in a for a in args.verifier_arg):
        # the bench's drafters are ours: measure the probabilistic rule, not the untrusted default's exact one
        args.verifier_arg.append("--probabilistic-drafters=any")
    if args.blocks < 1 or args.prompts < 1 or args.max_new_tokens < 1 or args.max_draft_tokens < 1:
        parser.error("--blocks, --prompts, --max-new-tokens and --max-draft-tokens must be >= 1")
    try:
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
