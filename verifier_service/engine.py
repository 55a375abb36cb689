"""Model-side work of the verifier: prefill and verification rounds (runs on the model worker).

Invariant per session: the cache holds every committed token but the last (the head); a round
runs the window [head, d0..dk-1], verifies the drafts, and keeps the rows that stay committed
(head + accepted drafts).

The engine steps the model through one runner (shared.model.runner): the fused runner over the
paged KV pool (by default; CUDA graphs on CUDA) or the reference modules' (`fused="off"`). A
round of one session is a batch of one: every round goes through `run_rounds`, decode rounds
as one decode step (with the step after it enqueued ahead where every session asks for it),
verify rounds as one step of their windows. The only host synchronisation of a round is reading
the verdict's inputs: the windows' own tokens (greedy ids, or draws made on the device: plain
rounds, exact mode), or their processed sparse rows (probabilistic mode with drafts), plus the
hidden rows for the drafter, copied in the same stream. Prefill chunks run eagerly (long chunks
are compute-bound; per-kernel host work is amortised), the chunks of several sessions in one
forward on the fused path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from kernels.fused import cdiv
from kernels.sampling import SparseRows
from shared.model.families import build_fused, fused_wanted
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool
from shared.model.moe import MoeBlock
from shared.model.parallel.group import ModelGroup
from shared.model.parallel.lockstep import LeaderRunner
from shared.model.runner import ReferenceRunner, Runner, Window, WindowOutput
from verifier_service.kv_memory import KVPlan, plan_kv
from verifier_service.logprobs import window_logprobs
from verifier_service.requests import RequestSpec
from verifier_service.rounds import Ahead, RoundOutcome, RoundRequest, Session
from verifier_service.sampled_rounds import own_tokens, process_targets, round_verdicts


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
        kv_block_size: int = 64,
        kv_cache_tokens: int = 0,
        kv_memory_fraction: float = 0.9,
        group: ModelGroup | None = None,  # the model is this rank's share of a split model (DESIGN §13)
    ) -> None:
        self.model = model
        self.draw_secret = draw_secret  # keys the accept/residual draws (verifier_service.audit)
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.stores = [layer.mlp.store for layer in model.layers if isinstance(layer.mlp, MoeBlock)]  # (both families)
        self.offloaded_stores = [store for store in self.stores if not store.all_resident]  # (only they miss)
        c = model.config
        bytes_per_token = KVPool.bytes_per_token(num_layers=model.num_kv_layers, num_kv_heads=c.num_key_value_heads,
                                                 head_dim=c.head_dim, dtype=model.dtype)
        fused_model = None
        batch_rows = max(max_window, min(max_batch_rows, max_sessions * max_window))
        # Exact mode needs each row's bits to be its one-row step's whatever shares its window
        # or batch (DESIGN §11). The fused path gives it in one forward on the GPU (its kernels)
        # and on the CPU (its torch ops' products row by row); the reference path (fused off)
        # runs windows on the CPU as one-row steps.
        if group is not None and not fused_wanted(model, fused):
            raise ValueError("a model split over processes (--parallel) runs the fused path only (--fused auto or on)")
        if fused_wanted(model, fused):
            # Built before the KV plan: its workspaces and the linear-attention states (a slot's
            # per session and the scratch slot's) come out of the memory the pool may take.
            fused_model = build_fused(model, max_rows=batch_rows, max_length=max_context, num_state_slots=max_sessions + 1,
                                      pdl=None if pdl else False, invariant=row_invariant or model.device.type == "cuda",
                                      expert_prefetch=expert_prefetch, group=group)
            if model.device.type == "cuda":
                # Building it may re-lay weights out: what the old layouts held goes back to the
                # device before the KV plan reads its free memory (and for a drafter beside it).
                torch.cuda.empty_cache()
        # The reference path allocates each session's cache itself: the plan only counts.
        self.kv_plan: KVPlan = plan_kv(requested_tokens=kv_cache_tokens, memory_fraction=kv_memory_fraction,
                                       block_size=kv_block_size, bytes_per_token=bytes_per_token, device=model.device,
                                       max_sessions=max_sessions, max_context=max_context)
        if group is not None:  # every rank's pool the same size: the smallest any rank's memory allows
            num_tokens = group.agree_min(self.kv_plan.num_blocks) * self.kv_plan.block_size
            if num_tokens != self.kv_plan.num_tokens:
                self.kv_plan = replace(self.kv_plan, num_tokens=num_tokens, source=f"{self.kv_plan.source}, "
                                       "the smallest of the ranks'")
        if progress is not None:
            progress(self.kv_plan.describe())
            if fused_model is not None and fused_model.states is not None:
                progress(f"linear-attention states: {fused_model.states.nbytes / 2**30:.2f} GiB for "
                         f"{max_sessions} sessions and the verify windows' rows")
        self.runner: Runner
        if fused_model is None:
            self.runner = ReferenceRunner(model, max_rows=max_window, max_batch_rows=batch_rows,
                                          row_invariant=row_invariant)
        else:
            # A slot (block table) per session, and a scratch slot of one block for the padded
            # rows of batch graphs.
            pool = KVPool(num_layers=model.num_kv_layers, num_slots=max_sessions + 1, max_length=max_context,
                          num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=model.dtype,
                          device=model.device, block_size=kv_block_size, num_blocks=self.kv_plan.num_blocks + 1)
            scratch, _ = pool.acquire(1)
            runner = FusedRunner(fused_model, pool, max_window, max_batch_rows=batch_rows, scratch_slot=scratch,
                                 verify_window=verify_window, use_graphs=cuda_graphs and model.device.type == "cuda")
            self.runner = runner
            runner.capture(progress=None if progress is None else lambda what, s: progress(f"captured {what} in {s:.2f}s"))
            if runner.use_graphs or runner.segments is not None:  # (CUDA)
                self._warm_prefill(progress)
            if group is not None and group.rank == 0:  # from now on every call reaches the followers too
                self.runner = LeaderRunner(runner, group)
        # On a GPU results reach the host through two pinned slots, copied in the compute stream:
        # the step in hand, and (decode-ahead) the step enqueued behind it. On the CPU a step's rows
        # are host rows already, which only a later `run` writes over (a step ahead is a fresh
        # tensor): they are read where they are, and there is no ring.
        self.ring_ids = self.ring_hidden = self.ring_events = None
        if model.device.type == "cuda":
            self.ring_ids = torch.zeros((2, batch_rows), dtype=torch.int64, pin_memory=True)
            self.ring_hidden = torch.zeros((2, batch_rows, c.hidden_size), dtype=model.dtype, pin_memory=True)
            self.ring_events = [torch.cuda.Event(), torch.cuda.Event()]
        self.ring_next = 0
        self.ahead: Ahead | None = None

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def path(self) -> str:
        return self.runner.path

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
        slot, cache = self.runner.acquire(self.cache_length(spec))
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
        windows = []
        for session, count in chunks:
            if count > session.prefill_left:
                raise ValueError(f"a chunk of {count} tokens exceeds the {session.prefill_left} left to prefill")
            start = session.cache.length
            windows.append(Window(session.slot, session.spec.prompt_ids[start : start + count], start))
        hidden = self.runner.prefill(windows)
        for session, count in chunks:
            session.cache.reserve(count)
        for (session, _), rows in zip(chunks, hidden.to("cpu", torch.bfloat16).split([c for _, c in chunks])):
            session.hidden_rows.append(rows)

    def _warm_prefill(self, progress: Callable[[str], None] | None) -> None:
        """Prefill a short and a full chunk into a slot taken for it, the second after a prefix,
        so that prefill's kernels compile and its libraries load at start rather than on the
        first requests (on the H200 the first 4,096-token prompt of a fresh service waited 1.1 s
        for its first token, later ones 0.13 s; this warm-up's effect is not measured yet)."""
        started = time.perf_counter()
        runner = self.runner
        length = min(self.max_context, 16 + self.prefill_chunk, runner.num_free_blocks * runner.pool.block_size)
        slot, _ = runner.acquire(length)
        try:
            for start, count in ((0, min(16, length)), (16, length - 16)):
                if count >= 1:
                    runner.prefill([Window(slot, [0] * count, start)])
        finally:
            runner.release(slot)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        if progress is not None:
            progress(f"warmed up prefill in {time.perf_counter() - started:.2f}s")

    def shutdown(self) -> None:
        """A model split over processes: the followers leave their loops (rank 0, at the end)."""
        if isinstance(self.runner, LeaderRunner):
            self.runner.close()

    def close(self, session: Session) -> None:
        """Give the session's slot back (idempotent)."""
        # (called off the worker thread: read `ahead` once; losing another session's step ahead
        # to a race only costs that session one plain launch)
        ahead = self.ahead
        if ahead is not None and any(s is session for s in ahead.sessions):
            self.ahead = None  # its step writes beyond the committed rows: harmless, and never read
        if session.slot is not None:
            self.runner.release(session.slot)
            session.slot = None

    def computed_ahead(self) -> list[Session]:
        """The sessions whose next plain round is already computed (or on its way): the decode
        step enqueued ahead, used if the next step is exactly theirs."""
        ahead = self.ahead
        return ahead.sessions if ahead is not None else []

    @property
    def free_slots(self) -> int | None:
        return self.runner.num_free_slots

    @property
    def free_kv_blocks(self) -> int | None:
        """Blocks of the pool no session holds (the scratch slot's excepted); None off the fused path."""
        return self.runner.num_free_blocks

    def run_round(self, session: Session, drafts: list[int], q_rows: SparseRows | None, *,
                  decode_ahead: bool = False) -> RoundOutcome:
        """One session's round (run_rounds with a batch of one). decode_ahead: the caller expects
        another plain round of this session next, so its step is enqueued before this round's
        result is read (the GPU computes it while the host streams this one); any other round
        drops it."""
        return self.run_rounds([RoundRequest(session, drafts, q_rows, decode_ahead)])[0]

    def run_rounds(self, rounds: list[RoundRequest]) -> list[RoundOutcome]:
        """One round of each session as one step of the runner (verify rounds: steps of at most
        max_batch_rows rows). A session's outcome does not depend on the others': each row is
        computed the same way in any batch, and the draws are keyed by the session's seed and
        positions."""
        if len({id(r.session) for r in rounds}) != len(rounds):
            raise ValueError("a batch holds one round per session")
        if all(not r.drafts for r in rounds) and len(rounds) <= self.runner.max_batch_rows:
            return self._decode_step(rounds)
        self.ahead = None
        outcomes: list[RoundOutcome] = []
        group: list[RoundRequest] = []
        for r in rounds:  # steps of at most max_batch_rows rows
            if group and sum(len(g.drafts) + 1 for g in group) + len(r.drafts) + 1 > self.runner.max_batch_rows:
                outcomes.extend(self._verify_step(group))
                group = []
            group.append(r)
        return outcomes + self._verify_step(group)

    def _verify_step(self, rounds: list[RoundRequest]) -> list[RoundOutcome]:
        """Verify rounds (and any plain ones among them) as one step."""
        started = time.perf_counter()
        misses = self.slot_misses()
        windows, sessions, window_rows, spans, decided = [], [], [], [], []
        row = 0
        for r in rounds:
            session, size = r.session, len(r.drafts) + 1
            decided.append(len(session.token_ids))  # the position of the first token the round decides
            windows.append(Window(session.slot, [session.token_ids[-1], *r.drafts], session.cache.reserve(size)))
            sessions.append(session)
            window_rows.append(size)
            spans.append(slice(row, row + size))
            row += size
        num_rows = row
        out = self.runner.run(windows)
        drawn = own_tokens(sessions, window_rows, out.logits, out.greedy_ids, decided, [r.drafts for r in rounds])
        processed = process_targets(sessions, window_rows, out.logits)  # (probabilistic windows with drafts)
        host_hidden, ids = self._ring_read(self._ring_copy(
            _head(out.hidden, num_rows), _head(out.greedy_ids if drawn is None else drawn, num_rows)), num_rows)
        targets: list[SparseRows | None] = [None] * len(rounds)  # p rows on the host; greedy: None
        for rows, parts in processed:
            rows = rows.to("cpu")  # one copy per sampling group
            for i, span in parts:
                targets[i] = rows[span]
        forward_s = time.perf_counter() - started
        alone = len(rounds) == 1  # (no slicing on the one-request path: each slice costs the host a few µs)
        verdicts = round_verdicts([(r.session, r.drafts, r.q_rows, ids if alone else ids[span], target)
                                   for r, span, target in zip(rounds, spans, targets)], self.draw_secret)
        verify_s = time.perf_counter() - started - forward_s
        misses = self.slot_misses() - misses
        return [self._commit(r.session, r.drafts, host_hidden if alone else host_hidden[span], verdict, forward_s,
                             verify_s, misses, first_row=span.start,
                             logits=out.logits[span] if r.session.spec.logprobs is not None else None)
                for r, span, verdict in zip(rounds, spans, verdicts)]

    def _commit(self, session: Session, drafts: list[int], host_hidden: Tensor, verdict: tuple[list[int], int],
                forward_s: float, verify_s: float, slot_misses: int, first_row: int = 0,
                logits: Tensor | None = None, kept: bool = False) -> RoundOutcome:
        """Commit a round's verdict (emitted tokens, accepted drafts) and its rows to the session;
        first_row: where its window began in the step's rows (the runner keeps that row's state
        when the window rolls back); logits: the window's rows [size, vocab] (still on the
        device), read for the emitted tokens' log-probabilities where the request asks; kept:
        host_hidden is already a bfloat16 copy of its own (else its rows are copied)."""
        emitted, accepted = verdict
        spec = session.spec
        logprobs = None
        if spec.logprobs is not None:
            if logits is None:
                raise RuntimeError("a round of a request asking for logprobs was computed ahead, without its logits")
            logprobs = window_logprobs(logits, emitted, spec.logprobs, spec.sampling)
        base = len(session.token_ids)  # position of the first token this round decides
        session.cache.truncate(base + accepted)  # keep the head's and accepted drafts' rows
        self.runner.settle(session.slot, first_row + accepted if accepted < len(drafts) else None)
        rows = _head(host_hidden, accepted + 1)
        if not kept:
            rows = rows.to(torch.bfloat16, copy=True)
        session.hidden_rows.append(rows)
        session.token_ids.extend(emitted)
        return RoundOutcome(emitted, accepted, rows, forward_s * 1e3, verify_s * 1e3, slot_misses, len(drafts),
                            logprobs=logprobs)

    def _decode_step(self, rounds: list[RoundRequest]) -> list[RoundOutcome]:
        """One-token rounds of one or more sessions: one decode step, with decode-ahead when every
        session asks for it (the next step is enqueued, fed on the device by this one's tokens —
        greedy ids or draws —, before this one is read; the next call uses it if it is exactly
        the same sessions, in any order)."""
        started = time.perf_counter()
        misses = self.slot_misses()
        sessions = [r.session for r in rounds]
        ahead, self.ahead = self.ahead, None
        order = ahead.matches(sessions) if ahead is not None else None
        positions = [s.cache.reserve(1) for s in sessions]
        fresh = order is None
        if not fresh:  # this step is already computed (or on its way)
            ring, step_sessions, step_positions = ahead.ring, ahead.sessions, ahead.positions
        else:
            out = self.runner.run([Window(s.slot, s.token_ids[-1:], p) for s, p in zip(sessions, positions)])
            ring = self._ring_copy(_head(out.hidden, len(rounds)), self._next_tokens(sessions, out, [p + 1 for p in positions]))
            order, step_sessions, step_positions = list(range(len(rounds))), sessions, positions
        logits = None if not fresh else out.logits  # (a step enqueued ahead kept none)
        if (self.runner.can_run_ahead and all(r.decode_ahead and r.session.spec.logprobs is None for r in rounds)
                and all(s.cache.length < s.cache.max_length for s in sessions)):
            out = self.runner.run_next()
            self.ahead = Ahead(list(step_sessions), [p + 1 for p in step_positions],
                               self._ring_copy(_head(out.hidden, len(rounds)),
                                               self._next_tokens(step_sessions, out, [p + 2 for p in step_positions])))
        host_hidden, ids = self._ring_read(ring, len(rounds))
        # one copy of the step's rows, each session keeping its own row of it (a view: the rows
        # live while any of the step's sessions keeps its row)
        kept = host_hidden.to(torch.bfloat16, copy=True)
        forward_s = time.perf_counter() - started
        misses = self.slot_misses() - misses
        if len(rounds) == 1:  # (no slicing on the one-request path: each slice costs the host a few µs)
            return [self._commit(rounds[0].session, [], kept, ([ids[0]], 0), forward_s, 0.0, misses,
                                 logits=logits, kept=True)]
        return [self._commit(r.session, [], kept[row : row + 1], ([ids[row]], 0), forward_s, 0.0, misses,
                             logits=logits[row : row + 1] if logits is not None and r.session.spec.logprobs is not None else None,
                             kept=True)
                for r, row in zip(rounds, order)]

    def _ring_copy(self, hidden: Tensor, greedy_ids: Tensor) -> int | tuple[Tensor, Tensor]:
        """Enqueue the copy of a step's hidden rows [T, H] and greedy ids [T] to the next host
        slot; returns the slot (on the CPU: the rows themselves)."""
        if self.ring_events is None:
            return hidden, greedy_ids
        ring = self.ring_next
        self.ring_next ^= 1
        num_rows = hidden.shape[0]
        self.ring_ids[ring, :num_rows].copy_(greedy_ids, non_blocking=True)
        self.ring_hidden[ring, :num_rows].copy_(hidden, non_blocking=True)
        self.ring_events[ring].record()
        return ring

    def _ring_read(self, ring: int | tuple[Tensor, Tensor], num_rows: int) -> tuple[Tensor, list[int]]:
        """Wait for a slot's copy; its hidden rows (a view: copy before the slot is reused) and ids."""
        if isinstance(ring, tuple):
            hidden, greedy_ids = ring
            return _head(hidden, num_rows), _head(greedy_ids, num_rows).tolist()
        self.ring_events[ring].synchronize()
        return self.ring_hidden[ring, :num_rows], self.ring_ids[ring, :num_rows].tolist()

    def _next_tokens(self, sessions: list[Session], out: WindowOutput, positions: list[int]) -> Tensor:
        """[n] on the device: the token each session's row of a one-row-per-session step decides
        (greedy ids, or draws: sampled_rounds.own_tokens), fed to the step that may be enqueued
        next (run_next)."""
        token_ids = own_tokens(sessions, [1] * len(sessions), out.logits, out.greedy_ids, positions)
        if token_ids is None:
            return _head(out.greedy_ids, len(sessions))
        if self.runner.can_run_ahead:
            self.runner.feed_next(token_ids)
        return token_ids

    def slot_misses(self) -> int:
        return sum(store.counters.misses for store in self.offloaded_stores)

    def slot_hit_rate(self) -> float:
        if not self.offloaded_stores:  # (every expert resident: no miss; asked once a round)
            return 1.0
        hits = sum(store.counters.hits for store in self.stores)
        misses = self.slot_misses()
        return hits / (hits + misses) if hits + misses else 1.0


def _head(rows: Tensor, count: int) -> Tensor:
    """The first `count` rows (the tensor itself when that is all of it)."""
    return rows if rows.shape[0] == count else rows[:count]
