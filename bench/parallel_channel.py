"""What one message between two ranks costs (DESIGN §13): a step's command (ours: one broadcast
of a fixed buffer; torch's broadcast_object_list: two) and a row gather, over gloo on the CPU.

Two processes on this host (rank 1 a child of this one), one torch thread each; per kind,
--calls messages after 50 of warm-up, the mean time per message on rank 0. A split verifier's
step pays one command and one or two gathers a layer (on GPUs the gathers go over NCCL instead).

Usage: python bench/parallel_channel.py [--calls 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shared.model.parallel.group import ModelGroup, free_address  # noqa: E402
from shared.model.parallel.shard import Shard  # noqa: E402

COMMAND = ("run", [(1, [5], 19), (2, [7, 8, 9, 10, 11], 30)])  # a step of two sessions' windows


def kinds(group: ModelGroup) -> dict:
    rank = group.rank
    row = torch.zeros(2048)  # one row of a 2,048-wide model, float32
    return {
        "command: one broadcast (ours)": (lambda: group.send(COMMAND)) if rank == 0 else group.receive,
        "command: broadcast_object_list": lambda: dist.broadcast_object_list([COMMAND] if rank == 0 else [None], src=0),
        "rows: gather of 8 KB a rank": lambda: group.gather(row, dim=0),
    }


def run(rank: int, address: str, calls: int, repeats: int) -> None:
    torch.set_num_threads(1)
    group = ModelGroup(Shard(rank, 2), address, torch.device("cpu"))
    results = {}
    for name, fn in kinds(group).items():
        for _ in range(50):
            fn()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - started) / calls * 1e6)
        results[name] = times
    group.close()
    if rank == 0:
        print(f"\n{calls} messages a repeat, {repeats} repeats, 2 processes\n")
        print("| message | µs (median of repeats) | repeats |\n| --- | ---: | --- |")
        for name, times in results.items():
            print(f"| {name} | {statistics.median(times):.0f} | {', '.join(f'{t:.0f}' for t in times)} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        run(args.rank, args.address, args.calls, args.repeats)
        return
    address = free_address()
    child = subprocess.Popen([sys.executable, __file__, "--rank", "1", "--address", address, "--calls", str(args.calls),
                              "--repeats", str(args.repeats)])
    run(0, address, args.calls, args.repeats)
    child.wait()


if __name__ == "__main__":
    main()
