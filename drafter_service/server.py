"""The drafter gRPC service: one Draft stream per request.

Up: open (full context + hidden rows), then one commit per round. Down: one chain per
open/commit, for the next round. All model work runs on the drafter's model worker.
"""

from __future__ import annotations

import time

import grpc
import structlog
import torch

from collections import OrderedDict

from drafter_service.planner import Estimates, Planner, choose
from drafter_service.proposers import Proposal
from drafter_service.messages import check_commit, check_open
from drafter_service.proposers.mtp import MTPProposer, MTPState
from drafter_service.proposers.suffix import COUNT_CHUNK, GlobalIndex, SuffixIndex
from drafter_service.session import DraftSession, SessionStore, session_params
from drafter_service.settings import DrafterSettings
from kernels.speculative import Mode
from shared import security, telemetry
from shared.metrics import DrafterMetrics
from shared.model import RoutingOptions, load_model
from shared.model.fast import FusedModel, fused_wanted
from shared.model.registry import resolve_model
from shared.protocol import PROTOCOL_VERSION, common_pb2, decode_hidden, drafter_pb2, drafter_pb2_grpc
from shared.service import ServiceServer, require_model, run_until_signalled
from shared.worker import ModelWorker

log = structlog.get_logger("drafter")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SOURCES = {"MTP": common_pb2.DRAFT_SOURCE_MTP, "SUFFIX": common_pb2.DRAFT_SOURCE_SUFFIX, "NONE": common_pb2.DRAFT_SOURCE_NONE}
MAX_DRAFTS = 16
DRAFT_METHOD = "/tandem.v1.Drafter/Draft"
MAX_FUSED_MTP_ROWS = 64  # MTP catch-ups longer than this (a prompt) run the reference modules


class Drafter:
    """Model-side drafting logic (runs on the worker thread)."""

    def __init__(self, model, settings: DrafterSettings) -> None:
        self.model = model
        self.settings = settings
        routing = None
        if settings.moce_scale != 1.0 or settings.expert_slots:
            routing = RoutingOptions(moce=True, scale=settings.moce_scale)
        fused = None
        if model.mtp is not None and fused_wanted(model, settings.fused):
            fused = FusedModel(model, max_rows=MAX_FUSED_MTP_ROWS, max_length=model.config.max_position_embeddings)
        self.mtp = MTPProposer(model, routing, fused) if model.mtp is not None else None
        self.planner = Planner()
        self.global_index = GlobalIndex(settings.global_index_contexts)
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

    def _mtp_store(self):
        return self.model.mtp.layers[0].mlp.experts if self.mtp is not None else None

    def open(self, message: drafter_pb2.DraftOpen) -> DraftSession:
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
            mtp_state = MTPState(self.model, length)
            hidden = decode_hidden(message.hidden)
            if hidden.shape[0] != len(tokens) - 1:
                raise ValueError(f"open.hidden has {hidden.shape[0]} rows for {len(tokens)} tokens (need {len(tokens) - 1})")
            self.mtp.catch_up(mtp_state, hidden, tokens[1:])
        return DraftSession(
            session_id=message.session_id, sampling=sampling, seed=message.sampling.seed, mode=mode, gate=gate,
            coupled=message.speculation.coupled, policy=policy, max_drafts=max_drafts,
            snapshot=self.snapshot_for(message.session_id), suffix=suffix, mtp=mtp_state, round_id=message.next_round_id,
            opened_with=len(tokens), draft_ahead=message.draft_ahead and self.settings.draft_ahead,
        )

    def commit(self, session: DraftSession, message: drafter_pb2.DraftCommit) -> bool:
        """Apply a round's outcome; True when it is what the chain drafted ahead assumed (the
        verifier then has its next chain already)."""
        emitted = list(message.emitted_token_ids)
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
        session.suffix.extend(emitted, count=False)  # counted after the chain is sent (Draft)
        session.round_id = message.round_id + 1
        if session.mtp is not None:
            hidden = decode_hidden(message.hidden)
            if hidden.shape[0] != len(emitted):
                raise ValueError(f"commit.hidden has {hidden.shape[0]} rows for {len(emitted)} emitted tokens")
            self.mtp.defer(session.mtp, hidden, emitted)  # run when MTP drafts, or after the chain is sent
        return hit

    @staticmethod
    def unsettled(session: DraftSession) -> bool:
        """Whether work is left for after the chain went out (settle)."""
        return session.suffix.counted < len(session.tokens) or (session.mtp is not None and bool(session.mtp.pending))

    def settle(self, session: DraftSession) -> None:
        """Work a commit left for after its chain was sent: the MTP rows, then suffix counts."""
        if session.mtp is not None:
            self.mtp.settle(session.mtp)
        session.suffix.count_pending(COUNT_CHUNK)

    def _suffix_match(self, session: DraftSession, limit: int):
        match = session.suffix.lookup(limit)
        if session.mode == Mode.EXACT:
            # Other sessions' outputs only in exact mode: a same-seed session's tokens encode
            # its accept draws, which would bias probabilistic acceptance here.
            other = self.global_index.lookup(session.suffix, limit, match)
            if other is not None and (match is None or other.score > match.score):
                match = other
        return match

    def propose_ahead(self, session: DraftSession, sent: drafter_pb2.DraftChain | None) -> drafter_pb2.DraftChain | None:
        """Draft-ahead (DESIGN §9): the chain for the round after `sent`, assuming all of its drafts
        accepted and then the bonus the suffix index expects. Only after suffix chains: their
        continuation costs a lookup (an MTP chain would need the target's hidden rows of its
        drafts). None when there is nothing to assume or to draft."""
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
            match = self._suffix_match(session, session.max_drafts)
        if match is None:
            return None
        plan = choose(session.snapshot, limit=session.max_drafts, mtp_available=False, suffix_length=match.length,
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

    def propose(self, session: DraftSession) -> drafter_pb2.DraftChain:
        started = time.perf_counter()
        limit = session.max_drafts
        match = self._suffix_match(session, limit)
        mtp_ready = session.mtp is not None and (session.mtp.next_logits is not None or bool(session.mtp.pending))
        plan = choose(session.snapshot, limit=limit, mtp_available=mtp_ready,
                      suffix_length=match.length if match else None,
                      suffix_tokens=len(match.continuation) if match else 0, round_id=session.round_id,
                      policy=self.settings.planner)
        proposal = Proposal("NONE", [], None, [])
        store = self._mtp_store()
        misses = store.counters.misses if store is not None else 0
        if plan.source == "MTP":
            self.mtp.settle(session.mtp)
            proposal = self.mtp.draft(
                session.mtp, plan.num_drafts, sampling=session.sampling, seed=session.seed,
                base_position=len(session.tokens), mode=session.mode, gate=session.gate, coupled=session.coupled,
                policy=session.policy,
            )
            elapsed = (time.perf_counter() - started) * 1e3
            if plan.num_drafts:
                self.planner.learn_draft_cost(elapsed / plan.num_drafts)
        elif plan.source == "SUFFIX":
            tokens = match.continuation[: plan.num_drafts]
            proposal = Proposal("SUFFIX", tokens, None, [1.0] * len(tokens))
        session.in_flight = plan if proposal.token_ids else None
        slot_misses = (store.counters.misses - misses) if store is not None else 0
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
            costs=drafter_pb2.DrafterCosts(draft_ms=(time.perf_counter() - started) * 1e3, expert_slot_misses=slot_misses),
        )


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, settings: DrafterSettings, model=None) -> None:
        self.settings = settings
        self.worker = ModelWorker("drafter-model")
        self.model = model
        self.drafter: Drafter | None = None
        self.sessions = SessionStore(settings.max_sessions)
        self.streams_by_peer: dict[str, int] = {}
        self.metrics = DrafterMetrics()

    async def load(self) -> None:
        if self.model is None:
            path = resolve_model(self.settings.model)
            log.info("loading model", path=str(path), device=self.settings.device)
            self.model = await self.worker.run(
                load_model, path, device=self.settings.device, dtype=DTYPES[self.settings.dtype],
                num_expert_slots=self.settings.expert_slots or None,
            )
        self.drafter = Drafter(self.model, self.settings)
        log.info("drafter ready", address=self.settings.address, mtp=self.drafter.mtp is not None)

    def _add_output(self, token_ids: list[int]) -> None:
        self.drafter.global_index.add(token_ids)
        self.metrics.global_contexts.set(len(self.drafter.global_index))

    def _open_and_propose(self, message):
        started = time.perf_counter()
        session = self.drafter.open(message)
        chain = self.drafter.propose(session)
        chain.costs.draft_ms = (time.perf_counter() - started) * 1e3  # the open's catch-up is compute too
        return session, chain

    def _commit_and_propose(self, session, message):
        """The chain answering a commit; None when the chain drafted ahead was right (already sent).
        Its draft_ms covers the commit's work too (what the verifier's trace counts as compute)."""
        started = time.perf_counter()
        if self.drafter.commit(session, message):
            return None
        chain = self.drafter.propose(session)
        chain.costs.draft_ms = (time.perf_counter() - started) * 1e3
        return chain

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext):
        if self.drafter is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter model is still loading")
        session: DraftSession | None = None
        tracer = telemetry.tracer("tandem.drafter")
        peer = peer_host(context.peer())
        if self.streams_by_peer.get(peer, 0) >= self.settings.max_streams_per_peer:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{peer} holds {self.settings.max_streams_per_peer} Draft streams (max_streams_per_peer)")
        self.streams_by_peer[peer] = self.streams_by_peer.get(peer, 0) + 1
        self.metrics.active.inc()
        try:
            # context.read(), not `async for` over request_iterator: gRPC's iterator keeps the
            # last message in a suspended generator after an abort, for as long as the call's
            # garbage lives (a flood of refused 4M-token opens held gigabytes).
            while (up := await context.read()) is not grpc.aio.EOF:
                kind = up.WhichOneof("kind")
                if kind not in ("open", "commit"):
                    continue  # a message kind this version does not know
                if kind == "commit" and (session is None or not self.sessions.touch(session)):
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "unknown or evicted session: re-open the stream with the full context",
                    )
                # Each message carries the verifier span it belongs to: the drafter's span
                # joins that trace even though the stream outlives it.
                parent = telemetry.extract_context(up.trace_context) if up.trace_context else None
                with tracer.start_as_current_span("propose", context=parent) as span:
                    refusal = None
                    try:
                        config = self.model.config
                        if kind == "open":
                            check_open(up.open, config)  # on the loop, before any work: cheap and bounded
                            if session is not None:  # a re-open on the same stream replaces its session
                                self.sessions.remove(session)
                            session, chain = await self.worker.run(self._open_and_propose, up.open)
                            # counted here, not as a before/after difference: concurrent opens overlap
                            self.metrics.evictions.inc(self.sessions.put(session))
                            structlog.contextvars.bind_contextvars(request_id=session.session_id)
                        else:
                            check_commit(up.commit, max_drafts=session.max_drafts, committed=len(session.tokens),
                                         round_id=session.round_id, config=config)
                            chain = await self.worker.run(self._commit_and_propose, session, up.commit)
                    except ValueError as error:
                        refusal = str(error)
                    if refusal is not None:
                        # The abort's traceback keeps this frame alive until a full garbage
                        # collection: it must not keep the refused (possibly huge) message too.
                        del up
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
                    if chain is not None:
                        self._observe(span, session, chain, kind)
                    else:
                        span.set_attribute("tandem.ahead_hit", True)
                        self.metrics.ahead.labels("hit").inc()
                if chain is not None:
                    yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=chain)
                # The next round's chain drafted ahead (on the chain just sent, or on the one the
                # verifier holds after a hit), while the verifier verifies.
                basis = chain if chain is not None else session.ahead
                ahead = None
                if session.draft_ahead and basis is not None and basis.source == common_pb2.DRAFT_SOURCE_SUFFIX:
                    ahead = await self.worker.run(self.drafter.propose_ahead, session, basis)
                if ahead is not None:
                    self.metrics.ahead.labels("sent").inc()
                    yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=ahead)
                # What the commit left (its MTP rows, the suffix counts of its tokens or of a
                # long prompt, a chunk a job), while the verifier verifies.
                while self.drafter.unsettled(session):
                    await self.worker.run(self.drafter.settle, session)
        finally:
            self.metrics.active.dec()
            self.streams_by_peer[peer] -= 1
            if not self.streams_by_peer[peer]:
                del self.streams_by_peer[peer]
            if session is not None:
                self.sessions.remove(session)
                if self.drafter is not None:  # its output joins the global index, on the worker like every lookup
                    self.worker.submit(self._add_output, session.tokens[session.opened_with:])
            structlog.contextvars.unbind_contextvars("request_id")

    def _observe(self, span, session: DraftSession, chain: drafter_pb2.DraftChain, kind: str) -> None:
        source = {common_pb2.DRAFT_SOURCE_MTP: "MTP", common_pb2.DRAFT_SOURCE_SUFFIX: "SUFFIX"}.get(chain.source, "NONE")
        m = self.metrics
        m.proposals.labels(source).inc()
        m.draft_tokens.labels(source).inc(len(chain.token_ids))
        m.draft_seconds.observe(chain.costs.draft_ms / 1e3)
        m.slot_misses.inc(chain.costs.expert_slot_misses)
        store = self.drafter._mtp_store()
        if store is not None and not store.all_resident:
            m.slot_hit_rate.set(store.counters.hit_rate)
        span.set_attributes({
            "tandem.request_id": session.session_id, "tandem.message": kind, "tandem.round_id": chain.round_id,
            "tandem.base_length": chain.base_length, "tandem.source": source,
            "tandem.drafts": len(chain.token_ids), "tandem.confidences": list(chain.confidences),
            "tandem.draft_ms": chain.costs.draft_ms, "tandem.slot_misses": chain.costs.expert_slot_misses,
        })


def peer_host(peer: str) -> str:
    """The client's address without its port ("ipv4:10.0.0.5:43210" → "ipv4:10.0.0.5")."""
    if peer.startswith("ipv6:[") and "]" in peer:
        return peer[: peer.index("]") + 1]
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


class DrafterServer(ServiceServer):
    """A drafter on a real port: start(), wait_loaded(), stop(grace)."""

    service_name = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name

    def __init__(self, settings: DrafterSettings, *, model=None) -> None:
        interceptors = []
        if settings.auth_token:
            interceptors.append(security.BearerTokenInterceptor(settings.auth_token, protected_methods=(DRAFT_METHOD,)))
        super().__init__(settings, interceptors=interceptors)
        self.service = DrafterService(settings, model=model)

    def preflight(self) -> None:
        if self.service.model is None:
            require_model(self.settings.model)

    def register(self) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self.service, self.server)

    async def load(self) -> None:
        await self.service.load()

    @property
    def metrics_registry(self):
        return self.service.metrics.registry

    async def close(self) -> None:
        self.service.worker.shutdown()


async def serve(settings: DrafterSettings) -> None:
    await run_until_signalled(lambda: DrafterServer(settings), "tandem-drafter")
