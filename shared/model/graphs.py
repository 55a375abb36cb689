"""Captured decode/verify windows: the fused trunk forward of 1..max_rows rows as CUDA graphs.

One graph per window size, all reading their inputs (token ids, positions, KV slot) from one
device buffer that a single asynchronous copy fills per round, and all writing into the
KV pool through fixed addresses. A round is then: one host→device copy, one graph replay,
and the caller's read of what it needs (the greedy ids, the hidden rows), with no other
host synchronisation. Without CUDA (or with capture off) the same code runs eagerly.

Batches (`run_batch`): the windows of several sequences (each on its own slot) as one ragged
forward. A batch of one-row windows (plain decoding) replays the graph of the smallest
captured bucket that holds it, the spare rows padded as one-row sequences on a scratch slot
that no request holds. A batch of verify windows of at most `verify_window` rows each does
the same with the verify buckets (graphs of R rows in up to R sequences of up to
verify_window rows; unused sequences are empty); other batches run eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from shared.model.fused import FusedForward
from shared.model.rows import Rows
from shared.model.kv_cache import KVPool
from shared.model.segments import SegmentedForward

# Offloaded models: the most window/batch shapes captured as graph segments (each holds a graph
# per MoE layer and its buffers); shapes beyond them run eagerly. Windows of 1..17 rows and the
# common decode batches fit.
MAX_SEGMENTED_SHAPES = 48


@dataclass(frozen=True)
class WindowOutput:
    """Device tensors of one window (valid until the next run): rows 0..T-1."""

    logits: Tensor  # [T, vocab] float32
    hidden: Tensor  # [T, hidden] final-norm rows
    greedy_ids: Tensor  # [T] int64: argmax of each row (lowest id on ties)


class WindowGraphs:
    def __init__(self, fused: FusedForward, pool: KVPool, max_rows: int, *, max_batch_rows: int | None = None,
                 scratch_slot: int | None = None, verify_window: int = 0, use_graphs: bool | None = None) -> None:
        """max_rows: the largest window of one sequence; max_batch_rows: the most rows of one
        batch (default max_rows); scratch_slot: a pool slot no request holds, where padded rows
        of batch graphs write (without one, batches run eagerly); verify_window: the longest
        window of captured verify batches (0 or 1: none; typically max draft tokens + 1)."""
        max_batch_rows = max_batch_rows or max_rows
        if not 1 <= max_rows <= max_batch_rows <= fused.max_rows:
            raise ValueError(f"need 1 <= max_rows ({max_rows}) <= max_batch_rows ({max_batch_rows}) "
                             f"<= the fused model's max_rows ({fused.max_rows})")
        self.fused = fused
        self.pool = pool
        self.max_rows = max_rows
        self.max_batch_rows = max_batch_rows
        self.scratch_slot = scratch_slot
        self.verify_window = min(verify_window, max_rows)
        self.device = fused.model.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        # Offloaded experts: the forward reads each layer's routes on the host, so on CUDA each
        # window or batch shape runs as graph segments between those reads (captured at first use)
        # where the family's forward has them, else eagerly.
        self.segments: dict[tuple[int, ...], SegmentedForward] | None = None
        if fused.offloaded:
            self.segments = {} if self.use_graphs and fused.segmented_offload else None
            self.use_graphs = False
        pin = self.device.type == "cuda"
        # Linear-attention state buffers (the hybrid family): which each sequence reads and writes.
        self.states = fused.states
        # [ids | positions | slots | sequence slots | sequence starts (R + 1) | real-row mask |
        #  state read | state write], R = max_batch_rows
        size = 8 * max_batch_rows + 1
        self.host_in = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.dev_in = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.copied = torch.cuda.Event() if pin else None
        self.kv = pool.paged()
        self.seq_starts = {t: torch.tensor([0, t], dtype=torch.int64, device=self.device) for t in range(1, max_rows + 1)}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, WindowOutput]] = {}
        self.batch_graphs: dict[int, tuple[torch.cuda.CUDAGraph, WindowOutput]] = {}  # decode batches by bucket
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, WindowOutput]] = {}  # verify batches by bucket
        self.memory_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Chained 1-row steps (decode-ahead): every 1-row step leaves its greedy token here, and
        # the chained step reads it as its input at the next position, without the host.
        self.last_token = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.chained: tuple[torch.cuda.CUDAGraph, WindowOutput] | None = None
        # The same for decode batches: each leaves its greedy ids here; the chained batch step
        # feeds them back at the next positions of the real rows (the mask keeps padding put).
        self.last_batch_ids = torch.zeros(max_batch_rows, dtype=torch.int64, device=self.device)
        self.chained_batches: dict[int, tuple[torch.cuda.CUDAGraph, WindowOutput]] = {}
        self.last_decode_rows: int | None = None  # padded rows of the last decode batch (None: not one)

    def _rows(self, num_rows: int) -> Rows:
        m = self.max_batch_rows
        return Rows(
            positions=self.dev_in[m : m + num_rows],
            slots=self.dev_in[2 * m : 2 * m + num_rows],
            seq_starts=self.seq_starts[num_rows],
            seq_slots=self.dev_in[3 * m : 3 * m + 1],
            max_rows_per_seq=num_rows,
            **self._state_views(1),
        )

    def _state_views(self, num_seqs: int) -> dict[str, Tensor]:
        """Rows' state_in / state_out views of dev_in (families with linear-attention states)."""
        if self.states is None:
            return {}
        m = self.max_batch_rows
        return dict(state_in=self.dev_in[6 * m + 1 : 6 * m + 1 + num_seqs],
                    state_out=self.dev_in[7 * m + 1 : 7 * m + 1 + num_seqs])

    def _swap_states(self, num_seqs: int) -> None:
        """A chained step reads the state its predecessor wrote and writes the buffer it read
        (on the device: the step before may be the one just enqueued)."""
        if self.states is not None:
            views = self._state_views(num_seqs)
            read = views["state_in"].clone()
            views["state_in"].copy_(views["state_out"])
            views["state_out"].copy_(read)

    def _batch_rows(self, num_rows: int, num_seqs: int, max_rows_per_seq: int) -> Rows:
        m = self.max_batch_rows
        return Rows(
            positions=self.dev_in[m : m + num_rows],
            slots=self.dev_in[2 * m : 2 * m + num_rows],
            seq_starts=self.dev_in[4 * m : 4 * m + num_seqs + 1],
            seq_slots=self.dev_in[3 * m : 3 * m + num_seqs],
            max_rows_per_seq=max_rows_per_seq,
            live=self.dev_in[5 * m : 5 * m + num_rows],
            **self._state_views(num_seqs),
        )

    def _trunk(self, rows: Rows, key: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """The fused forward of the rows in dev_in, by graph segments where the model offloads."""
        token_ids = self.dev_in[: rows.positions.shape[0]]
        if self.segments is None:
            return self.fused.forward(token_ids, rows, self.kv)
        segmented = self.segments.get(key)
        if segmented is None:  # the first of this shape: eagerly (which compiles the kernels), then capture
            output = self.fused.forward(token_ids, rows, self.kv)
            if len(self.segments) < MAX_SEGMENTED_SHAPES:
                self.segments[key] = SegmentedForward(self.fused, token_ids, rows, self.kv)
            return output
        return segmented.run()

    def _forward(self, num_rows: int) -> WindowOutput:
        logits, hidden = self._trunk(self._rows(num_rows), (num_rows,))
        output = WindowOutput(logits, hidden, logits.argmax(dim=-1))
        if num_rows == 1:
            self.last_token.copy_(output.greedy_ids)
        return output

    def _chained_forward(self) -> WindowOutput:
        self.dev_in[:1].copy_(self.last_token)
        self.dev_in[self.max_batch_rows : self.max_batch_rows + 1].add_(1)
        self._swap_states(1)
        return self._forward(1)

    def _batch_forward(self, num_rows: int, num_seqs: int, max_rows_per_seq: int) -> WindowOutput:
        rows = self._batch_rows(num_rows, num_seqs, max_rows_per_seq)
        logits, hidden = self._trunk(rows, (num_rows, num_seqs, max_rows_per_seq))
        output = WindowOutput(logits, hidden, logits.argmax(dim=-1))
        if max_rows_per_seq == 1:
            self.last_batch_ids[:num_rows].copy_(output.greedy_ids)
        return output

    def _chained_batch_forward(self, num_rows: int) -> WindowOutput:
        m = self.max_batch_rows
        self.dev_in[:num_rows].copy_(self.last_batch_ids[:num_rows])
        self.dev_in[m : m + num_rows].add_(self.dev_in[5 * m : 5 * m + num_rows])
        self._swap_states(num_rows)
        return self._batch_forward(num_rows, num_rows, 1)

    def batch_buckets(self) -> list[int]:
        """The batch sizes captured as graphs: 2, 4, then every multiple of 8 up to max_batch_rows,
        and it (padding rows cost their attention and norms, not their experts)."""
        if self.scratch_slot is None or self.max_batch_rows < 2:
            return []
        sizes = {2, 4, *range(8, self.max_batch_rows + 1, 8), self.max_batch_rows}
        return sorted(s for s in sizes if s <= self.max_batch_rows)

    def capture(self, sizes: list[int] | None = None, progress: Callable[[str, float], None] | None = None) -> None:
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
                progress(f"the {num_rows}-row window", time.perf_counter() - started)
        if 1 in self.graphs:
            self.chained = self._capture(self._chained_forward)
        for bucket in self.batch_buckets():
            started = time.perf_counter()
            self.batch_graphs[bucket] = self._capture(lambda b=bucket: self._batch_forward(b, b, 1))
            self.chained_batches[bucket] = self._capture(lambda b=bucket: self._chained_batch_forward(b))
            if progress is not None:
                progress(f"the decode batch of {bucket} rows", time.perf_counter() - started)
        if self.verify_window > 1:
            for bucket in [b for b in self.batch_buckets() if b >= self.verify_window]:
                started = time.perf_counter()
                self.verify_graphs[bucket] = self._capture(lambda b=bucket: self._batch_forward(b, b, self.verify_window))
                if progress is not None:
                    progress(f"the verify batch of {bucket} rows", time.perf_counter() - started)

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

    def feed_next(self, token_ids: Tensor) -> None:
        """The token [1] the next chained 1-row step decodes, in place of the last step's greedy
        one (a sampled request's draw, made on the device: enqueue it before run_chained)."""
        self.last_token.copy_(token_ids)

    def feed_next_batch(self, token_ids: Tensor) -> None:
        """The tokens [n] the real rows of the next chained decode batch decode, in place of the
        last batch's greedy ids (draws: enqueue them before run_batch_chained)."""
        self.last_batch_ids[: token_ids.shape[0]].copy_(token_ids)

    def run(self, slot: int, token_ids: list[int], start: int) -> WindowOutput:
        """The window token_ids at positions start.. of `slot` (its KV rows are written)."""
        num_rows = len(token_ids)
        if not 1 <= num_rows <= self.max_rows:
            raise ValueError(f"a window of {num_rows} rows (1..{self.max_rows} allowed)")
        m = self.max_batch_rows
        values = self._host_values()
        values[:num_rows] = token_ids
        values[m : m + num_rows] = range(start, start + num_rows)
        values[2 * m : 2 * m + num_rows] = slot
        values[3 * m] = slot
        self._state_values(values, 0, slot)
        self._send()
        self.last_decode_rows = None
        captured = self.graphs.get(num_rows)
        if captured is None:
            return self._forward(num_rows)
        graph, output = captured
        graph.replay()
        return output

    def _host_values(self):
        """host_in as a numpy array to fill, once the last round's copy has left it (normally
        long done)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_in.numpy()

    def _state_values(self, values, seq: int, slot: int) -> None:
        """Sequence `seq` of the next step reads the slot's committed state and writes the other buffer."""
        if self.states is not None:
            m = self.max_batch_rows
            values[6 * m + 1 + seq], values[7 * m + 1 + seq] = self.states.buffers(slot)

    def reset_state(self, slot: int) -> None:
        """A new sequence at `slot` starts from zero linear-attention state (no-op without one)."""
        if self.states is not None:
            self.states.reset(slot)

    def settle(self, slot: int, kept_row: int | None = None) -> None:
        """Keep the last step run for `slot` (its state becomes the committed one); kept_row: the
        step was a window rolled back to the row at batch row `kept_row`. Every step whose
        result is used is settled once, in order; a step computed ahead and dropped is not."""
        if self.states is not None:
            self.states.settle(slot, kept_row)

    def _send(self) -> None:
        self.dev_in.copy_(self.host_in, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def run_batch(self, windows: list[tuple[int, list[int], int]]) -> WindowOutput:
        """Several sequences' windows (slot, token_ids, start) as one ragged forward; output rows
        follow the windows' order (rows past their total are padding)."""
        num_rows = sum(len(ids) for _, ids, _ in windows)
        num_seqs = len(windows)
        if not 1 <= num_rows <= self.max_batch_rows or any(not ids for _, ids, _ in windows):
            raise ValueError(f"a batch of {num_rows} rows in {num_seqs} windows (1..{self.max_batch_rows} rows, "
                             "none empty)")
        longest = max(len(ids) for _, ids, _ in windows)
        graphs = {}
        if self.use_graphs:
            graphs = self.batch_graphs if longest == 1 else self.verify_graphs if longest <= self.verify_window else {}
        bucket = next((b for b in sorted(graphs) if b >= num_rows), None)
        padded = bucket or num_rows
        m = self.max_batch_rows
        values = self._host_values()
        row = 0
        for seq, (slot, ids, start) in enumerate(windows):
            values[row : row + len(ids)] = ids
            values[m + row : m + row + len(ids)] = range(start, start + len(ids))
            values[2 * m + row : 2 * m + row + len(ids)] = slot
            values[3 * m + seq] = slot
            values[4 * m + seq] = row
            self._state_values(values, seq, slot)
            row += len(ids)
        for pad in range(num_rows, padded):  # one-row sequences at position 0 of the scratch slot
            values[pad] = 0
            values[m + pad] = 0
            values[2 * m + pad] = self.scratch_slot
            values[3 * m + num_seqs + pad - num_rows] = self.scratch_slot
            values[4 * m + num_seqs + pad - num_rows] = pad
            self._state_values(values, num_seqs + pad - num_rows, self.scratch_slot)
        used_seqs = num_seqs + padded - num_rows
        values[4 * m + used_seqs : 4 * m + padded + 1] = padded  # the bucket's unused sequences are empty
        values[3 * m + used_seqs : 3 * m + padded] = self.scratch_slot if bucket is not None else 0
        values[5 * m : 5 * m + padded] = [1] * num_rows + [0] * (padded - num_rows)
        self._send()
        self.last_decode_rows = padded if longest == 1 else None
        if bucket is None:
            return self._batch_forward(num_rows, num_seqs, longest)
        graph, output = graphs[bucket]
        graph.replay()
        return output

    def run_batch_chained(self) -> WindowOutput:
        """The decode batch after the last decode batch (or its chained successor): every real
        row's greedy token at its next position, fed on the device (enqueue it before reading
        the last step's result)."""
        if self.last_decode_rows is None:
            raise ValueError("run_batch_chained follows a decode batch (one-row windows)")
        captured = self.chained_batches.get(self.last_decode_rows) if self.use_graphs else None
        if captured is None:
            return self._chained_batch_forward(self.last_decode_rows)
        graph, output = captured
        graph.replay()
        return output
