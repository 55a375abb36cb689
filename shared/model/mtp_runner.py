"""The MTP layer's runners: each session's MTP rows (DESIGN §6) appended to its own cache,
the rows of several sessions in one call — the MTP half of shared.model.runner's interface.

- `acquire(max_length)` hands out a slot and the `CacheLength` of its rows (the caller rolls
  draft rows back with `truncate`), `release(slot)` gives it back;
- `run(items)` appends each item's rows (hidden [m, H]: trunk final-norm rows or the MTP's own
  output when chaining; the token after each [m]) to its slot and returns, per item, logits
  (the token after next) whose last row is its last row's — [m, vocab], or [1, vocab] where the
  runner computed that row's alone — and the MTP output hidden [m, H].

Two runners. `PooledMtpRunner` (the fused path): every session's rows live in one paged pool
(a slot each) and one call's items run as one ragged forward; the kernels are row-invariant, so
a row's bits are what it gets alone. The pool grows while sessions need more and shrinks back
to its start size when the last one leaves. On CUDA a chain's steps (one row per session) replay
a CUDA graph per session count, captured at the count's first step from that step's own inputs
(the warm-up runs write the same KV rows the step writes, with the same values); a pool that
grows or shrinks drops its graphs (they hold its addresses). Steps with MoCE routing or an
offloaded MTP layer, and catch-ups of several rows, run eagerly. `ReferenceMtpRunner`: the
reference modules, a cache per session, one forward per item.

Draft rows may route with MoCE (`RoutingOptions` with `moce`): every row a runner runs is a
draft row (the committed rows' catch-up routes as their drafts did).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from kernels.fused import paged_rows
from shared.model.fused import FusedForward
from shared.model.kv_cache import CacheLength, KVCache, KVPool
from shared.model.layers import RoutingOptions
from shared.model.rows import Rows

POOL_BLOCK = 64  # positions per block of the pooled runner
POOL_START_BLOCKS = 64  # blocks at start; the pool doubles when a session needs more
POOL_START_SLOTS = 8
MAX_GRAPH_SEQUENCES = 32  # chain steps of up to this many sessions replay graphs (one per count)


class MtpRows(NamedTuple):
    """One session's MTP rows of a call."""

    slot: int
    hidden: Tensor  # [m, hidden] (on the device or the host)
    next_token_ids: Tensor  # [m] int64, on the host (the runner moves what it needs)


class MtpRunner(Protocol):
    def acquire(self, max_length: int) -> tuple[int, CacheLength]: ...

    def release(self, slot: int) -> None: ...

    def run(self, items: list[MtpRows]) -> list[tuple[Tensor, Tensor]]: ...


def draft_routing(routing: RoutingOptions | None, rows: int, device: torch.device) -> RoutingOptions | None:
    """The MoCE routing of `rows` draft rows (None: full routing)."""
    if routing is None:
        return None
    draft_rows = torch.ones(rows, dtype=torch.bool, device=device)
    return RoutingOptions(moce=True, scale=routing.scale, r1_scale=routing.r1_scale, protect=routing.protect,
                          draft_rows=draft_rows)


class ReferenceMtpRunner:
    """A KVCache per session (its own length: the reference forward reserves its rows)."""

    def __init__(self, model, routing: RoutingOptions | None = None) -> None:
        self.model = model
        self.routing = routing
        self.caches: dict[int, KVCache] = {}
        self._next_slot = 0

    def acquire(self, max_length: int) -> tuple[int, CacheLength]:
        cache = self.model.new_mtp_cache(max_length)
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.caches[slot] = cache
        return slot, cache

    def release(self, slot: int) -> None:
        if self.caches.pop(slot, None) is None:
            raise ValueError(f"slot {slot} is not held")

    def run(self, items: list[MtpRows]) -> list[tuple[Tensor, Tensor]]:
        device = self.model.device
        return [self.model.forward_mtp(hidden.to(device), ids.to(device), self.caches[slot],
                                       routing=draft_routing(self.routing, ids.shape[0], device))
                for slot, hidden, ids in items]


class PooledMtpRunner:
    """Every session's MTP rows in one paged pool; a call's items as one ragged forward of the
    fused MTP layer (items beyond its max_rows: the reference modules, on a copy of the slot)."""

    def __init__(self, model, fused: FusedForward, routing: RoutingOptions | None = None, *,
                 use_graphs: bool | None = None) -> None:
        """use_graphs: chain steps as CUDA graphs (None or True: on CUDA, without MoCE routing or an
        offloaded MTP layer; False: never)."""
        self.model = model
        self.fused = fused
        self.routing = routing
        self.lengths: dict[int, CacheLength] = {}
        self.pool = self._new_pool()
        cuda = model.device.type == "cuda"
        self.use_graphs = cuda and use_graphs is not False and routing is None and fused.mtp_offload is None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor] | None] = {}  # by sessions (None: eager)
        if self.use_graphs:
            m, c = MAX_GRAPH_SEQUENCES, model.config
            self.graph_pool = torch.cuda.graph_pool_handle()
            self.hidden_in = torch.zeros((m, c.hidden_size), dtype=model.dtype, device=model.device)  # [m, H]
            self.host_in = torch.zeros(3 * m + 1, dtype=torch.int64, pin_memory=True)  # ids | positions | slots | 0
            self.dev_in = torch.zeros(3 * m + 1, dtype=torch.int64, device=model.device)
            self.copied = torch.cuda.Event()
            self.seq_starts = torch.arange(m + 1, dtype=torch.int32, device=model.device)  # one row a sequence

    def _new_pool(self) -> KVPool:
        c = self.model.config
        return KVPool(num_layers=1, num_slots=POOL_START_SLOTS, max_length=c.max_position_embeddings,
                      num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.model.dtype,
                      device=self.model.device, block_size=POOL_BLOCK, num_blocks=POOL_START_BLOCKS)

    def acquire(self, max_length: int) -> tuple[int, CacheLength]:
        pool = self.pool
        if not 1 <= max_length <= pool.max_length:
            raise ValueError(f"MTP cache length {max_length} must lie in [1, {pool.max_length}]")
        needed = pool.blocks_for(max_length)
        if needed > pool.num_free_blocks or not pool.num_free:
            pool.grow(num_blocks=max(2 * pool.num_blocks, pool.num_blocks - pool.num_free_blocks + needed),
                      num_slots=2 * pool.num_slots if not pool.num_free else None)
            self.graphs.clear()  # (they hold the pool's old tensors)
        slot, length = pool.acquire(max_length)
        self.lengths[slot] = length
        return slot, length

    def release(self, slot: int) -> None:
        """Give a slot back. The last session out of a pool that grew shrinks it to its start
        size: a burst of long sessions does not keep its memory for the drafter's lifetime."""
        pool = self.pool
        pool.release(slot)
        del self.lengths[slot]
        if pool.num_free == pool.num_slots and (pool.num_blocks > POOL_START_BLOCKS or pool.num_slots > POOL_START_SLOTS):
            self.pool = self._new_pool()
            self.graphs.clear()  # (they hold the old pool's addresses)
            del pool
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()  # (the drafter often shares its GPU with a verifier)

    def run(self, items: list[MtpRows]) -> list[tuple[Tensor, Tensor]]:
        if (self.use_graphs and len(items) <= MAX_GRAPH_SEQUENCES
                and all(item.next_token_ids.shape[0] == 1 for item in items)):
            captured = self._step(items)
            if captured is not None:
                return captured
        results: list[tuple[Tensor, Tensor] | None] = [None] * len(items)
        group: list[int] = []
        for index, item in enumerate(items):
            rows = item.next_token_ids.shape[0]
            if rows > self.fused.max_rows:  # a long catch-up (a prompt): the reference modules
                results[index] = self._long_catch_up(item)
                continue
            if sum(items[i].next_token_ids.shape[0] for i in group) + rows > self.fused.max_rows:
                self._run_group(items, group, results)
                group = []
            group.append(index)
        if group:
            self._run_group(items, group, results)
        return results  # type: ignore[return-value]

    def _run_group(self, items: list[MtpRows], indices: list[int], results: list) -> None:
        device = self.model.device
        positions, slots, starts = [], [], [0]
        for slot, _, ids in (items[i] for i in indices):
            start = self.lengths[slot].reserve(ids.shape[0])
            positions.extend(range(start, start + ids.shape[0]))
            slots.extend([slot] * ids.shape[0])
            starts.append(starts[-1] + ids.shape[0])
        rows = Rows(
            positions=torch.tensor(positions, device=device), slots=torch.tensor(slots, device=device),
            seq_starts=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_slots=torch.tensor([items[i].slot for i in indices], device=device),
            max_rows_per_seq=max(items[i].next_token_ids.shape[0] for i in indices),
        )
        hidden = torch.cat([items[i].hidden.to(device) for i in indices])
        ids = torch.cat([items[i].next_token_ids.to(device) for i in indices])
        # logits of each item's last row only: its next draft reads no other (a catch-up's rows
        # would otherwise pay the lm_head, the layer's largest product, for nothing)
        last = None if starts[-1] == len(indices) else torch.tensor(starts[1:], device=device) - 1
        logits, out = self.fused.forward_mtp(hidden, ids, rows, self.pool.paged(),
                                             routing=draft_routing(self.routing, ids.shape[0], device), logit_rows=last)
        for k, (index, start, end) in enumerate(zip(indices, starts, starts[1:])):
            results[index] = (logits[start:end] if last is None else logits[k : k + 1], out[start:end])

    def _step(self, items: list[MtpRows]) -> list[tuple[Tensor, Tensor]] | None:
        """A chain step (one row a session) by its session count's graph; None where that count
        cannot be captured (it then runs eagerly, as before)."""
        n, m = len(items), MAX_GRAPH_SEQUENCES
        if self.graphs.get(n, False) is None:
            return None
        self.copied.synchronize()  # (the last step's copy has left the pinned buffer)
        values = self.host_in.numpy()
        for i, (slot, _, ids) in enumerate(items):
            values[m + i] = self.lengths[slot].reserve(1)
            values[2 * m + i] = slot
        self.host_in[:n].copy_(torch.cat([item.next_token_ids for item in items]))
        self.dev_in.copy_(self.host_in, non_blocking=True)
        self.copied.record()
        self.hidden_in[:n].copy_(torch.cat([item.hidden.to(self.model.device) for item in items]))
        captured = self.graphs.get(n)
        if captured is None:
            captured = self.graphs[n] = self._capture(n)
            if captured is None:
                for slot, _, _ in items:  # (the eager path reserves the rows again)
                    self.lengths[slot].truncate(self.lengths[slot].length - 1)
                return None
        graph, logits, out = captured
        graph.replay()
        # (copies: the outputs of a graph are rewritten by its next replay, and a step's last
        # logits stay in a session's state until its next chain)
        logits, out = logits.clone(), out.clone()
        return [(logits[i : i + 1], out[i : i + 1]) for i in range(n)]

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor] | None:
        """The graph of an n-session step over the inputs already in place: warmed up twice and
        captured, each run writing this step's KV rows with the same values."""
        m, device = MAX_GRAPH_SEQUENCES, self.model.device
        rows = Rows(positions=self.dev_in[m : m + n], slots=self.dev_in[2 * m : 2 * m + n],
                    seq_starts=self.seq_starts[: n + 1], seq_slots=self.dev_in[2 * m : 2 * m + n], max_rows_per_seq=1)
        kv = self.pool.paged()

        def body() -> tuple[Tensor, Tensor]:
            return self.fused.forward_mtp(self.hidden_in[:n], self.dev_in[:n], rows, kv)

        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # Triton compiles and the allocator warms up outside the graph
                    body()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                logits, out = body()
        except RuntimeError:  # (a kernel that cannot be captured: this count runs eagerly)
            torch.cuda.synchronize(device)
            return None
        return graph, logits, out

    def _long_catch_up(self, item: MtpRows) -> tuple[Tensor, Tensor]:
        """Rows beyond the fused path's max_rows through the reference modules, on a contiguous
        copy of the session's rows, written back to its blocks."""
        pool, slot, device = self.pool, item.slot, self.model.device
        length, rows = self.lengths[slot].length, item.next_token_ids.shape[0]
        cache = self.model.new_mtp_cache(length + rows)
        if length:
            keys, values = pool.read(slot, length)
            cache.keys[:, :length], cache.values[:, :length] = keys, values
        cache.length = length
        result = self.model.forward_mtp(item.hidden.to(device), item.next_token_ids.to(device), cache,
                                        routing=draft_routing(self.routing, rows, device))
        start = self.lengths[slot].reserve(rows)
        span = torch.arange(start, start + rows, device=device)
        blocks, offsets = paged_rows(pool.block_tables, torch.full_like(span, slot), span, pool.block_size)
        pool.keys[0, blocks, offsets] = cache.keys[0, start:]
        pool.values[0, blocks, offsets] = cache.values[0, start:]
        return result
