"""One runner interface over a model's sequences (DESIGN §11): what the verifier's engine (and
any other caller stepping a trunk) sees, whichever family, path or device.

A runner holds up to a fixed number of sequences, each in a slot. Its two forwards:

- `prefill(chunks)`: prompt chunks of one or more sequences (each a `Window`), final-norm hidden
  rows only;
- `run(windows)`: decode or verify windows of one or more sequences as one step — one sequence
  is a batch of one; rows come back in the windows' order (rows past their total are padding);
- `run_next()`: the decode step after the last one (one row per window, each fed its step's
  greedy id, or what `feed_next` put there), enqueued on the device before the host reads the
  last one (decode-ahead; only where `can_run_ahead`).

Every step whose result is used is then kept with `settle(slot, kept_row)`, in order: the
sequence's length bookkeeping (the `CacheLength` that `acquire` handed out) has been cut back to
the rows it keeps; kept_row names the window's row (a row of the step) whose state the sequence
keeps when it keeps fewer rows than the window ran. A step computed ahead and dropped is not
settled.

Two runners: the fused one (`shared.model.graphs.FusedRunner`: the paged KV pool, captured
graphs on CUDA) and `ReferenceRunner` below (the reference modules, a cache per sequence: the
tests' oracle and `--fused off`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from shared.model.kv_cache import CacheLength


class Window(NamedTuple):
    """One sequence's rows of a step: token_ids at positions start.. of `slot`."""

    slot: int
    token_ids: list[int]
    start: int


@dataclass(frozen=True)
class WindowOutput:
    """Device tensors of one step (valid until the next): its rows, windows back to back."""

    logits: Tensor  # [T, vocab] float32
    hidden: Tensor  # [T, hidden] final-norm rows
    greedy_ids: Tensor  # [T] int64: argmax of each row (lowest id on ties)


class Runner(Protocol):
    max_rows: int  # the longest window of one sequence
    max_batch_rows: int  # the most rows of one step
    can_run_ahead: bool  # run_next is available

    @property
    def path(self) -> str: ...

    @property
    def num_free_slots(self) -> int | None: ...  # None: no fixed number of slots

    @property
    def num_free_blocks(self) -> int | None: ...  # None: no paged pool

    def acquire(self, max_length: int) -> tuple[int, CacheLength]: ...

    def release(self, slot: int) -> None: ...

    def prefill(self, chunks: list[Window]) -> Tensor: ...

    def run(self, windows: list[Window]) -> WindowOutput: ...

    def run_next(self) -> WindowOutput: ...

    def feed_next(self, token_ids: Tensor) -> None: ...

    def settle(self, slot: int, kept_row: int | None = None) -> None: ...


def check_windows(windows: list[Window], *, max_rows: int, max_batch_rows: int) -> tuple[list[Window], int]:
    """(the windows as Windows (plain (slot, token_ids, start) tuples are taken), the step's rows);
    ValueError unless 1..max_batch_rows rows, none empty, one sequence's window at most max_rows."""
    checked, num_rows = [], 0
    for w in windows:
        if not isinstance(w, Window):
            w = Window(*w)
        if not w.token_ids:
            num_rows = -1
            break
        num_rows += len(w.token_ids)
        checked.append(w)
    if not checked or num_rows < 1 or num_rows > max_batch_rows:
        total = sum(len(w[1]) for w in windows)
        raise ValueError(f"a step of {total} rows in {len(windows)} windows (1..{max_batch_rows} rows, none empty)")
    if len(checked) == 1 and num_rows > max_rows:
        raise ValueError(f"a window of {num_rows} rows (1..{max_rows} allowed)")
    return checked, num_rows


class ReferenceRunner:
    """The reference modules behind the runner interface: a cache of the family's own per
    sequence, windows run one after another, eagerly. row_invariant (CPU): every window runs as
    its rows' one-row steps, so each row's bits are the decoded row's (exact mode, DESIGN §11)."""

    can_run_ahead = False  # (a step ahead would advance the reference cache's state past the round)
    path = "reference"
    num_free_slots = None
    num_free_blocks = None

    def __init__(self, model, *, max_rows: int, max_batch_rows: int, row_invariant: bool = True) -> None:
        self.model = model
        self.max_rows = max_rows
        self.max_batch_rows = max_batch_rows
        self.row_invariant = row_invariant
        self.caches: dict[int, object] = {}  # slot -> the family's cache (its own length)
        self.lengths: dict[int, CacheLength] = {}  # slot -> the length handed to the caller
        self._next_slot = 0

    def acquire(self, max_length: int) -> tuple[int, CacheLength]:
        cache = self.model.new_cache(max_length)
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.caches[slot], self.lengths[slot] = cache, CacheLength(max_length)
        return slot, self.lengths[slot]

    def release(self, slot: int) -> None:
        if self.caches.pop(slot, None) is None:
            raise ValueError(f"slot {slot} is not held")
        del self.lengths[slot]

    def _cache(self, window: Window):
        cache = self.caches.get(window.slot)
        if cache is None:
            raise ValueError(f"slot {window.slot} is not held")
        if cache.length != window.start:
            raise ValueError(f"slot {window.slot} holds {cache.length} rows; a step at position {window.start} "
                             "follows its last settled one")
        return cache

    def prefill(self, chunks: list[Window]) -> Tensor:
        device = self.model.device
        return torch.cat([self.model.prefill(torch.tensor(ids, dtype=torch.int64, device=device),
                                             self._cache(Window(slot, ids, start))) for slot, ids, start in chunks])

    def run(self, windows: list[Window]) -> WindowOutput:
        windows, _ = check_windows(windows, max_rows=self.max_rows, max_batch_rows=self.max_batch_rows)
        device = self.model.device
        parts = [self.model(torch.tensor(w.token_ids, dtype=torch.int64, device=device), self._cache(w),
                            row_invariant=self.row_invariant) for w in windows]
        logits = torch.cat([logits for logits, _ in parts])
        return WindowOutput(logits, torch.cat([hidden for _, hidden in parts]), logits.argmax(dim=-1))

    def run_next(self) -> WindowOutput:
        raise ValueError("the reference runner computes no step ahead (can_run_ahead is False)")

    def feed_next(self, token_ids: Tensor) -> None:
        raise ValueError("the reference runner computes no step ahead (can_run_ahead is False)")

    def settle(self, slot: int, kept_row: int | None = None) -> None:
        """The family's cache keeps what the caller's length keeps (its own rollback: the KV
        rows, and the hybrid family's linear states after the last row kept)."""
        cache, length = self.caches[slot], self.lengths[slot].length
        if cache.length != length:
            cache.truncate(length)
