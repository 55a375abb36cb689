"""The drafting logic of one drafter: sessions' commits, plans and chains (DESIGN §6-§9).

Threads (the thin hop, issue 13): everything but model work runs on the service's event
loop — a commit's bookkeeping, the suffix lookups, the planner, the chain message, the
chain drafted ahead — so a round that drafts by suffix lookup never leaves the loop. Model
work (an open's MTP catch-up, MTP chains, the deferred MTP rows of commits) runs on the
model worker: `open`, and `mtp_batch` for the MTP work of every session at once
(drafter_service.batcher), `close` when a stream ends. A session is only ever touched by its
own stream's handler, which awaits each piece of its work before the next step, and the
global index is read and written on the loop only; the planner has its own lock.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Iterator

from drafter_service.planner import Estimates, Plan, Planner, choose
from drafter_service.proposers import Proposal
from drafter_service.proposers.mtp import DraftJob, MTPProposer
from drafter_service.proposers.global_index import GlobalIndex, best_match, with_prompt_end
from drafter_service.proposers.suffix import COUNT_CHUNK, SuffixIndex, SuffixMatch
from drafter_service.session import DraftSession, session_params
from drafter_service.settings import DrafterSettings
from kernels.speculative import Mode
from shared.model import RoutingOptions
from shared.model.experts import ExpertStore
from shared.model.families import MOCE, build_fused, family_of, fused_wanted
from shared.protocol import common_pb2, decode_hidden, drafter_pb2

SOURCES = {"MTP": common_pb2.DRAFT_SOURCE_MTP, "SUFFIX": common_pb2.DRAFT_SOURCE_SUFFIX, "NONE": common_pb2.DRAFT_SOURCE_NONE}
MAX_DRAFTS = 16
MAX_FUSED_MTP_ROWS = 64  # MTP catch-ups longer than this (a prompt) run the reference modules
LOOP_COUNT = 256  # suffix tokens counted on the event loop at a time (~3 ms on a slow CPU); more: a worker job
# Committed rows a session's MTP layer may owe while it drafts from its suffix index (Drafter.
# mtp_due); with a commit's rows (≤ MAX_DRAFTS + 1) the debt stays within MAX_FUSED_MTP_ROWS.
MTP_DEBT_ROWS = 32


class Drafter:
    """Model-side state and the drafting rules; see the module docstring for which thread runs what."""

    def __init__(self, model, settings: DrafterSettings) -> None:
        self.model = model
        self.settings = settings
        routing = None
        if settings.moce_scale not in (0.0, 1.0) or settings.expert_slots:
            family = family_of(model)
            if MOCE not in family.capabilities:
                raise ValueError("moce_scale and expert_slots (MoCE routing, expert slots) are not built for the "
                                 f"{family.name} family")
            routing = RoutingOptions(moce=True, scale=settings.moce_base_scale(model.config.num_experts))
        fused = None
        if model.mtp is not None and fused_wanted(model, settings.fused):
            fused = build_fused(model, max_rows=MAX_FUSED_MTP_ROWS, max_length=model.config.max_position_embeddings)
        self.mtp = MTPProposer(model, routing, fused) if model.mtp is not None else None
        self.planner = Planner()
        self.global_index = GlobalIndex(settings.global_index_mb << 20)
        # Request-initial planner snapshots by session id: a re-sync of the same request (after
        # an eviction or a lost stream) keeps planning with the estimates it started with.
        self.snapshots: OrderedDict[str, Estimates] = OrderedDict()
        self.max_snapshots = 4 * settings.max_sessions

    def snapshot_for(self, session_id: str) -> Estimates:
        snapshot = self.snapshots.get(session_id)
        if snapshot is None:
            snapshot = self.snapshots[session_id] = self.planner.snapshot()
            while len(self.snapshots) > self.max_snapshots:
                self.snapshots.popitem(last=False)
        self.snapshots.move_to_end(session_id)
        return snapshot

    def mtp_store(self) -> ExpertStore | None:
        """The MTP layer's expert store (qwen3_moe: slot counters; None otherwise)."""
        store = self.model.mtp.layers[0].mlp.experts if self.mtp is not None else None
        return store if isinstance(store, ExpertStore) else None

    def _slot_misses(self) -> int:
        store = self.mtp_store()
        return store.counters.misses if store is not None else 0

    # -- a session's life: open (worker), commit (loop), settle (loop or worker) ------------------

    def open(self, message: drafter_pb2.DraftOpen, snapshot: Estimates | None = None) -> DraftSession:
        """A new session (worker: the prompt's MTP catch-up). `snapshot`: snapshot_for(its id),
        which the service takes on the loop (None: taken here)."""
        if snapshot is None:
            snapshot = self.snapshot_for(message.session_id)
        sampling, mode, gate, policy = session_params(message)
        tokens = list(message.token_ids)
        if not tokens:
            raise ValueError("open.token_ids is empty")
        suffix = SuffixIndex()
        suffix.extend(tokens, count=False)
        suffix.count_pending(COUNT_CHUNK)  # a longer prompt: the rest after the first chain (Draft)
        max_drafts = max(0, min(message.max_draft_tokens, MAX_DRAFTS))
        mtp_state = None
        if self.mtp is not None:
            length = min(self.model.config.max_position_embeddings,
                         len(tokens) + max(message.max_new_tokens, 0) + max_drafts + 2)
            hidden = decode_hidden(message.hidden)
            if hidden.shape[0] != len(tokens) - 1:
                raise ValueError(f"open.hidden has {hidden.shape[0]} rows for {len(tokens)} tokens (need {len(tokens) - 1})")
            mtp_state = self.mtp.new_state(length)
            try:
                self.mtp.catch_up(mtp_state, hidden, tokens[1:])
            except BaseException:
                self.mtp.release(mtp_state)
                raise
        return DraftSession(
            session_id=message.session_id, sampling=sampling, seed=message.sampling.seed, mode=mode, gate=gate,
            coupled=message.speculation.coupled, policy=policy, max_drafts=max_drafts,
            snapshot=snapshot, suffix=suffix, mtp=mtp_state, round_id=message.next_round_id,
            opened_with=len(tokens), draft_ahead=message.draft_ahead and self.settings.draft_ahead,
        )

    def commit(self, session: DraftSession, message: drafter_pb2.DraftCommit) -> bool:
        """Apply a round's outcome (loop: bookkeeping; its MTP rows wait for settle or draft_mtp);
        True when it is what the chain drafted ahead assumed (the verifier has its next chain)."""
        emitted = list(message.emitted_token_ids)
        if session.mtp is not None:  # checked before anything changes: a refused commit leaves the session as it was
            hidden = decode_hidden(message.hidden)
            if hidden.shape[0] != len(emitted):
                raise ValueError(f"commit.hidden has {hidden.shape[0]} rows for {len(emitted)} emitted tokens")
        if message.num_rounds > 1:
            pass  # a resume: the verifier decoded without this drafter, nothing was verified to learn from
        elif session.in_flight is not None and session.in_flight.source != "NONE":
            plan = session.in_flight
            self.planner.learn(plan.source, plan.bucket, message.num_verified, message.num_accepted,
                               message.verify_ms, message.num_verified + 1)
        elif message.verify_ms > 0:
            self.planner.learn("MTP", 0, 0, 0, message.verify_ms, 1)
        ahead, session.ahead = session.ahead, None
        hit = (ahead is not None and message.num_rounds <= 1 and ahead.round_id == message.round_id + 1
               and emitted == list(ahead.assumed_token_ids))
        session.in_flight = session.ahead_plan if hit else None
        if hit:
            session.ahead = ahead  # the chain the verifier verifies next: the basis of the next one ahead
        session.suffix.extend(emitted, count=False)  # counted after the chain is sent (settle)
        session.round_id = message.round_id + 1
        session.chain_cap = message.max_draft_tokens
        if session.mtp is not None:
            self.mtp.defer(session.mtp, hidden, emitted)  # run when MTP drafts, or after the chain is sent
        return hit

    @staticmethod
    def mtp_due(session: DraftSession) -> bool:
        """Whether the session's MTP debt (committed rows not yet through the MTP layer) is paid
        after the chain went out. A session that drafts by MTP pays it in each chain's job; one
        drafting from its suffix index owes it until an MTP chain needs the rows or it reaches
        MTP_DEBT_ROWS. On the fused path a debt is paid in one catch-up: a streak of suffix
        rounds costs a forward every few rounds, not one each, and an MTP chain after it waits
        for one forward (the reference modules pay a forward a commit, later or never)."""
        return session.mtp is not None and session.mtp.pending_rows >= MTP_DEBT_ROWS

    @classmethod
    def unsettled(cls, session: DraftSession) -> bool:
        """Whether work is left for after the chain went out (settle)."""
        return session.suffix.counted < len(session.tokens) or cls.mtp_due(session)

    @classmethod
    def settles_on_loop(cls, session: DraftSession) -> bool:
        """Whether what is left is a few suffix counts (the loop's) rather than model work or a
        long prompt's counts (a worker job each, so the loop never stalls on them)."""
        return not cls.mtp_due(session) and len(session.tokens) - session.suffix.counted <= LOOP_COUNT

    def settle(self, session: DraftSession) -> None:
        """Work a commit left for after its chain was sent: the MTP debt if due, then suffix counts."""
        self.settle_batch([session])

    def settle_batch(self, sessions: list[DraftSession]) -> None:
        """settle of several sessions (worker): the MTP debts due, in one forward; suffix counts."""
        if self.mtp is not None:
            self.mtp.settle_batch([s.mtp for s in sessions if self.mtp_due(s)])
        for session in sessions:
            session.suffix.count_pending(COUNT_CHUNK)

    def close(self, session: DraftSession) -> None:
        """The session's stream ended: its MTP rows' pool slot goes back (worker, behind its jobs)."""
        if session.mtp is not None:
            self.mtp.release(session.mtp)

    # -- chains: plan (loop), MTP drafts (worker), the message (loop) ----------------------------

    def _suffix_match(self, session: DraftSession, limit: int) -> SuffixMatch | None:
        # Other sessions' outputs only in exact mode: a same-seed session's tokens encode its
        # accept draws, which would bias probabilistic acceptance here.
        return best_match(session.suffix, self.global_index if session.mode == Mode.EXACT else None, limit)

    def plan(self, session: DraftSession, mtp: bool = True) -> tuple[Plan, SuffixMatch | None]:
        """The next chain's source and length, and the suffix match it may use (loop: no model
        work); mtp=False: without MTP drafts (load shedding)."""
        match = self._suffix_match(session, session.chain_limit)
        mtp_ready = mtp and session.mtp is not None and (session.mtp.next_logits is not None or bool(session.mtp.pending))
        plan = choose(session.snapshot, limit=session.chain_limit, mtp_available=mtp_ready,
                      suffix_length=match.length if match else None,
                      suffix_tokens=len(match.continuation) if match else 0, round_id=session.round_id,
                      policy=self.settings.planner)
        return plan, match

    def draft_mtp(self, session: DraftSession, plan: Plan) -> Proposal:
        """An MTP plan's drafts, with their expert-slot misses (worker)."""
        return self.draft_mtp_batch([(session, plan)])[0]

    def draft_mtp_batch(self, items: list[tuple[DraftSession, Plan]]) -> list[Proposal]:
        """The MTP drafts of several sessions' plans (worker): their deferred commits, then their
        chains step by step, each in shared forwards. A batch's expert-slot misses are split
        evenly between its chains (which row missed is not tracked)."""
        misses = self._slot_misses()
        self.mtp.settle_batch([session.mtp for session, _ in items])
        proposals = self.mtp.draft_batch([
            DraftJob(session.mtp, plan.num_drafts, session.sampling, session.seed, len(session.tokens), session.mode,
                     session.gate, session.coupled, session.policy) for session, plan in items])
        share, extra = divmod(self._slot_misses() - misses, len(items))
        return [dataclasses.replace(p, slot_misses=share + (i < extra)) for i, p in enumerate(proposals)]

    def chain(self, session: DraftSession, plan: Plan, match: SuffixMatch | None, mtp: Proposal | None,
              draft_ms: float) -> drafter_pb2.DraftChain:
        """The chain message of a plan (loop); `mtp` is draft_mtp's proposal for an MTP plan,
        `draft_ms` the compute the chain cost (its commit or open included)."""
        if plan.source == "MTP" and mtp is not None:
            proposal = mtp
        elif plan.source == "SUFFIX":
            tokens = match.continuation[: plan.num_drafts]
            proposal = Proposal("SUFFIX", tokens, None, [1.0] * len(tokens))
        else:
            proposal = Proposal("NONE", [], None, [])
        session.in_flight = plan if proposal.token_ids else None
        q_rows = []
        if proposal.q_rows is not None:
            for index in range(len(proposal.token_ids)):
                row = proposal.q_rows.row(index)
                q_rows.append(common_pb2.SparseRow(token_ids=list(row), probs=list(row.values())))
        return drafter_pb2.DraftChain(
            round_id=session.round_id,
            base_length=len(session.tokens),
            source=SOURCES[proposal.source if proposal.token_ids else "NONE"],
            token_ids=proposal.token_ids,
            q_rows=q_rows,
            confidences=proposal.confidences,
            costs=drafter_pb2.DrafterCosts(draft_ms=draft_ms, expert_slot_misses=proposal.slot_misses),
        )

    def mtp_batch(self, items: list[tuple[DraftSession, Plan | None]]) -> list[Proposal | None]:
        """One job of the MTP batcher (worker): the MTP debts of the sessions with a plan or a
        debt due (mtp_due) in shared forwards, the suffix counts of those that only settle, then
        the chains of those with a plan (their drafts step by step in shared forwards); None for
        a settle."""
        if len({id(session) for session, _ in items}) != len(items):
            raise ValueError("a batch holds one piece of work per session")
        drafts = [(session, plan) for session, plan in items if plan is not None]
        if self.mtp is not None:  # (the debts of the chains' sessions too, in the same forward)
            self.mtp.settle_batch([session.mtp for session, plan in items if plan is not None or self.mtp_due(session)])
        for session, plan in items:
            if plan is None:
                session.suffix.count_pending(COUNT_CHUNK)
        proposals = iter(self.draft_mtp_batch(drafts) if drafts else [])
        return [None if plan is None else next(proposals) for _, plan in items]

    def learn_mtp_cost(self, plan: Plan, mtp_ms: float) -> None:
        if plan.num_drafts:
            self.planner.learn_draft_cost(mtp_ms / plan.num_drafts)

    def propose(self, session: DraftSession) -> drafter_pb2.DraftChain:
        """plan, draft_mtp and chain in one thread (tests and benchmarks; the service splits them)."""
        started = time.perf_counter()
        plan, match = self.plan(session)
        mtp = None
        if plan.source == "MTP":
            drafting = time.perf_counter()
            mtp = self.draft_mtp(session, plan)
            self.learn_mtp_cost(plan, (time.perf_counter() - drafting) * 1e3)
        return self.chain(session, plan, match, mtp, (time.perf_counter() - started) * 1e3)

    def propose_ahead(self, session: DraftSession, sent: drafter_pb2.DraftChain | None) -> drafter_pb2.DraftChain | None:
        """Draft-ahead (DESIGN §9; loop): the chain for the round after `sent`, assuming all of its
        drafts accepted and then the bonus the suffix index expects. Only after suffix chains:
        their continuation costs a lookup (an MTP chain would need the target's hidden rows of
        its drafts). None when there is nothing to assume or to draft."""
        session.ahead = None
        if not session.draft_ahead or sent is None or sent.source != common_pb2.DRAFT_SOURCE_SUFFIX or not sent.token_ids:
            return None
        started = time.perf_counter()
        drafts = list(sent.token_ids)
        with session.suffix.assuming(drafts):
            bonus = self._suffix_match(session, 1)
        if bonus is None:
            return None
        assumed = drafts + bonus.continuation[:1]
        with session.suffix.assuming(assumed):
            match = self._suffix_match(session, session.chain_limit)
        if match is None:
            return None
        plan = choose(session.snapshot, limit=session.chain_limit, mtp_available=False, suffix_length=match.length,
                      suffix_tokens=len(match.continuation), round_id=sent.round_id + 1, policy=self.settings.planner)
        if plan.source != "SUFFIX" or not plan.num_drafts:
            return None
        tokens = match.continuation[: plan.num_drafts]
        session.ahead, session.ahead_plan = drafter_pb2.DraftChain(
            round_id=sent.round_id + 1, base_length=sent.base_length + len(assumed), source=SOURCES["SUFFIX"],
            token_ids=tokens, confidences=[1.0] * len(tokens), assumed_token_ids=assumed,
            costs=drafter_pb2.DrafterCosts(draft_ms=(time.perf_counter() - started) * 1e3),
        ), plan
        return session.ahead

    def add_output(self, tokens: list[int], prompt_length: int) -> Iterator[None]:
        """Count a finished request's output (`tokens` past `prompt_length`) into the global index
        (loop), with its prompt's last tokens as contexts, LOOP_COUNT tokens per step: the caller
        yields to the loop between steps."""
        output, lead = with_prompt_end(tokens, prompt_length)
        yield from self.global_index.adding(output, LOOP_COUNT, lead)
