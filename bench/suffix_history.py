"""suffix_replay.py's `--history` workload (issue 37): repeat-with-edits after N tokens of
earlier outputs, each history size and proposer in a forked child (the build timed, its memory
measured), the scored requests replayed at every cap. Run through suffix_replay.py:

    python bench/suffix_replay.py --history 150000,1000000,10000000 [--depths 24,64] [--arctic-path DIR]
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from suffix_replay import Arctic, Ours, allocated_bytes, edit, log, replay, resident_bytes  # noqa: E402

from drafter_service.proposers.suffix_drafter import SuffixDrafter  # noqa: E402


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
