"""Captured decode/verify windows: the fused trunk forward of 1..max_rows rows as CUDA graphs.

One graph per window size, all reading their inputs (token ids, positions, KV slot) from one
device buffer that a single asynchronous copy fills per round, and all writing into the
KV pool through fixed addresses. A round is then: one host→device copy, one graph replay,
and the caller's read of what it needs (the greedy ids, the hidden rows), with no other
host synchronisation. Without CUDA (or with capture off) the same code runs eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from shared.model.fast import FusedModel, Rows
from shared.model.kv_cache import KVPool


@dataclass(frozen=True)
class WindowOutput:
    """Device tensors of one window (valid until the next run): rows 0..T-1."""

    logits: Tensor  # [T, vocab] float32
    hidden: Tensor  # [T, hidden] final-norm rows
    greedy_ids: Tensor  # [T] int64: argmax of each row (lowest id on ties)


class WindowGraphs:
    def __init__(self, fused: FusedModel, pool: KVPool, max_rows: int, *, use_graphs: bool | None = None) -> None:
        if not 1 <= max_rows <= fused.max_rows:
            raise ValueError(f"max_rows {max_rows} must lie in [1, {fused.max_rows}]")
        self.fused = fused
        self.pool = pool
        self.max_rows = max_rows
        self.device = fused.model.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        pin = self.device.type == "cuda"
        # [ids (max_rows) | positions (max_rows) | slots (max_rows) | sequence slot (1)]
        self.host_in = torch.zeros(3 * max_rows + 1, dtype=torch.int64, pin_memory=pin)
        self.dev_in = torch.zeros(3 * max_rows + 1, dtype=torch.int64, device=self.device)
        self.copied = torch.cuda.Event() if pin else None
        self.kv = pool.layers()
        self.seq_starts = {t: torch.tensor([0, t], dtype=torch.int32, device=self.device) for t in range(1, max_rows + 1)}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, WindowOutput]] = {}
        self.memory_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Chained 1-row steps (decode-ahead): every 1-row step leaves its greedy token here, and
        # the chained step reads it as its input at the next position, without the host.
        self.last_token = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.chained: tuple[torch.cuda.CUDAGraph, WindowOutput] | None = None

    def _rows(self, num_rows: int) -> Rows:
        m = self.max_rows
        return Rows(
            positions=self.dev_in[m : m + num_rows],
            slots=self.dev_in[2 * m : 2 * m + num_rows],
            seq_starts=self.seq_starts[num_rows],
            seq_slots=self.dev_in[3 * m : 3 * m + 1],
            max_rows_per_seq=num_rows,
        )

    def _forward(self, num_rows: int) -> WindowOutput:
        logits, hidden = self.fused.forward(self.dev_in[:num_rows], self._rows(num_rows), self.kv)
        output = WindowOutput(logits, hidden, logits.argmax(dim=-1))
        if num_rows == 1:
            self.last_token.copy_(output.greedy_ids)
        return output

    def _chained_forward(self) -> WindowOutput:
        self.dev_in[:1].copy_(self.last_token)
        self.dev_in[self.max_rows : self.max_rows + 1].add_(1)
        return self._forward(1)

    def capture(self, sizes: list[int] | None = None, progress: Callable[[int, float], None] | None = None) -> None:
        """Capture the windows of `sizes` rows (default 1..max_rows), warming each up first.

        The warm-up runs write KV rows at position 0 of slot 0; capture happens before any
        request holds a slot, so nothing committed is touched.
        """
        if not self.use_graphs:
            return
        for num_rows in sizes or range(1, self.max_rows + 1):
            started = time.perf_counter()
            self.graphs[num_rows] = self._capture(lambda rows=num_rows: self._forward(rows))
            if progress is not None:
                progress(num_rows, time.perf_counter() - started)
        if 1 in self.graphs:
            self.chained = self._capture(self._chained_forward)

    def _capture(self, body: Callable[[], WindowOutput]) -> tuple[torch.cuda.CUDAGraph, WindowOutput]:
        self.host_in.zero_()
        self.dev_in.copy_(self.host_in)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton compiles and cuBLAS/allocator warm up outside the graph
                body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            output = body()
        return graph, output

    def run_chained(self) -> WindowOutput:
        """The 1-row step after the last 1-row step: its greedy token at the next position of the
        same slot, fed on the device (enqueue it before reading the last step's result)."""
        if self.chained is None:
            return self._chained_forward()
        graph, output = self.chained
        graph.replay()
        return output

    def run(self, slot: int, token_ids: list[int], start: int) -> WindowOutput:
        """The window token_ids at positions start.. of `slot` (its KV rows are written)."""
        num_rows = len(token_ids)
        if not 1 <= num_rows <= self.max_rows:
            raise ValueError(f"a window of {num_rows} rows (1..{self.max_rows} allowed)")
        if self.copied is not None:
            self.copied.synchronize()  # the last round's copy has left host_in (normally long done)
        m = self.max_rows
        values = self.host_in.numpy()
        values[:num_rows] = token_ids
        values[m : m + num_rows] = range(start, start + num_rows)
        values[2 * m : 2 * m + num_rows] = slot
        values[3 * m] = slot
        self.dev_in.copy_(self.host_in, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        captured = self.graphs.get(num_rows)
        if captured is None:
            return self._forward(num_rows)
        graph, output = captured
        graph.replay()
        return output
