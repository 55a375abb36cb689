"""Rank 0's runner and its followers' loop (DESIGN §13): every rank runs every step.

Rank 0 owns the requests; its engine sees a `LeaderRunner`, which hands each runner call to the
followers (`ModelGroup.send`) before it runs the call itself. A follower (`follow`) runs the same
calls on its own runner in the same order, so the collectives inside each forward meet, and
slots, KV blocks and linear-attention buffers are handed out alike on every rank (the same calls
on the same allocators). Only rank 0 reads a step's outputs; the followers' are dropped.

What a follower cannot see is rank 0's length bookkeeping (the CacheLength its engine cuts back):
the fused runner keeps none of its own, so nothing is lost.
"""

from __future__ import annotations

import threading

import structlog
import torch
from torch import Tensor

from shared.model.kv_cache import CacheLength
from shared.model.parallel.group import STOP, ModelGroup
from shared.model.runner import Window, WindowOutput

log = structlog.get_logger("parallel")

CALLS = ("acquire", "release", "prefill", "run", "run_next", "feed_next", "settle")


class LeaderRunner:
    """The runner interface (shared.model.runner) over every rank: calls go to the followers,
    then run here. Attributes it does not define are the local runner's."""

    def __init__(self, runner, group: ModelGroup) -> None:
        if group.rank != 0:
            raise ValueError(f"rank {group.rank} follows; only rank 0 leads")
        self.runner = runner
        self.group = group
        self.closed = False
        # One call at a time, whatever thread makes it (a session's slot may be given back off
        # the engine's thread): the followers must see the calls in the order they run here, and
        # on the CPU commands and rows share one group.
        self.lock = threading.Lock()

    def __getattr__(self, name: str):  # max_rows, path, pool, use_graphs, ...
        return getattr(self.runner, name)

    def _call(self, name: str, *args):
        with self.lock:
            if self.closed:
                raise RuntimeError("the parallel runner is closed")
            self.group.send((name, args))
            return getattr(self.runner, name)(*args)

    def acquire(self, max_length: int) -> tuple[int, CacheLength]:
        """A slot here first (no collective in it), then the followers', which must be the same:
        the command carries it, and a follower that hands out another stops (ranks out of step)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("the parallel runner is closed")
            slot, length = self.runner.acquire(max_length)
            self.group.send(("acquire", (max_length,), slot))
            return slot, length

    def release(self, slot: int) -> None:
        self._call("release", slot)

    def prefill(self, chunks: list[Window]) -> Tensor:
        return self._call("prefill", [Window(*c) for c in chunks])

    def run(self, windows: list[Window]) -> WindowOutput:
        return self._call("run", [Window(*w) for w in windows])

    def run_next(self) -> WindowOutput:
        return self._call("run_next")

    def feed_next(self, token_ids: Tensor) -> None:
        """The tokens (on the device: a sampled round's draws) go to the followers device to
        device, after the command that announces their shape: reading them on the host here
        would wait for the step that made them."""
        with self.lock:
            if self.closed:
                raise RuntimeError("the parallel runner is closed")
            token_ids = token_ids.contiguous()
            self.group.send(("feed_next", (tuple(token_ids.shape), str(token_ids.dtype).removeprefix("torch."))))
            self.group.share(token_ids)
            self.runner.feed_next(token_ids)

    def settle(self, slot: int, kept_row: int | None = None) -> None:
        self._call("settle", slot, kept_row)

    def close(self) -> None:
        """Tell the followers to stop (they leave their loop and the group)."""
        with self.lock:
            if not self.closed:
                self.closed = True
                self.group.send((STOP, ()))


def follow(runner, group: ModelGroup) -> int:
    """A follower's loop: run rank 0's calls until it says stop; returns the calls run. A call
    that fails here fails alike on rank 0 (the same call on the same state), so it is logged and
    the loop goes on — except an acquire, which rank 0 sends only once it succeeded there: a
    follower that cannot match it is out of step, and stops (rank 0 then exits: §13)."""
    device = getattr(runner, "device", torch.device("cpu"))
    count = 0
    while True:
        name, args, *expected = group.receive()
        if name == STOP:
            return count
        if name not in CALLS:
            raise ValueError(f"rank {group.rank}: unknown call {name!r} from rank 0")
        if name == "feed_next":  # (shape, dtype): the tokens themselves come by a broadcast
            token_ids = torch.empty(args[0], dtype=getattr(torch, args[1]), device=device)
            group.share(token_ids)
            args = (token_ids,)
        if name == "acquire":  # (rank 0 sends it only once it has its slot)
            slot, _ = runner.acquire(*args)
            if slot != expected[0]:
                raise RuntimeError(f"rank {group.rank} acquired slot {slot} where rank 0 has {expected[0]}: "
                                   "the ranks are out of step")
        else:
            try:
                getattr(runner, name)(*args)
            except ValueError as error:
                log.warning("call failed on a follower (as on rank 0)", rank=group.rank, call=name, error=str(error))
        count += 1
