"""Our suffix proposer against another checkout's, paired round by round (issue 37's proposal time).

suffix_replay.py's `--history` workload (N tokens of real code as earlier outputs, then
`--scored` of those files, edited, replayed round by round), with two drafters over the same
history in one forked child: ours (this checkout) and `--before DIR`'s (a tree holding another
version of `drafter_service`, its extension built there: `git archive REV drafter_service
setup.py | tar -x -C DIR && (cd DIR && python setup.py build_ext --inplace)`). Each round both
propose on the same committed tokens, in alternating order (on a machine shared with other
work, both see the same contention), then each counts the previous commit (as the drafter
service does: after the chain) and both commit the same tokens. Proposals must be the same:
a round where they differ is counted (and ours is played).

Reported per size and cap: tokens per round, rounds whose proposals differ, the proposal's
p50 and mean µs for both and their ratios (after / before: of the p50s, and the median of the
per-round ratios), update µs a token for both, and our index's memory (as suffix_replay.py
reports it, but half of what both indexes grew together: the same counts, the same bytes). Usage (this checkout on the path: the venv's editable install may point elsewhere):
  PYTHONPATH=. python bench/suffix_paired.py --before DIR --history 150000,1000000,10000000 [--caps 4,8,16]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (its siblings: suffix_replay, suffix_history)

from suffix_history import history_corpus, in_child, scored_requests  # noqa: E402
from suffix_replay import Ours, allocated_bytes, log, resident_bytes  # noqa: E402

from drafter_service.proposers.suffix_drafter import SuffixDrafter  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402


def foreign_drafter_class(directory: str):
    """SuffixDrafter of the drafter_service under `directory`, imported beside ours (its modules
    leave sys.modules again; the objects keep their own)."""
    def ours(name: str) -> bool:
        return name == "drafter_service" or name.startswith("drafter_service.")

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, directory)
    try:
        module = importlib.import_module("drafter_service.proposers.suffix_drafter")
        if not Path(module.__file__).resolve().is_relative_to(Path(directory).resolve()):
            raise RuntimeError(f"{module.__file__} is not under {directory}")
        cls = module.SuffixDrafter
    finally:
        sys.path.remove(directory)
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
    return cls


def replay_paired(after: Ours, before: Ours, rid, prompt: list[int], output: list[int], first: int) -> dict:
    """Both proposers in lockstep (after's drafts played); returns this request's counts."""
    pair = (after, before)
    for proposer in pair:
        proposer.start(rid, prompt)
    committed = list(prompt)
    done = rounds = differ = 0
    while done < len(output):
        drafts = {}
        for proposer in (pair if (rounds + first) % 2 == 0 else pair[::-1]):
            drafts[proposer] = proposer.propose(rid, committed)
        draft = drafts[after]
        differ += draft != drafts[before]
        truth = output[done : done + len(draft) + 1]
        n = 0
        while n < len(draft) and n < len(truth) - 1 and draft[n] == truth[n]:
            n += 1
        step = output[done : done + n + 1]
        for proposer in pair:
            proposer.commit(rid, step)
        committed += step
        done += len(step)
        rounds += 1
    for proposer in pair:
        proposer.finish(rid)
    return dict(rounds=rounds, tokens=len(output), differ=differ)


def paired_run(before_dir: str, ids: np.ndarray, offsets: np.ndarray, files: int, scored, caps: list[int],
               global_bytes: int) -> dict:
    """One history, both drafters (in a forked child): our build measured, then every cap paired."""
    drafters = [SuffixDrafter(global_bytes), foreign_drafter_class(before_dir)(global_bytes)]
    # Built output by output, in turn (which one first alternates), so that both tables grow
    # together: built one after the other, the first one built proposed ~5% faster with the
    # same code on both sides (its memory laid out differently: huge pages, placement).
    rss, allocated, build_s = resident_bytes(), allocated_bytes(), 0.0
    for f in range(files):
        tokens = ids[offsets[f] + 1 : offsets[f + 1]].tolist()
        for d in (drafters if f % 2 == 0 else drafters[::-1]):
            started = time.perf_counter()
            d.global_index.add(tokens)
            if d is drafters[0]:
                build_s += time.perf_counter() - started
    index = drafters[0].global_index
    assert drafters[1].global_index.nbytes == index.nbytes  # (the same counts: only the walk changed)
    result = dict(stated=index.nbytes, held=index.requests, evictions=index.evictions, contexts=len(index),
                  rss=(resident_bytes() - rss) // 2, allocated=(allocated_bytes() - allocated) // 2,
                  build_us=build_s / int(offsets[files] - files) * 1e6, caps={})
    for cap in caps:
        after, before = (Ours(cap, lagged=True, drafter=d, keep=False) for d in drafters)
        runs = [replay_paired(after, before, ("scored", cap, i), p, o, i) for i, (p, o) in enumerate(scored)]
        tokens = sum(r["tokens"] for r in runs)
        a, b = np.array(after.propose_s) * 1e6, np.array(before.propose_s) * 1e6
        result["caps"][cap] = dict(
            rate=tokens / sum(r["rounds"] for r in runs), differ=sum(r["differ"] for r in runs), rounds=len(a),
            p50=(np.median(a), np.median(b)), mean=(a.mean(), b.mean()), ratio=float(np.median(a / b)),
            update=tuple((sum(p.update_s) / tokens * 1e6, sum(p.later_s) / tokens * 1e6) for p in (after, before)))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="a directory holding the other drafter_service (built)")
    parser.add_argument("--history", default="150000,1000000,10000000", help="history sizes in tokens")
    parser.add_argument("--caps", default="4,8,16")
    parser.add_argument("--scored", type=int, default=60, help="files of the history replayed, edited")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-mb", type=int, default=2048, help="both global indexes' bound, MiB")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model())
    sizes, caps = [int(n) for n in args.history.split(",")], [int(c) for c in args.caps.split(",")]
    ids, offsets, paths = history_corpus(tokenizer, max(sizes), args.seed)
    rows, memory = [], []
    for size in sizes:
        files = int(np.searchsorted(offsets - np.arange(len(offsets)), size)) or 1
        scored = scored_requests(tokenizer, paths[:files], args.scored, args.seed)
        history = int(offsets[files] - files)
        t0 = time.perf_counter()
        r = in_child(paired_run, args.before, ids, offsets, files, scored, caps, args.global_mb << 20)
        log(f"  history {history}: paired in {time.perf_counter() - t0:.0f}s: {r}")
        if r is None:
            rows.append(f"| {history:,} | – | failed (out of memory?) | | | | | | |")
            continue
        memory.append(f"| {history:,} | {r['allocated'] / 2**20:,.0f} MiB | {r['rss'] / 2**20:,.0f} MiB | "
                      f"{r['stated'] / 2**20:,.0f} MiB stated, {r['held']} of {files} outputs held, {r['evictions']} "
                      f"evicted, {r['contexts']:,} contexts | {r['build_us']:.2f} |")
        for cap, c in r["caps"].items():
            (pa, pb), (ma, mb), ((ua, la), (ub, lb)) = c["p50"], c["mean"], c["update"]
            rows.append(f"| {history:,} | {cap} | {c['rate']:.2f} | {c['differ']} of {c['rounds']:,} | {pb:.1f} ({mb:.1f}) | "
                        f"{pa:.1f} ({ma:.1f}) | {pa / pb:.2f} | {c['ratio']:.2f} | {ub:.2f} + {lb:.2f} | {ua:.2f} + {la:.2f} |")
    print("\nrepeat-with-edits after earlier outputs, both drafters in lockstep on the same rounds\n")
    print("| history tokens | cap | tokens per round | rounds whose proposals differ | before µs: propose p50 (mean) | "
          "after µs: propose p50 (mean) | p50 after / before | median of per-round ratios | before µs: update a "
          "token on the path + counted after | after: the same |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    print("\n".join(rows))
    print("\n| history tokens | native memory allocated (ours) | RSS growth | our own count | build µs a history token |")
    print("| ---: | ---: | ---: | --- | ---: |")
    print("\n".join(memory), flush=True)


if __name__ == "__main__":
    main()
