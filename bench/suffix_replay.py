"""Suffix drafting replayed on real text, side by side with Arctic's SuffixDecoding (issue 14).

Each request replays a file's tokens (the embedded model's tokenizer): a prompt, then the
output generated round by round. A round asks the proposer for at most `cap` tokens from
the committed tokens, accepts the longest prefix that matches the true continuation, and
commits it plus one true token (what a verifier does in greedy exact mode). Reported:
tokens committed per round (higher is better), acceptance per proposed token, the share
of rounds with a proposal, and our proposal and update times per round.

Workloads (files: Python sources of the running interpreter's standard library, a fixed
seeded choice):
- fresh: prompt = the first 25% of a file, output = the rest; every file once;
- edits: after `fresh`, the same files again with ~5% of their lines edited (the global
  index holds the originals' outputs);
- edit-of-prompt: prompt = the original file, output = its edited version.

`--history N,...` (issue 37) replays repeat-with-edits after N tokens of earlier outputs:
real code (sources of the standard library, then of the installed packages, in a seeded
order), each file one finished output; then `--scored` of those files, spread evenly over the
history (the oldest included), come back with ~5% of their lines edited, replayed as above
(prompt = the first 25%). Each history size and proposer runs in a forked child, which builds
the history once (timed: µs per history token; its resident memory before and after: the
index's RSS) and replays the scored requests at every cap without keeping them (each cap sees
the same history). Ours runs as the drafter service does (a commit counted after the chain).
That workload is bench/suffix_history.py; this file holds the proposers and the replay.

Arctic (`arctic-inference`'s SuffixDecodingCache, default speculation settings: factor 1.0,
min_token_prob 0.1; its global cache unbounded) runs where it can be imported: build its
extension as bench/README.md says and pass --arctic-path. Our global index gets --global-mb
(default: 2 GiB, the issue's bound at 10 M tokens). Usage:
  python bench/suffix_replay.py [--files 60] [--caps 4,8,16] [--arctic-path DIR]
  python bench/suffix_replay.py --history 150000,1000000,10000000 [--depths 24,64] [--arctic-path DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (its sibling, suffix_history)

from drafter_service.proposers.suffix_drafter import SuffixDrafter  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def pick_files(count: int, seed: int) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if 4_000 <= p.stat().st_size <= 40_000)
    random.Random(seed).shuffle(files)
    return files[:count]


def edit(text: str, rng: random.Random, rate: float = 0.05) -> str:
    """About `rate` of the lines changed: a word renamed, a line dropped, or a line added."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.strip() and rng.random() < rate:
            kind = rng.randrange(3)
            if kind == 0:
                words = line.split(" ")
                i = rng.randrange(len(words))
                words[i] = f"edited_{rng.randrange(100)}" + ("\n" if words[i].endswith("\n") else "")
                out.append(" ".join(words))
            elif kind == 1:
                continue
            else:
                out.append(line)
                out.append(line[: len(line) - len(line.lstrip())] + f"value_{rng.randrange(100)} = None\n")
        else:
            out.append(line)
    return "".join(out)


class Ours:
    """Our proposer; `lagged` as the drafter service runs it: a commit's tokens are counted
    after the next proposal (off the round's latency path; timed apart as `later_s`);
    keep=False: a finished output does not join the global index."""

    def __init__(self, cap: int, lagged: bool = False, global_bytes: int = 2 << 30, drafter=None,
                 keep: bool = True) -> None:
        self.drafter = drafter if drafter is not None else SuffixDrafter(global_bytes)
        self.keep = keep
        self.cap = cap
        self.lagged = lagged
        self.name = "tandem, counted after the chain" if lagged else "tandem"
        self.propose_s: list[float] = []
        self.update_s: list[float] = []
        self.later_s: list[float] = []

    def start(self, rid, prompt):
        self.drafter.start(rid, prompt)

    def propose(self, rid, committed):
        t = time.perf_counter()
        draft = self.drafter.propose(rid, self.cap)
        self.propose_s.append(time.perf_counter() - t)
        if self.lagged:
            t = time.perf_counter()
            self.drafter.count_pending(rid)
            self.later_s.append(time.perf_counter() - t)
        return draft

    def commit(self, rid, tokens):
        t = time.perf_counter()
        self.drafter.extend(rid, tokens, count=not self.lagged)
        self.update_s.append(time.perf_counter() - t)

    def finish(self, rid):
        self.drafter.finish(rid, self.keep)


class Arctic:
    def __init__(self, cap: int, depth: int, cache=None, keep: bool = True) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = cache if cache is not None else SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=-1)
        self.keep = keep
        self.cap = cap
        self.name = f"Arctic depth {depth}"
        self.propose_s: list[float] = []
        self.update_s: list[float] = []

    def start(self, rid, prompt):
        self.cache.start_request(rid, prompt)

    def propose(self, rid, committed):
        t = time.perf_counter()
        draft = self.cache.speculate(rid, committed[-self.cache.max_tree_depth :], max_spec_tokens=self.cap).token_ids
        self.propose_s.append(time.perf_counter() - t)
        return list(draft)

    def commit(self, rid, tokens):
        t = time.perf_counter()
        self.cache.add_active_response(rid, tokens)
        self.update_s.append(time.perf_counter() - t)

    def finish(self, rid):
        self.cache.stop_request(rid)
        if not self.keep:
            self.cache.evict_cached_response(rid)


def replay(proposer, rid, prompt: list[int], output: list[int]) -> dict:
    """Rounds until the output is committed; returns counts for this request."""
    proposer.start(rid, prompt)
    committed = list(prompt)
    done = rounds = proposed = accepted = with_proposal = 0
    while done < len(output):
        draft = proposer.propose(rid, committed)
        truth = output[done : done + len(draft) + 1]
        n = 0
        while n < len(draft) and n < len(truth) - 1 and draft[n] == truth[n]:
            n += 1
        step = output[done : done + n + 1]
        proposer.commit(rid, step)
        committed += step
        done += len(step)
        rounds += 1
        proposed += len(draft)
        accepted += n
        with_proposal += bool(draft)
    proposer.finish(rid)
    return dict(rounds=rounds, tokens=len(output), proposed=proposed, accepted=accepted, with_proposal=with_proposal)


def workloads(tokenizer, files: list[Path], seed: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    rng = random.Random(seed)
    fresh, edits, edit_of_prompt = [], [], []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = tokenizer.encode(text).ids
        cut = len(ids) // 4
        fresh.append((ids[:cut], ids[cut:]))
        edited = tokenizer.encode(edit(text, rng)).ids
        cut = len(edited) // 4
        edits.append((edited[:cut], edited[cut:]))
        edit_of_prompt.append((ids + tokenizer.encode("\n# the same file, edited:\n").ids, edited))
    # "edits" replays after "fresh" on the same proposer (its global index has the originals)
    return {"fresh": fresh, "fresh, then the same files with ~5% of lines edited": fresh + edits,
            "edit-of-prompt": edit_of_prompt}


# -- --history: repeat-with-edits after N tokens of earlier outputs (issue 37) ----------------


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def allocated_bytes() -> int:
    """Bytes the C allocator has handed out and not had back (glibc's mallinfo2: uordblks +
    hblkhd): both indexes' native memory, counted whether or not its pages are resident or
    reused from the forking parent's freed heap (which RSS growth misses)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=60)
    parser.add_argument("--caps", default="4,8,16")
    parser.add_argument("--depths", default="24,64", help="Arctic tree depths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arctic-path", default=None, help="a directory holding the arctic_inference package")
    parser.add_argument("--global-mb", type=int, default=2048, help="our global index's bound, MiB")
    parser.add_argument("--history", default=None, help="history sizes in tokens (e.g. 150000,1000000,10000000): "
                        "repeat-with-edits after that many tokens of earlier outputs, instead of --files' workloads")
    parser.add_argument("--scored", type=int, default=60, help="--history: files of the history replayed, edited")
    parser.add_argument("--before", default=None, help="--history: also the Python global index of this checkout "
                        "(the tree before issue 37), at its default bound and unbounded (a tree with the native "
                        "index: bench/suffix_paired.py)")
    parser.add_argument("--before-unbounded", type=int, default=1_000_000,
                        help="--before: the unbounded Python index only up to this history (its memory grows with it)")
    args = parser.parse_args()
    if args.arctic_path:
        sys.path.insert(0, args.arctic_path)
    try:
        import arctic_inference.suffix_decoding  # noqa: F401

        arctic = True
    except ImportError as error:
        log(f"Arctic not available ({error}): our proposer only")
        arctic = False
    tokenizer = load_tokenizer(resolve_model())
    caps = [int(c) for c in args.caps.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    if args.history:
        from suffix_history import history_main  # (bench/suffix_history.py: the --history workload)

        return history_main(args, tokenizer, caps, depths, arctic)
    files = pick_files(args.files, args.seed)
    loads = workloads(tokenizer, files, args.seed)
    print(f"\n{len(files)} files, {sum(len(p) + len(o) for p, o in loads['fresh'])} tokens; "
          "tokens committed per round (acceptance per proposed token, share of rounds proposing)\n")
    print("| workload | cap | tandem | tandem, counted after the chain | " + "".join(f"Arctic depth {d} | " for d in depths if arctic)
          + "tandem / best Arctic | µs per round, tandem: propose, update (counted after: on path + after) "
          "| µs per round, Arctic (deepest): propose, update |")
    print("| --- | ---: | ---: | ---: | " + "---: | " * (len(depths) if arctic else 0) + "---: | --- | --- |")
    for load_name, requests in loads.items():
        scored = requests[len(loads["fresh"]):] if load_name.startswith("fresh, then") else requests
        for cap in caps:
            bound = args.global_mb << 20
            proposers = [Ours(cap, global_bytes=bound), Ours(cap, lagged=True, global_bytes=bound)] + (
                [Arctic(cap, d) for d in depths] if arctic else [])
            cells, rates = [], []
            for proposer in proposers:
                t0 = time.perf_counter()
                results = [replay(proposer, f"{load_name}-{i}", p, o) for i, (p, o) in enumerate(requests)]
                results = results[len(results) - len(scored):]  # warm-up requests are not scored
                rounds = sum(r["rounds"] for r in results)
                rate = sum(r["tokens"] for r in results) / rounds
                acceptance = sum(r["accepted"] for r in results) / max(1, sum(r["proposed"] for r in results))
                coverage = sum(r["with_proposal"] for r in results) / rounds
                rates.append(rate)
                cells.append(f"{rate:.2f} ({acceptance:.2f}, {coverage:.2f})")
                log(f"  {load_name} cap {cap} {proposer.name}: {rate:.2f} tokens/round in {time.perf_counter() - t0:.1f}s")
            ours, lagged = proposers[0], proposers[1]
            ratio = f"{rates[0] / max(rates[2:]):.3f}" if len(rates) > 2 else "–"

            def us(values):
                return statistics.mean(values) * 1e6

            timing = (f"{us(ours.propose_s):.1f}, {us(ours.update_s):.1f} "
                      f"({us(lagged.update_s):.1f} + {us(lagged.later_s):.1f})")
            theirs = f"{us(proposers[-1].propose_s):.1f}, {us(proposers[-1].update_s):.1f}" if arctic else "–"
            print(f"| {load_name} | {cap} | " + " | ".join(cells) + f" | {ratio} | {timing} | {theirs} |", flush=True)


if __name__ == "__main__":
    main()
