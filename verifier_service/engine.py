"""Model-side work of the verifier: prefill and verification rounds (runs on the model worker).

Invariant per session: the KV cache holds every committed token but the last (the head);
a round runs the window [head, d0..dk-1], verifies the drafts, and truncates the cache to
the rows that stay committed (head + accepted drafts).

Two forward paths share this flow. On CUDA (by default) a round is one replay of a captured
fused-kernel window (shared.model.graphs) over a slot of the paged KV pool, and the only host
synchronisation is reading the verdict's inputs: the window's own tokens (greedy ids, or
draws made on the device: plain rounds, exact mode), or its processed sparse rows
(probabilistic mode with drafts), plus the hidden rows for the drafter, copied in the same
stream. Elsewhere the
reference modules run the window eagerly on a per-request cache. Prefill chunks run eagerly
(long chunks are compute-bound; per-kernel host work is amortised): on CUDA the fused model's
prefill, with the chunks of several sessions in one forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from kernels.fused import cdiv
from kernels.sampling import SparseRows, process_logits
from kernels.speculative import Mode
from shared.model.families import build_fused, fused_wanted
from shared.model.graphs import WindowGraphs, WindowOutput
from shared.model.kv_cache import KVPool
from shared.model.moe import MoeBlock
from verifier_service.kv_memory import KVPlan, plan_kv
from verifier_service.requests import RequestSpec
from verifier_service.rounds import Ahead, RoundOutcome, RoundRequest, Session
from verifier_service.sampled_rounds import own_tokens, process_targets, round_verdicts
from verifier_service.window_sizing import RowCost, cut_chains


class Engine:
    def __init__(
        self,
        model,  # a loaded trunk of any family (shared.model.families)
        *,
        max_context: int,
        prefill_chunk: int,
        fused: str = "off",
        cuda_graphs: bool = True,
        pdl: bool = True,
        expert_prefetch: bool = False,
        max_sessions: int = 8,
        max_window: int = 17,
        max_batch_rows: int = 64,
        verify_window: int = 0,
        progress: Callable[[str], None] | None = None,
        draw_secret: bytes = b"",
        row_invariant: bool = True,
        window_sizing: bool = False,
        kv_block_size: int = 64,
        kv_cache_tokens: int = 0,
        kv_memory_fraction: float = 0.9,
    ) -> None:
        self.model = model
        self.window_sizing = window_sizing  # batches verify the draft prefixes that pay (window_sizing.py)
        # Exact mode needs each row's bits to be its one-row step's whatever shares its window
        # or batch (DESIGN §11). The fused path gives it in one forward on the GPU (its kernels)
        # and on the CPU (its torch ops' products row by row); the reference path (fused off)
        # runs an exact-mode window on the CPU as one-row steps.
        self.row_invariant = row_invariant
        self.draw_secret = draw_secret  # keys the accept/residual draws (verifier_service.audit)
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.stores = [layer.mlp.store for layer in model.layers if isinstance(layer.mlp, MoeBlock)]  # (both families)
        self.windows: WindowGraphs | None = None
        c = model.config
        bytes_per_token = KVPool.bytes_per_token(num_layers=model.num_kv_layers, num_kv_heads=c.num_key_value_heads,
                                                 head_dim=c.head_dim, dtype=model.dtype)
        fused_model = None
        batch_rows = max(max_window, min(max_batch_rows, max_sessions * max_window))
        if fused_wanted(model, fused, auto_on_cpu=True):
            # Built before the KV plan: its workspaces and the linear-attention states (a slot's
            # per session and the scratch slot's) come out of the memory the pool may take.
            fused_model = build_fused(model, max_rows=batch_rows, max_length=max_context, num_state_slots=max_sessions + 1,
                                      pdl=None if pdl else False, invariant=row_invariant or model.device.type == "cuda",
                                      expert_prefetch=expert_prefetch)
        # The reference path allocates each session's cache itself: the plan only counts.
        self.kv_plan: KVPlan = plan_kv(requested_tokens=kv_cache_tokens, memory_fraction=kv_memory_fraction,
                                       block_size=kv_block_size, bytes_per_token=bytes_per_token, device=model.device,
                                       max_sessions=max_sessions, max_context=max_context)
        if progress is not None:
            progress(self.kv_plan.describe())
            if fused_model is not None and fused_model.states is not None:
                progress(f"linear-attention states: {fused_model.states.nbytes / 2**30:.2f} GiB for "
                         f"{max_sessions} sessions and the verify windows' rows")
        if fused_model is not None:
            # A slot (block table) per session, and a scratch slot of one block for the padded
            # rows of batch graphs.
            pool = KVPool(num_layers=model.num_kv_layers, num_slots=max_sessions + 1, max_length=max_context,
                          num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=model.dtype,
                          device=model.device, block_size=kv_block_size, num_blocks=self.kv_plan.num_blocks + 1)
            scratch, _ = pool.acquire(1)
            self.windows = WindowGraphs(fused_model, pool, max_window, max_batch_rows=batch_rows, scratch_slot=scratch,
                                        verify_window=verify_window,
                                        use_graphs=cuda_graphs and model.device.type == "cuda")
            self.windows.capture(progress=None if progress is None else
                                 lambda what, s: progress(f"captured {what} in {s:.2f}s"))
            if self.windows.use_graphs or self.windows.segments is not None:  # (CUDA)
                self._warm_prefill(progress)
            # Results reach the host through two (pinned) slots, copied in the compute stream: the
            # window in hand, and (decode-ahead) the step enqueued behind it.
            pinned = model.device.type == "cuda"
            self.ring_ids = torch.zeros((2, batch_rows), dtype=torch.int64, pin_memory=pinned)
            self.ring_hidden = torch.zeros((2, batch_rows, c.hidden_size), dtype=model.dtype, pin_memory=pinned)
            self.ring_events = [torch.cuda.Event(), torch.cuda.Event()] if pinned else None
            self.ring_next = 0
            self.row_cost = RowCost(max_rows=batch_rows)  # ms of the batched forwards by their rows
        self.ahead: Ahead | None = None

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def path(self) -> str:
        if self.windows is None:
            return "reference"
        return "fused+graphs" if self.windows.use_graphs else "fused"

    def open(self, spec: RequestSpec) -> Session:
        """Allocate the session's cache and prefill the prompt but its last token (the head)."""
        session = self.begin(spec)
        try:
            while not self.prefill_step(session):
                pass
        except BaseException:
            self.close(session)
            raise
        return session

    def cache_length(self, spec: RequestSpec) -> int:
        """KV positions a request holds: its prompt, its completion and one window of drafts."""
        return min(self.max_context, len(spec.prompt_ids) + spec.max_new_tokens + spec.max_draft_tokens + 1)

    def kv_blocks(self, spec: RequestSpec) -> int:
        """KV blocks a request holds while it runs (what admission counts)."""
        return cdiv(self.cache_length(spec), self.kv_plan.block_size)

    def begin(self, spec: RequestSpec) -> Session:
        """Allocate the session's cache; its prompt is then prefilled by prefill_step calls."""
        length = self.cache_length(spec)
        slot = None
        if self.windows is not None:
            slot, cache = self.windows.pool.acquire(length)
            self.windows.reset_state(slot)
        else:
            cache = self.model.new_cache(length)
        return Session(spec=spec, cache=cache, token_ids=list(spec.prompt_ids), slot=slot)

    def prefill_step(self, session: Session) -> bool:
        """Prefill the next chunk (at most prefill_chunk tokens) of the prompt; True once it is all in."""
        self.prefill([(session, min(self.prefill_chunk, session.prefill_left))])
        return session.prefill_left <= 0

    def prefill(self, chunks: list[tuple[Session, int]]) -> None:
        """Prefill the next `count` prompt tokens of each session; on the fused path all chunks run
        as one forward (their GEMMs share every weight read). The server's PrefillBatcher plans
        the chunks under a token budget, a job each, so rounds of decoding sessions run between."""
        chunks = [(session, count) for session, count in chunks if count > 0]
        if not chunks:
            return
        token_ids, spans = [], []
        for session, count in chunks:
            if count > session.prefill_left:
                raise ValueError(f"a chunk of {count} tokens exceeds the {session.prefill_left} left to prefill")
            start = session.cache.length
            token_ids.extend(session.spec.prompt_ids[start : start + count])
            spans.append((start, count, session.slot))
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.model.device)
        if self.windows is not None:
            for session, count in chunks:
                session.cache.reserve(count)
            hidden = self.windows.fused.prefill(ids, spans, self.windows.kv)
        else:
            parts, row = [], 0
            for session, count in chunks:
                parts.append(self.model.prefill(ids[row : row + count], session.cache))
                row += count
            hidden = torch.cat(parts)
        for (session, _), rows in zip(chunks, hidden.to("cpu", torch.bfloat16).split([c for _, c in chunks])):
            session.hidden_rows.append(rows)

    def _warm_prefill(self, progress: Callable[[str], None] | None) -> None:
        """Prefill a short and a full chunk into a slot taken for it, the second after a prefix,
        so that prefill's kernels compile and its libraries load at start rather than on the
        first requests (on the H200 the first 4,096-token prompt of a fresh service waited 1.1 s
        for its first token, later ones 0.13 s; this warm-up's effect is not measured yet)."""
        started = time.perf_counter()
        pool = self.windows.pool
        length = min(self.max_context, 16 + self.prefill_chunk, pool.num_free_blocks * pool.block_size)
        slot, _ = pool.acquire(length)
        try:
            for start, count in ((0, min(16, length)), (16, length - 16)):
                if count < 1:
                    continue
                ids = torch.zeros(count, dtype=torch.int64, device=self.model.device)
                self.windows.fused.prefill(ids, [(start, count, slot)], self.windows.kv)
        finally:
            pool.release(slot)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        if progress is not None:
            progress(f"warmed up prefill in {time.perf_counter() - started:.2f}s")

    def close(self, session: Session) -> None:
        """Give the session's KV slot back (idempotent)."""
        # (called off the worker thread: read `ahead` once; losing another session's step ahead
        # to a race only costs that session one plain launch)
        ahead = self.ahead
        if ahead is not None and any(s is session for s in ahead.sessions):
            self.ahead = None  # its step writes beyond the committed rows: harmless, and never read
        if session.slot is not None and self.windows is not None:
            self.windows.pool.release(session.slot)
            session.slot = None

    @property
    def free_slots(self) -> int | None:
        return self.windows.pool.num_free if self.windows is not None else None

    @property
    def free_kv_blocks(self) -> int | None:
        """Blocks of the pool no session holds (the scratch slot's excepted); None off the fused path."""
        return self.windows.pool.num_free_blocks if self.windows is not None else None

    def _forward(self, session: Session, window: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(logits [T, vocab], hidden [T, H], greedy ids [T]) of the window, on the device."""
        if self.windows is not None:
            start = session.cache.reserve(len(window))
            out = self.windows.run(session.slot, window, start)
            return out.logits, out.hidden, out.greedy_ids
        ids = torch.tensor(window, dtype=torch.int64, device=self.model.device)
        exact = session.spec.mode is Mode.EXACT
        logits, hidden = self.model(ids, session.cache, row_invariant=self.row_invariant and exact)
        return logits, hidden, logits.argmax(dim=-1)

    def _to_host(self, hidden: Tensor, greedy_ids: Tensor) -> tuple[Tensor, list[int]]:
        """The window's hidden rows and greedy ids on the host: one synchronisation."""
        if self.windows is None:
            return hidden.to("cpu"), greedy_ids.tolist()
        return self._ring_read(self._ring_copy(hidden, greedy_ids), hidden.shape[0])

    def run_round(self, session: Session, drafts: list[int], q_rows: SparseRows | None, *,
                  decode_ahead: bool = False) -> RoundOutcome:
        """Verify `drafts` (or decode one token). decode_ahead: the caller expects another plain
        round of this session next, so its step is enqueued before this round's result is
        read (the GPU computes it while the host streams this one); any other round drops it."""
        spec = session.spec
        if not drafts and self.windows is not None:
            return self._plain_round(session, decode_ahead)
        self.ahead = None
        started = time.perf_counter()
        misses = self.slot_misses()
        window = [session.token_ids[-1], *drafts]
        logits, hidden, greedy_ids = self._forward(session, window)
        # on the device; row j: the window's own token (exact mode), or p, at the position of row j
        drawn = own_tokens([session], [len(window)], logits, greedy_ids, [len(session.token_ids)])
        target = None if spec.sampling.greedy or drawn is not None else process_logits(logits, spec.sampling)
        host_hidden, ids = self._to_host(hidden, greedy_ids if drawn is None else drawn)
        target = None if target is None else target.to("cpu")
        forwarded = time.perf_counter()
        verdict = round_verdicts([(session, drafts, q_rows, ids, target)], self.draw_secret)[0]
        return self._commit(session, drafts, host_hidden, verdict, forwarded - started,
                            time.perf_counter() - forwarded, self.slot_misses() - misses, first_row=0)

    def _commit(self, session: Session, drafts: list[int], host_hidden: Tensor, verdict: tuple[list[int], int],
                forward_s: float, verify_s: float, slot_misses: int, first_row: int = 0) -> RoundOutcome:
        """Commit a round's verdict (emitted tokens, accepted drafts) and its rows to the session;
        first_row: where its window began in the step's rows (fused path: its kept states)."""
        emitted, accepted = verdict
        base = len(session.token_ids)  # position of the first token this round decides
        session.cache.truncate(base + accepted)  # keep the head's and accepted drafts' rows
        if self.windows is not None:  # the linear layers' state after the last row kept
            self.windows.settle(session.slot, first_row + accepted if accepted < len(drafts) else None)
        rows = host_hidden[: accepted + 1].to(torch.bfloat16, copy=True)
        session.hidden_rows.append(rows)
        session.token_ids.extend(emitted)
        if drafts:
            session.acceptance.record(len(drafts), accepted)
        return RoundOutcome(emitted, accepted, rows, forward_s * 1e3, verify_s * 1e3, slot_misses, len(drafts))

    def run_rounds(self, rounds: list[RoundRequest]) -> list[RoundOutcome]:
        """One round of each session, as one batched forward where the fused path runs (else one
        after another). A session's outcome does not depend on the others': each row is computed
        the same way in any batch, and the draws are keyed by the session's seed and positions."""
        if len({id(r.session) for r in rounds}) != len(rounds):
            raise ValueError("a batch holds one round per session")
        if len(rounds) == 1 or self.windows is None:
            alone = len(rounds) == 1
            return [self.run_round(r.session, r.drafts, r.q_rows, decode_ahead=alone and r.decode_ahead) for r in rounds]
        if all(not r.drafts for r in rounds) and len(rounds) <= self.windows.max_batch_rows:
            return self._decode_batch(rounds)
        self.ahead = None
        if self.window_sizing and self.row_cost.known and any(r.drafts for r in rounds):
            rounds = cut_chains(rounds, self.row_cost)
        outcomes: list[RoundOutcome] = []
        group: list[RoundRequest] = []
        for r in rounds:  # forwards of at most max_batch_rows rows
            if group and sum(len(g.drafts) + 1 for g in group) + len(r.drafts) + 1 > self.windows.max_batch_rows:
                outcomes.extend(self._batched_rounds(group))
                group = []
            group.append(r)
        return outcomes + self._batched_rounds(group)

    def _batched_rounds(self, rounds: list[RoundRequest]) -> list[RoundOutcome]:
        started = time.perf_counter()
        windows = []
        for r in rounds:
            window = [r.session.token_ids[-1], *r.drafts]
            windows.append((r.session.slot, window, r.session.cache.reserve(len(window))))
        out = self.windows.run_batch(windows)
        sessions, window_rows = [r.session for r in rounds], [len(w) for _, w, _ in windows]
        num_rows = sum(window_rows)
        drawn = own_tokens(sessions, window_rows, out.logits, out.greedy_ids, [len(s.token_ids) for s in sessions])
        processed = process_targets(sessions, window_rows, out.logits)  # (probabilistic windows with drafts)
        host_hidden, ids = self._to_host(out.hidden[:num_rows], (out.greedy_ids if drawn is None else drawn)[:num_rows])
        targets: list[SparseRows | None] = [None] * len(rounds)  # p rows on the host; greedy: None
        for rows, parts in processed:
            rows = rows.to("cpu")  # one copy per sampling group
            for i, span in parts:
                targets[i] = rows[span]
        forward_s = time.perf_counter() - started
        if self.window_sizing and len(rounds) > 1:  # (one session's window costs less: not a batch)
            self.row_cost.record(num_rows, forward_s * 1e3)
        spans, row = [], 0
        for _, window, _ in windows:
            spans.append(slice(row, row + len(window)))
            row += len(window)
        verdicts = round_verdicts([(r.session, r.drafts, r.q_rows, ids[span], target)
                                   for r, span, target in zip(rounds, spans, targets)], self.draw_secret)
        verify_s = time.perf_counter() - started - forward_s
        return [self._commit(r.session, r.drafts, host_hidden[span], verdict, forward_s, verify_s, 0,
                             first_row=span.start)
                for r, span, verdict in zip(rounds, spans, verdicts)]

    def _decode_batch(self, rounds: list[RoundRequest]) -> list[RoundOutcome]:
        """One-token rounds of several sessions: one decode batch, with decode-ahead when every
        session asks for it (the next batch step is enqueued, fed on the device by this one's
        tokens — greedy ids or draws —, before this one is read; the next call uses it if it is
        exactly the same sessions, in any order)."""
        started = time.perf_counter()
        sessions = [r.session for r in rounds]
        ahead, self.ahead = self.ahead, None
        order = ahead.matches(sessions) if ahead is not None and len(ahead.sessions) > 1 else None
        positions = [s.cache.reserve(1) for s in sessions]
        fresh = order is None
        if not fresh:  # this step is already computed (or on its way)
            ring, batch_sessions, batch_positions = ahead.ring, ahead.sessions, ahead.positions
        else:
            out = self.windows.run_batch([(s.slot, s.token_ids[-1:], p) for s, p in zip(sessions, positions)])
            ring = self._ring_copy(out.hidden[: len(rounds)], self._next_tokens(sessions, out, [p + 1 for p in positions]))
            order, batch_sessions, batch_positions = list(range(len(rounds))), sessions, positions
        if all(r.decode_ahead for r in rounds) and all(s.cache.length < s.cache.max_length for s in sessions):
            out = self.windows.run_batch_chained()
            self.ahead = Ahead(list(batch_sessions), [p + 1 for p in batch_positions],
                               self._ring_copy(out.hidden[: len(rounds)],
                                               self._next_tokens(batch_sessions, out, [p + 2 for p in batch_positions])))
        host_hidden, ids = self._ring_read(ring, len(rounds))
        forward_s = time.perf_counter() - started
        if self.window_sizing and fresh:  # (the read waits for this step only: the chained one is behind it)
            self.row_cost.record(len(rounds), forward_s * 1e3)
        return [self._commit(r.session, [], host_hidden[row : row + 1], ([ids[row]], 0), forward_s, 0.0, 0)
                for r, row in zip(rounds, order)]

    def _ring_copy(self, hidden: Tensor, greedy_ids: Tensor) -> int:
        """Enqueue the copy of a window's hidden rows [T, H] and greedy ids [T] to the next host
        slot; returns the slot."""
        ring = self.ring_next
        self.ring_next ^= 1
        num_rows = hidden.shape[0]
        self.ring_ids[ring, :num_rows].copy_(greedy_ids, non_blocking=True)
        self.ring_hidden[ring, :num_rows].copy_(hidden, non_blocking=True)
        if self.ring_events is not None:
            self.ring_events[ring].record()
        return ring

    def _ring_read(self, ring: int, num_rows: int) -> tuple[Tensor, list[int]]:
        """Wait for a slot's copy; its hidden rows (a view: copy before the slot is reused) and ids."""
        if self.ring_events is not None:
            self.ring_events[ring].synchronize()
        return self.ring_hidden[ring, :num_rows], self.ring_ids[ring, :num_rows].tolist()

    def _plain_round(self, session: Session, decode_ahead: bool) -> RoundOutcome:
        """One token on the captured 1-row step, with decode-ahead (see run_round); a sampled
        request's token is drawn on the device and fed to the step ahead like a greedy one."""
        started = time.perf_counter()
        start = session.cache.reserve(1)
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.sessions == [session] and ahead.positions == [start]:
            ring = ahead.ring  # enqueued during the last round
        else:
            out = self.windows.run(session.slot, session.token_ids[-1:], start)
            ring = self._ring_copy(out.hidden, self._next_tokens([session], out, [start + 1]))
        if decode_ahead and session.cache.length < session.cache.max_length:
            out = self.windows.run_chained()
            self.ahead = Ahead([session], [start + 1], self._ring_copy(out.hidden, self._next_tokens([session], out, [start + 2])))
        hidden, ids = self._ring_read(ring, 1)
        token = ids[0]
        rows = hidden.to(torch.bfloat16, copy=True)
        forwarded = time.perf_counter()
        session.hidden_rows.append(rows)
        session.token_ids.append(token)
        self.windows.settle(session.slot)
        return RoundOutcome([token], 0, rows, (forwarded - started) * 1e3, 0.0, 0)

    def _next_tokens(self, sessions: list[Session], out: WindowOutput, positions: list[int]) -> Tensor:
        """[n] on the device: the token each session's row of a one-row-per-session step decides
        (greedy ids, or draws: sampled_rounds.own_tokens), fed to the step that may be
        enqueued next (run_chained / run_batch_chained)."""
        token_ids = own_tokens(sessions, [1] * len(sessions), out.logits, out.greedy_ids, positions)
        if token_ids is None:
            return out.greedy_ids[: len(sessions)]
        if len(sessions) == 1:
            self.windows.feed_next(token_ids)
        else:
            self.windows.feed_next_batch(token_ids)
        return token_ids

    def slot_misses(self) -> int:
        return sum(store.counters.misses for store in self.stores)

    def slot_hit_rate(self) -> float:
        hits = sum(store.counters.hits for store in self.stores)
        misses = self.slot_misses()
        return hits / (hits + misses) if hits + misses else 1.0
