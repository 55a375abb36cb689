"""The fused runner (shared.model.runner's interface on the fused path): steps of the fused
trunk forward over the paged KV pool, captured as CUDA graphs.

Every step reads its inputs (token ids, positions, KV slots, sequences, linear-attention state
buffers) from one device buffer that a single asynchronous copy fills (`StepInputs`, named views
of it), and writes into the KV pool through fixed addresses. A round is then: one host→device
copy, one graph replay, and the caller's read of what it needs (the greedy ids, the hidden
rows), with no other host synchronisation. Without CUDA (or with capture off) the same code
runs eagerly.

A step's shape is (rows, sequences, longest window). Graphs are captured per shape:
- one sequence's window of T rows, T = 1..max_rows: (T, 1, T);
- decode batches (one row per sequence) in buckets of 2, 4, 8, 16, ...: (b, b, 1), the spare
  rows padded as one-row sequences on a scratch slot that no request holds;
- verify batches of windows of at most `verify_window` rows, in the same buckets: (b, b,
  verify_window) — up to b sequences (unused ones are empty);
- and for each decode shape (T = 1 included) its chained successor (`run_next`): the step at
  the next positions, fed on the device by this one's greedy ids (or `feed_next`'s).
Other steps run eagerly at their exact shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import Tensor

from kernels.fused import cpu_rows, cpu_step
from shared.model.fused import FusedForward
from shared.model.rows import Rows
from shared.model.kv_cache import CacheLength, KVPool
from shared.model.runner import Window, WindowOutput, check_windows
from shared.model.segments import SegmentedForward
from shared.threads import step_threads

# On the CPU, prompt rows at positions below this go through the native step (kernels.fused.cpu_step):
# a short prompt's rows are cheaper there than as one eager forward of torch ops, a long prompt's
# later rows (whose attention spans more keys) cheaper as that forward (docs/PERFORMANCE.md). A
# row's position decides, so a prompt's rows take the same way however it is chunked or batched;
# the step's rows are their own bits whatever shares the call, where the forward's torch products
# follow the rows beside them.
STEPPED_PROMPT_ROWS = 256

# Offloaded models: the most step shapes captured as graph segments (each holds a graph per MoE
# layer and its buffers); shapes beyond them run eagerly. Windows of 1..17 rows and the common
# decode batches fit.
MAX_SEGMENTED_SHAPES = 48

Shape = tuple[int, int, int]  # (rows, sequences, the longest sequence's rows)


class StepInputs:
    """A step's int64 inputs in one buffer (one host→device copy a step), as named views; R =
    max_batch_rows, S = R sequences at most (a bucket's padding rows are one-row sequences)."""

    FIELDS = ("token_ids", "positions", "slots", "seq_slots", "seq_starts", "live", "state_in", "state_out")

    def __init__(self, max_rows: int, device: torch.device, *, pinned: bool) -> None:
        sizes = {name: max_rows + (name == "seq_starts") for name in self.FIELDS}
        self.host = torch.zeros(sum(sizes.values()), dtype=torch.int64, pin_memory=pinned)
        self.device = torch.zeros(self.host.shape, dtype=torch.int64, device=device)
        self.spans: dict[str, slice] = {}
        offset = 0
        for name in self.FIELDS:
            self.spans[name] = slice(offset, offset + sizes[name])
            offset += sizes[name]
        self.copied = torch.cuda.Event() if pinned else None
        values = self.host.numpy()
        self.fields = SimpleNamespace(**{name: values[span] for name, span in self.spans.items()})  # numpy views

    def on_device(self, name: str, count: int) -> Tensor:
        """The first `count` entries of a field in the device buffer (what a graph reads)."""
        span = self.spans[name]
        return self.device[span.start : span.start + count]

    def to_fill(self) -> SimpleNamespace:
        """The host buffer's fields (attributes) as numpy views to fill, once the last step's copy has left
        it (normally long done)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.fields

    def send(self) -> None:
        self.device.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class FusedRunner:
    def __init__(self, fused: FusedForward, pool: KVPool, max_rows: int, *, max_batch_rows: int | None = None,
                 scratch_slot: int | None = None, verify_window: int = 0, use_graphs: bool | None = None) -> None:
        """max_rows: the longest window of one sequence; max_batch_rows: the most rows of one
        step (default max_rows); scratch_slot: a pool slot no request holds, where padded rows
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
        # Decode-ahead where the device computes the step ahead while the host reads this one (a
        # GPU). On the CPU the host would compute it itself before this round's tokens go out,
        # and for nothing whenever the next round differs; tests set it to run that path here.
        self.can_run_ahead = self.device.type == "cuda"
        # The CPU's one-call step writes these (made at its first step; None: none yet).
        self._step_output: cpu_step.StepOutput | None = None
        # Offloaded experts: the forward reads each layer's routes on the host, so on CUDA each
        # step shape runs as graph segments between those reads (captured at first use) where the
        # family's forward has them, else eagerly.
        self.segments: dict[Shape, SegmentedForward] | None = None
        if fused.offloaded:
            self.segments = {} if self.use_graphs and fused.segmented_offload else None
            self.use_graphs = False
        # Linear-attention state buffers (the hybrid family): which each sequence reads and writes.
        self.states = fused.states
        self.inputs = StepInputs(max_batch_rows, self.device, pinned=self.device.type == "cuda")
        self.token_ids = self.inputs.on_device("token_ids", max_batch_rows)
        self._shape_rows: dict[Shape, Rows] = {}
        self.kv = pool.paged()
        self.graphs: dict[Shape, tuple[torch.cuda.CUDAGraph, WindowOutput]] = {}
        self.chained: dict[Shape, tuple[torch.cuda.CUDAGraph, WindowOutput]] = {}  # by the decode shape before
        self.memory_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Every decode step (one row per sequence) leaves its greedy ids here; its chained
        # successor feeds them back at the next positions of the real rows (the live mask keeps
        # padding put).
        self.last_ids = torch.zeros(max_batch_rows, dtype=torch.int64, device=self.device)
        self.last_decode: Shape | None = None  # the shape of the last step if it was a decode step
        self.last_shape: Shape | None = None  # the shape of the last step `run` took

    @property
    def path(self) -> str:
        return "fused+graphs" if self.use_graphs else "fused"

    # -- sequences ------------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return self.pool.num_free

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def acquire(self, max_length: int) -> tuple[int, CacheLength]:
        """A slot and its blocks for max_length positions; a new sequence there starts from zero
        linear-attention state."""
        slot, cache = self.pool.acquire(max_length)
        if self.states is not None:
            self.states.reset(slot)
        return slot, cache

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    def settle(self, slot: int, kept_row: int | None = None) -> None:
        """Keep the last step run for `slot` (its state becomes the committed one); kept_row: the
        step was a window rolled back to the row at step row `kept_row`."""
        if self.states is not None:
            self.states.settle(slot, kept_row)

    # -- forwards -------------------------------------------------------------------------------

    def prefill(self, chunks: list[Window]) -> Tensor:
        """Prompt chunks of several sequences as one eager forward (long chunks are compute-bound;
        per-kernel host work is amortised): final-norm hidden [rows, hidden]. On the CPU the rows
        at positions below STEPPED_PROMPT_ROWS go through the step first."""
        step = self.fused.step_plan(self.kv)  # (None off the CPU)
        if step is None:
            return self._prefill_forward(chunks)
        token_ids, positions, slots, rest, heads = [], [], [], [], []  # (the stepped rows; the rest's windows)
        for slot, ids, start in chunks:
            head = max(0, min(len(ids), STEPPED_PROMPT_ROWS - start))
            heads.append(head)
            token_ids.extend(ids[:head])
            positions.extend(range(start, start + head))
            slots.extend([slot] * head)
            if head < len(ids):
                rest.append(Window(slot, ids[head:], start + head))
        if not rest:
            return step.prompt_rows(token_ids, positions, slots, step_threads())
        if not token_ids:
            return self._prefill_forward(rest)
        # (the stepped rows first: a chunk's later rows attend to their keys)
        stepped = step.prompt_rows(token_ids, positions, slots, step_threads())
        stepped_rows = iter(stepped.split([head for head in heads if head]))
        forward_rows = iter(self._prefill_forward(rest).split([len(window.token_ids) for window in rest]))
        order = []  # each chunk's stepped rows, then its forward's
        for (_, ids, _), head in zip(chunks, heads):
            if head:
                order.append(next(stepped_rows))
            if head < len(ids):
                order.append(next(forward_rows))
        return torch.cat(order)

    def _prefill_forward(self, chunks: list[Window]) -> Tensor:
        """Prompt chunks as one eager forward: final-norm hidden [rows, hidden]."""
        token_ids = [t for _, ids, _ in chunks for t in ids]
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return self.fused.prefill(ids, [(start, len(ids), slot) for slot, ids, start in chunks], self.kv)

    def _rows(self, shape: Shape) -> Rows:
        """The step's rows as views of the device inputs (made once per shape: the buffer's
        addresses never change, only what the host copies into it)."""
        rows = self._shape_rows.get(shape)
        if rows is None:
            num_rows, num_seqs, longest = shape
            view = self.inputs.on_device
            states = {} if self.states is None else dict(state_in=view("state_in", num_seqs),
                                                          state_out=view("state_out", num_seqs))
            rows = self._shape_rows[shape] = Rows(
                positions=view("positions", num_rows),
                slots=view("slots", num_rows),
                seq_starts=view("seq_starts", num_seqs + 1),
                seq_slots=view("seq_slots", num_seqs),
                max_rows_per_seq=longest,
                live=None if num_seqs == 1 else view("live", num_rows),  # (one sequence: no padding)
                **states,
            )
        return rows

    def _trunk(self, rows: Rows, shape: Shape) -> tuple[Tensor, Tensor]:
        """The fused forward of the rows in the inputs, by graph segments where the model offloads."""
        token_ids = self.token_ids[: shape[0]]
        if self.segments is None:
            return self.fused.forward(token_ids, rows, self.kv)
        segmented = self.segments.get(shape)
        if segmented is None:  # the first of this shape: eagerly (which compiles the kernels), then capture
            output = self.fused.forward(token_ids, rows, self.kv)
            if len(self.segments) < MAX_SEGMENTED_SHAPES:
                self.segments[shape] = SegmentedForward(self.fused, token_ids, rows, self.kv)
            return output
        return segmented.run()

    def _forward(self, shape: Shape) -> WindowOutput:
        logits, hidden = self._trunk(self._rows(shape), shape)
        greedy_ids = cpu_rows.argmax(logits) if self.device.type == "cpu" else None  # (the lock dropped once)
        output = WindowOutput(logits, hidden, logits.argmax(dim=-1) if greedy_ids is None else greedy_ids)
        if shape[2] == 1:
            self.last_ids[: shape[0]].copy_(output.greedy_ids)
        return output

    def _chained_forward(self, shape: Shape) -> WindowOutput:
        num_rows = shape[0]
        rows = self._rows(shape)
        self.token_ids[:num_rows].copy_(self.last_ids[:num_rows])
        if rows.live is None:
            rows.positions.add_(1)
        else:
            rows.positions.add_(rows.live)
        if self.states is not None:  # read the state the step before wrote, write the buffer it read
            before = rows.state_in.clone()
            rows.state_in.copy_(rows.state_out)
            rows.state_out.copy_(before)
        return self._forward(shape)

    # -- graphs ---------------------------------------------------------------------------------

    def batch_buckets(self) -> list[int]:
        """The batch sizes captured as graphs: 2, 4, then every multiple of 8 up to max_batch_rows,
        and it (padding rows cost their attention and norms, not their experts)."""
        if self.scratch_slot is None or self.max_batch_rows < 2:
            return []
        sizes = {2, 4, *range(8, self.max_batch_rows + 1, 8), self.max_batch_rows}
        return sorted(s for s in sizes if s <= self.max_batch_rows)

    def capture(self, sizes: list[int] | None = None, progress: Callable[[str, float], None] | None = None) -> None:
        """Capture the windows of `sizes` rows (default 1..max_rows), the decode and verify
        batches, and the decode shapes' chained successors, warming each up first.

        The warm-up runs write KV rows at position 0 of slot 0; capture happens before any
        request holds a slot, so nothing committed is touched.
        """
        if not self.use_graphs:
            return
        shapes = [(rows, 1, rows) for rows in sizes or range(1, self.max_rows + 1)]
        shapes += [(b, b, 1) for b in self.batch_buckets()]
        if self.verify_window > 1:
            shapes += [(b, b, self.verify_window) for b in self.batch_buckets() if b >= self.verify_window]
        for shape in shapes:
            started = time.perf_counter()
            self.graphs[shape] = self._capture(lambda s=shape: self._forward(s))
            if shape[2] == 1:
                self.chained[shape] = self._capture(lambda s=shape: self._chained_forward(s))
            if progress is not None:
                rows, seqs, longest = shape
                what = (f"the {rows}-row window" if seqs == 1 else f"the decode batch of {rows} rows" if longest == 1
                        else f"the verify batch of {rows} rows")
                progress(what, time.perf_counter() - started)

    def _capture(self, body: Callable[[], WindowOutput]) -> tuple[torch.cuda.CUDAGraph, WindowOutput]:
        self.inputs.host.zero_()
        self.inputs.device.copy_(self.inputs.host)
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

    # -- steps ----------------------------------------------------------------------------------

    def _shape(self, windows: list[Window], num_rows: int) -> tuple[Shape, bool]:
        """(the step's shape, whether it is a captured bucket with padding rows)."""
        longest = max(len(w.token_ids) for w in windows)
        if len(windows) == 1:
            return (num_rows, 1, num_rows), False
        if self.use_graphs:
            width = 1 if longest == 1 else self.verify_window if longest <= self.verify_window else 0
            if width:
                bucket = next((b for b in self.batch_buckets() if b >= num_rows and (b, b, width) in self.graphs), None)
                if bucket is not None:
                    return (bucket, bucket, width), True
        return (num_rows, len(windows), longest), False

    def run(self, windows: list[Window]) -> WindowOutput:
        """The windows (slot, token_ids, start) of one or more sequences as one step (their KV
        rows are written); output rows follow the windows' order (rows past their total are
        padding)."""
        windows, num_rows = check_windows(windows, max_rows=self.max_rows, max_batch_rows=self.max_batch_rows)
        step = self.fused.step_plan(self.kv) if not self.can_run_ahead and num_rows <= cpu_step.MAX_ROWS else None
        if step is not None:
            return self._run_step(step, windows)
        shape, padded = self._shape(windows, num_rows)
        f = self.inputs.to_fill()
        token_ids, positions, slots, seq_slots, seq_starts = f.token_ids, f.positions, f.slots, f.seq_slots, f.seq_starts
        states = self.states
        row = 0
        for seq, (slot, ids, start) in enumerate(windows):
            end = row + len(ids)
            token_ids[row:end] = ids
            positions[row:end] = range(start, start + len(ids))
            slots[row:end] = slot
            seq_slots[seq] = slot
            seq_starts[seq] = row
            if states is not None:  # it reads the slot's committed state and writes the other buffer
                f.state_in[seq], f.state_out[seq] = states.buffers(slot)
            row = end
        num_seqs = len(windows)
        if padded:
            bucket, scratch = shape[0], self.scratch_slot
            for pad in range(num_rows, bucket):  # one-row sequences at position 0 of the scratch slot
                seq = num_seqs + pad - num_rows
                token_ids[pad] = positions[pad] = 0
                slots[pad] = seq_slots[seq] = scratch
                seq_starts[seq] = pad
                if states is not None:
                    f.state_in[seq], f.state_out[seq] = states.buffers(scratch)
            used = num_seqs + bucket - num_rows
            seq_starts[used : bucket + 1] = bucket  # the bucket's unused sequences are empty
            seq_slots[used:bucket] = scratch
            f.live[:num_rows] = 1
            f.live[num_rows:bucket] = 0
        else:
            seq_starts[num_seqs] = num_rows
            if num_seqs > 1:
                f.live[:num_rows] = 1
        self.inputs.send()
        self.last_shape = shape
        self.last_decode = shape if shape[2] == 1 else None
        captured = self.graphs.get(shape) if self.use_graphs else None
        if captured is None:
            return self._forward(shape)
        graph, output = captured
        graph.replay()
        return output

    def _run_step(self, step: cpu_step.StepPlan, windows: list[Window]) -> WindowOutput:
        """The windows as the CPU's one-call step, its rows from lists (no staged inputs, no torch
        call: the interpreter lock is dropped once), into the runner's output buffers. Not a
        decode step `run_next` could follow: where it may (can_run_ahead), `run` stages inputs."""
        token_ids, positions, slots = [], [], []
        for slot, ids, start in windows:
            token_ids.extend(ids)
            positions.extend(range(start, start + len(ids)))
            slots.extend([slot] * len(ids))
        out = self._step_output
        if out is None:
            out = self._step_output = cpu_step.StepOutput(self.max_batch_rows, step.vocab, step.hidden, step.dtype)
        self.last_shape = self.last_decode = None
        return WindowOutput(*step.run_into(token_ids, positions, slots, out, step_threads()))

    def last_graph(self) -> torch.cuda.CUDAGraph | None:
        """The graph the last `run` replayed (None: it ran eagerly); benchmarks replay it."""
        captured = self.graphs.get(self.last_shape) if self.use_graphs else None
        return None if captured is None else captured[0]

    def feed_next(self, token_ids: Tensor) -> None:
        """The tokens [n] the real rows of the next chained step decode, in place of the last
        step's greedy ids (a sampled request's draws, made on the device: enqueue them before
        run_next)."""
        self.last_ids[: token_ids.shape[0]].copy_(token_ids)

    def run_next(self) -> WindowOutput:
        """The decode step after the last decode step (or its chained successor): every real
        row's greedy token (or what feed_next put there) at its next position, fed on the device
        (enqueue it before reading the last step's result)."""
        if self.last_decode is None:
            raise ValueError("run_next follows a decode step (one row per window)")
        captured = self.chained.get(self.last_decode) if self.use_graphs else None
        if captured is None:
            return self._chained_forward(self.last_decode)
        graph, output = captured
        graph.replay()
        return output
