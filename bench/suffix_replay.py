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

Arctic (`arctic-inference`'s SuffixDecodingCache, default speculation settings: factor 1.0,
min_token_prob 0.1; its global cache unbounded) runs where it can be imported: build its
extension as bench/README.md says and pass --arctic-path. Our global index gets --global-mb
(default: 2 GiB, the issue's bound at 10 M tokens). Usage:
  python bench/suffix_replay.py [--files 60] [--caps 4,8,16] [--arctic-path DIR]
  python bench/suffix_replay.py --history 150000,1000000,10000000 [--depths 24,64] [--arctic-path DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from drafter_service.proposers.suffix_drafter import SuffixDrafter
from shared.model.registry import resolve_model
from shared.tokenizer import load_tokenizer


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


def history_corpus(tokenizer, total: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[Path]]:
    """About `total` tokens of real code, a file per output: (token ids as uint32, concatenated;
    offsets, one more than files; the files' paths)."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    paths = []
    for root in roots:  # (the standard library first; the installed packages when it runs out)
        found = sorted(p for p in root.rglob("*.py") if 4_000 <= p.stat().st_size <= 40_000
                       and (root == roots[1] or "site-packages" not in p.parts))
        random.Random(seed).shuffle(found)
        paths += found
    ids, kept, count = [], [], 0
    for start in range(0, len(paths), 256):
        batch = paths[start : start + 256]
        for path, encoding in zip(batch, tokenizer.encode_batch([p.read_text(encoding="utf-8", errors="replace")
                                                                for p in batch])):
            ids.append(np.asarray(encoding.ids, dtype=np.uint32))
            kept.append(path)
            count += len(encoding.ids) - 1  # (the first token is the output's prompt)
            if count >= total:
                return np.concatenate(ids), np.cumsum([0] + [len(a) for a in ids]), kept
    raise SystemExit(f"only {count} tokens of code here, fewer than {total}")


def scored_requests(tokenizer, paths: list[Path], count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`count` of the history's files, evenly spread over it, edited: (prompt, output) each."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        text = paths[int(i * len(paths) / count)].read_text(encoding="utf-8", errors="replace")
        edited = tokenizer.encode(edit(text, rng)).ids
        cut = len(edited) // 4
        requests.append((edited[:cut], edited[cut:]))
    return requests


class Before(Ours):
    """The Python global index before issue 37 (suffix.py of another checkout: `--before DIR`),
    bounded to `contexts` (its default then: 1,000,000) or not (None)."""

    def __init__(self, cap: int, drafter) -> None:
        super().__init__(cap, lagged=True, drafter=drafter, keep=False)

    @staticmethod
    def drafter(directory: str, contexts: int | None):
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "suffix_before", Path(directory) / "drafter_service" / "proposers" / "suffix.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.SuffixDrafter(max_global_contexts=contexts)

    def finish(self, rid):
        self.drafter._requests.pop(rid)  # (not kept: each cap sees the same history)


def history_run(kind: str, depth: int, ids: np.ndarray, offsets: np.ndarray, files: int, scored, caps: list[int],
                global_bytes: int, before_dir: str | None = None) -> dict:
    """One proposer over one history (in a forked child): build, memory, then every cap."""
    before, allocated = resident_bytes(), allocated_bytes()
    started = time.perf_counter()
    if kind in ("tandem", "before"):
        drafter = SuffixDrafter(global_bytes) if kind == "tandem" else Before.drafter(before_dir, depth or None)
        for f in range(files):
            drafter.global_index.add(ids[offsets[f] + 1 : offsets[f + 1]].tolist())
        index = drafter.global_index
        stated = dict(stated=index.nbytes, held=index.requests, evictions=index.evictions,
                      contexts=len(index)) if kind == "tandem" else dict(contexts=len(index))
    else:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=-1)
        for f in range(files):
            cache.start_request(("history", f), ids[offsets[f] : offsets[f] + 1].view(np.int32))
            cache.add_active_response(("history", f), ids[offsets[f] + 1 : offsets[f + 1]].view(np.int32))
            cache.stop_request(("history", f))
        stated = {}
    build_s = time.perf_counter() - started
    result = dict(stated, rss=resident_bytes() - before, allocated=allocated_bytes() - allocated, build_us=build_s / int(offsets[files] - files) * 1e6, caps={})
    for cap in caps:
        proposer = Ours(cap, lagged=True, drafter=drafter, keep=False) if kind == "tandem" else \
            Before(cap, drafter) if kind == "before" else Arctic(cap, depth, cache=cache, keep=False)
        results = [replay(proposer, ("scored", cap, i), p, o) for i, (p, o) in enumerate(scored)]
        rounds = sum(r["rounds"] for r in results)
        tokens = sum(r["tokens"] for r in results)
        propose = sorted(proposer.propose_s)
        result["caps"][cap] = dict(
            rate=tokens / rounds, acceptance=sum(r["accepted"] for r in results) / max(1, sum(r["proposed"] for r in results)),
            propose_p50=propose[len(propose) // 2] * 1e6, propose_mean=statistics.mean(propose) * 1e6,
            update_token=sum(proposer.update_s) / tokens * 1e6,
            later_token=sum(getattr(proposer, "later_s", [])) / tokens * 1e6)
    return result


def in_child(fn, *args) -> dict | None:
    """fn(*args) in a forked process (its memory measured alone, and freed after); None if it died."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def run():
        send.send(fn(*args))

    child = context.Process(target=run)
    child.start()
    send.close()  # (the child's end only: a child that dies closes it, and recv raises)
    try:
        result = receive.recv()
    except EOFError:
        result = None
    child.join()
    return result if child.exitcode == 0 else None


def history_main(args, tokenizer, caps: list[int], depths: list[int], arctic: bool) -> None:
    sizes = [int(n) for n in args.history.split(",")]
    t0 = time.perf_counter()
    ids, offsets, paths = history_corpus(tokenizer, max(sizes), args.seed)
    log(f"corpus: {len(paths)} files, {len(ids)} tokens, tokenized in {time.perf_counter() - t0:.0f}s")
    arms = [("tandem", 0)] + ([("Arctic", d) for d in depths] if arctic else [])
    rows, memory, before_rows = [], [], []
    for size in sizes:
        extra = [("before", 1_000_000)] + ([("before", 0)] if size <= args.before_unbounded else []) if args.before else []
        files = int(np.searchsorted(offsets - np.arange(len(offsets)), size)) or 1  # output tokens: files' less one each
        scored = scored_requests(tokenizer, paths[:files], args.scored, args.seed)
        history = int(offsets[files] - files)
        results = {}
        for kind, depth in arms + extra:
            t0 = time.perf_counter()
            results[kind, depth] = in_child(history_run, kind, depth, ids, offsets, files, scored, caps,
                                            args.global_mb << 20, args.before)
            log(f"  history {history}: {kind} {depth or ''} in {time.perf_counter() - t0:.0f}s: {results[kind, depth]}")
        ours = results["tandem", 0]
        for kind, depth in arms + extra:
            r = results[kind, depth]
            name = arm_name(kind, depth)
            if r is None:
                memory.append(f"| {history:,} | {name} | failed (out of memory?) | | | |")
                continue
            stated = (f"{r['stated'] / 2**20:,.0f} MiB stated, {r['held']} of {files} outputs held, {r['evictions']} "
                      f"evicted, {r['contexts']:,} contexts" if kind == "tandem" else
                      f"{r['contexts']:,} contexts" if kind == "before" else "–")
            memory.append(f"| {history:,} | {name} | {r['allocated'] / 2**20:,.0f} MiB | {r['rss'] / 2**20:,.0f} MiB | "
                          f"{stated} | {r['build_us']:.2f} |")
        for cap in caps:
            cells = []
            for kind, depth in arms:
                r = results[kind, depth]
                cells.append("–" if r is None else f"{r['caps'][cap]['rate']:.2f} ({r['caps'][cap]['acceptance']:.2f})")
            for kind, depth in extra:
                r = results[kind, depth]
                c = None if r is None else r["caps"][cap]
                before_rows.append(f"| {history:,} | {cap} | {arm_name(kind, depth)} | " + (
                    "failed |  |" if c is None else f"{c['rate']:.2f} ({c['acceptance']:.2f}) | {c['propose_p50']:.1f} "
                    f"({c['propose_mean']:.1f}); {c['update_token']:.2f} + {c['later_token']:.2f} |"))
            theirs = [results[a]["caps"][cap]["rate"] for a in arms[1:] if results[a] is not None]
            ratio = f"{ours['caps'][cap]['rate'] / max(theirs):.3f}" if theirs and ours else "–"
            c = ours["caps"][cap] if ours else None
            deepest = results[arms[-1]] if len(arms) > 1 and results[arms[-1]] is not None else None
            rows.append(f"| {history:,} | {cap} | " + " | ".join(cells) + f" | {ratio} | " + (
                f"{c['propose_p50']:.1f} ({c['propose_mean']:.1f}); {c['update_token']:.2f} + {c['later_token']:.2f}" if c else "–")
                + " | " + (f"{deepest['caps'][cap]['propose_p50']:.1f} ({deepest['caps'][cap]['propose_mean']:.1f}); "
                           f"{deepest['caps'][cap]['update_token']:.2f}" if deepest else "–") + " |")
    names = " | ".join(arm_name(kind, depth) for kind, depth in arms)
    print(f"\nrepeat-with-edits after earlier outputs: {args.scored} files of the history, edited, replayed; "
          "tokens committed per round (acceptance per proposed token)\n")
    print(f"| history tokens | cap | {names} | tandem / best Arctic | tandem µs: propose p50 (mean) a round; update a "
          "token on the round's path + counted after | Arctic (deepest) µs: propose p50 (mean); update a token |")
    print("| ---: | ---: | " + "---: | " * len(arms) + "---: | --- | --- |")
    print("\n".join(rows))
    print("\n| history tokens | index | native memory allocated (malloc) | RSS growth | tandem's own count | "
          "build µs a history token |")
    print("| ---: | --- | ---: | ---: | --- | ---: |")
    print("\n".join(memory), flush=True)
    if before_rows:
        print("\n| history tokens | cap | the Python index before issue 37 | tokens per round | µs: propose p50 (mean); "
              "update a token on the round's path + counted after |")
        print("| ---: | ---: | --- | ---: | --- |")
        print("\n".join(before_rows), flush=True)


def arm_name(kind: str, depth: int) -> str:
    if kind == "before":
        return f"before, bounded to {depth:,} contexts" if depth else "before, unbounded"
    return "tandem" if kind == "tandem" else f"Arctic depth {depth}"


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
