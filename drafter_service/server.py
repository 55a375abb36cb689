"""The drafter gRPC service: one Draft stream per request, and a Record per finished request.

Up: open (full context + hidden rows), then one commit per round. Down: one chain per
open/commit, for the next round (none when the chain drafted ahead was right), and the chain
drafted ahead. Model work runs on the drafter's model worker; everything else on the event
loop, so a round drafted by suffix lookup costs no thread hop (drafter_service.drafter).

The index of outputs (the global suffix index) learns a request's output from its Record —
every token it committed, whether its rounds drafted or not — not from its stream, which
hears only the rounds that drafted (DESIGN §9).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import grpc
import structlog
from opentelemetry.trace import Status, StatusCode

from drafter_service.batcher import MtpBatcher
from drafter_service.drafter import Drafter
from drafter_service.load import WorkerLoad
from drafter_service.messages import check_commit, check_open, check_record
from drafter_service.session import DraftSession, SessionStore
from drafter_service.settings import DrafterSettings
from shared import security, telemetry
from shared.threads import model_threads, use_device, use_threads
from shared.metrics import DrafterMetrics
from shared.model import DTYPES, load_model, resident_bytes
from shared.model.registry import resolve_model
from shared.protocol import PROTOCOL_VERSION, common_pb2, drafter_pb2, drafter_pb2_grpc
from shared.local_stream import LocalStreamServer
from shared.service import MAX_MESSAGE_BYTES, ServiceServer, require_model, run_until_signalled
from shared.worker import ModelWorker

log = structlog.get_logger("drafter")
DRAFT_METHOD = "/tandem.v1.Drafter/Draft"
RECORD_METHOD = "/tandem.v1.Drafter/Record"


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, settings: DrafterSettings, model=None) -> None:
        self.settings = settings
        self.worker = ModelWorker("drafter-model")
        self.model = model
        self.drafter: Drafter | None = None
        self.sessions = SessionStore(settings.max_sessions)
        self.streams_by_peer: dict[str, int] = {}
        self.draining = False  # SIGTERM: open streams run on, new ones are refused
        self.metrics = DrafterMetrics()
        self._background: set[asyncio.Task] = set()  # global-index additions in progress
        self.worker_load = WorkerLoad()
        # Every session's MTP work (chains, a commit's deferred rows) in shared worker jobs.
        self.mtp_batcher = MtpBatcher(self._mtp_batch, on_batch=self.metrics.mtp_batch.observe)

    async def load(self) -> None:
        threads = model_threads(self.settings.cpu_threads, device=self.settings.device, role="drafter").full
        if threads is not None:  # (shared/threads.py: before any model work)
            await self.worker.run(use_threads, threads)  # (the model worker's thread runs the ops)
            log.info("cpu threads", threads=threads)
        await self.worker.run(use_device, self.settings.device)
        if self.model is None:
            path = resolve_model(self.settings.model)
            log.info("loading model", path=str(path), device=self.settings.device)
            # A lean drafter: the MTP layer, embeddings and lm_head, never the trunk (it gets the
            # trunk's hidden rows from the verifier).
            self.model = await self.worker.run(
                load_model, path, device=self.settings.device, dtype=DTYPES[self.settings.dtype],
                num_expert_slots=self.settings.expert_slots or None, random_weights=self.settings.random_weights,
                parts="mtp", quantize=self.settings.quantize,
            )
        self.drafter = Drafter(self.model, self.settings)
        model_bytes = resident_bytes(self.model)
        self.metrics.model_bytes.set(model_bytes)
        self.metrics.report_global_index(self.drafter.global_index)
        log.info("drafter ready", address=self.settings.address, mtp=self.drafter.mtp is not None,
                 model_gib=round(model_bytes / 2**30, 3))

    def _add_output(self, tokens: list[int], prompt_length: int) -> None:
        """A finished request's output (`tokens` past `prompt_length`) joins the global index
        (loop): its first LOOP_COUNT tokens at once (a request that follows finds them), the rest
        in steps between other work."""
        steps = self.drafter.add_output(tokens, prompt_length)
        if next(steps, StopIteration) is not StopIteration:  # (the first step is done; more are left)
            task = asyncio.get_running_loop().create_task(self._finish_adding(steps))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        self.metrics.report_global_index(self.drafter.global_index)

    async def _finish_adding(self, steps: Iterator[None]) -> None:
        for _ in steps:
            await asyncio.sleep(0)
        self.metrics.report_global_index(self.drafter.global_index)

    async def _run(self, kind: str, fn: Callable, *args) -> tuple[object, float]:
        """A model-worker job, counted in the worker's load by its kind: (its result, its own ms)."""
        self.worker_load.begin(kind)
        job_ms = None
        try:
            result, job_ms = await self.worker.run(timed, fn, *args)
        finally:
            self.worker_load.end(kind, job_ms)
        return result, job_ms

    async def _mtp_batch(self, items) -> tuple[list, float]:
        """One MTP batcher job on the worker, counted as one "mtp" job in the worker's load."""
        return await self._run("mtp", self.drafter.mtp_batch, items)

    async def _open(self, message: drafter_pb2.DraftOpen) -> tuple[DraftSession, drafter_pb2.DraftChain, bool]:
        session, open_ms = await self._run("open", self.drafter.open, message, self.drafter.snapshot_for(message.session_id))
        return session, *await self._chain(session, open_ms)  # the open's catch-up is compute too

    async def _chain(self, session: DraftSession, spent_ms: float,
                     wait_ms: float = 0.0) -> tuple[drafter_pb2.DraftChain, bool]:
        """The chain of the session's next round, and whether MTP drafts were shed for it: planned
        on the loop, MTP drafts on the worker unless they would miss the verifier's `wait_ms`
        (drafter_service.load). Its draft_ms is the compute it cost, `spent_ms` (its commit or
        open) included, hops and queueing not."""
        started = time.perf_counter()
        plan, match = self.drafter.plan(session)
        shed = plan.source == "MTP" and self.settings.load_shedding and self.worker_load.sheds(
            plan.num_drafts, self.drafter.planner.live.mtp_step_ms, wait_ms)
        if shed:
            plan, match = self.drafter.plan(session, mtp=False)
            self.metrics.shed.inc()
        mtp, mtp_ms = None, 0.0
        if plan.source == "MTP":
            planned = time.perf_counter()
            mtp, mtp_ms = await self.mtp_batcher.submit(session, plan)  # (mtp_ms: its whole batch's job)
            self.drafter.learn_mtp_cost(plan, mtp_ms)
            started += time.perf_counter() - planned  # the loop's own time only
        chain = self.drafter.chain(session, plan, match, mtp, 0.0)
        chain.costs.draft_ms = spent_ms + mtp_ms + (time.perf_counter() - started) * 1e3
        return chain, shed

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext):
        if self.drafter is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter model is still loading")
        if self.draining:  # (the verifier decodes plainly and re-opens on another replica)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is shutting down")
        session: DraftSession | None = None
        # The cap is per address for callers nobody vouched for; a caller that passed the token
        # or a client certificate is a verifier of this deployment, with as many streams as it
        # has sessions (one address may be a whole verifier, or an attacker beside it).
        peer = "authenticated" if authenticates(self.settings) else peer_host(context.peer())
        if peer != "authenticated" and self.streams_by_peer.get(peer, 0) >= self.settings.max_streams_per_peer:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{peer} holds {self.settings.max_streams_per_peer} Draft streams (max_streams_per_peer)")
        self.streams_by_peer[peer] = self.streams_by_peer.get(peer, 0) + 1
        self.metrics.active.inc()
        try:
            # context.read(), not `async for` over request_iterator: gRPC's iterator keeps the
            # last message in a suspended generator after an abort, for as long as the call's
            # garbage lives (a flood of refused 4M-token opens held gigabytes).
            while (up := await context.read()) is not grpc.aio.EOF:
                received_ns = time.time_ns()
                kind = up.WhichOneof("kind")
                if kind not in ("open", "commit"):
                    continue  # a message kind this version does not know
                if kind == "commit" and (session is None or not self.sessions.touch(session)):
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "unknown or evicted session: re-open the stream with the full context",
                    )
                refusal = None
                try:
                    config = self.model.config
                    if kind == "open":
                        check_open(up.open, config)  # before any work: cheap and bounded
                        if session is not None:  # a re-open on the same stream replaces its session
                            self.sessions.remove(session)
                            self.worker.submit(self.drafter.close, session)
                        session, chain, shed = await self._open(up.open)
                        # counted here, not as a before/after difference: concurrent opens overlap
                        self.metrics.evictions.inc(self.sessions.put(session))
                        structlog.contextvars.bind_contextvars(request_id=session.session_id)
                    else:
                        check_commit(up.commit, max_drafts=session.max_drafts, committed=len(session.tokens),
                                     round_id=session.round_id, config=config)
                        started = time.perf_counter()
                        chain, shed = None, False
                        if not self.drafter.commit(session, up.commit):  # (else: the chain drafted ahead was right)
                            chain, shed = await self._chain(session, (time.perf_counter() - started) * 1e3,
                                                            up.commit.wait_ms)
                except ValueError as error:
                    refusal = str(error)
                if refusal is not None:
                    self._trace(up, kind, received_ns, session, None, refusal)
                    # The abort's traceback keeps this frame alive until a full garbage
                    # collection: it must not keep the refused (possibly huge) message too.
                    del up
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
                if chain is not None:
                    yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=chain)
                # The span and metrics after the chain went out (the thin hop: off the round's path).
                self._trace(up, kind, received_ns, session, chain, shed=shed)
                # The next round's chain drafted ahead (on the chain just sent, or on the one the
                # verifier holds after a hit), while the verifier verifies.
                basis = chain if chain is not None else session.ahead
                if self.drafter.propose_ahead(session, basis) is not None:
                    self.metrics.ahead.labels("sent").inc()
                    yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=session.ahead)
                # What the commit left (its MTP rows, the suffix counts of its tokens or of a
                # long prompt, a chunk a job), while the verifier verifies.
                while self.drafter.unsettled(session):
                    if self.drafter.settles_on_loop(session):
                        self.drafter.settle(session)
                    else:  # with the other sessions' deferred rows and chains
                        await self.mtp_batcher.submit(session, None)
        finally:
            self.metrics.active.dec()
            self.streams_by_peer[peer] -= 1
            if not self.streams_by_peer[peer]:
                del self.streams_by_peer[peer]
            if session is not None:
                self.sessions.remove(session)
                if self.drafter is not None:
                    # On the worker, behind any job of this session already submitted there (a
                    # cancelled caller's work still pending in the batcher never runs).
                    self.worker.submit(self.drafter.close, session)
            structlog.contextvars.unbind_contextvars("request_id")

    async def Record(self, request: drafter_pb2.RecordRequest,
                     context: grpc.aio.ServicerContext) -> drafter_pb2.RecordReply:
        """A finished request's output joins the index of outputs (also while draining: it is a
        few tokens on the loop, and the verifier's output is real whatever this replica does next)."""
        if self.drafter is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter model is still loading")
        try:
            check_record(request, self.model.config)
        except ValueError as error:
            refusal = str(error)
        else:
            refusal = None
        if refusal is not None:
            del request  # (not kept alive by the abort's traceback)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        parent = telemetry.extract_context(request.trace_context) if request.trace_context else None
        with telemetry.tracer("tandem.drafter").start_as_current_span(
                "record", context=parent, attributes={"tandem.request_id": request.session_id,
                                                      "tandem.output_tokens": len(request.output_ids)}):
            if request.output_ids:
                lead = list(request.prompt_end_ids)
                self._add_output(lead + list(request.output_ids), len(lead))
        self.metrics.records.inc()
        return drafter_pb2.RecordReply(protocol_version=PROTOCOL_VERSION)

    def _trace(self, up: drafter_pb2.DraftUp, kind: str, received_ns: int, session: DraftSession | None,
               chain: drafter_pb2.DraftChain | None, refusal: str | None = None, shed: bool = False) -> None:
        """The message's `propose` span (from its arrival to now) and the chain's metrics. Each
        message carries the verifier span it belongs to: the drafter's span joins that trace
        even though the stream outlives it."""
        parent = telemetry.extract_context(up.trace_context) if up.trace_context else None
        span = telemetry.start_light_span("tandem.drafter", "propose", parent, start_time=received_ns)
        if refusal is not None:
            span.set_status(Status(StatusCode.ERROR, refusal))
        elif chain is None:
            span.set_attribute("tandem.ahead_hit", True)
            self.metrics.ahead.labels("hit").inc()
        else:
            self._observe(span, session, chain, kind)
            span.set_attribute("tandem.shed", shed)
        span.end()

    def _observe(self, span, session: DraftSession, chain: drafter_pb2.DraftChain, kind: str) -> None:
        source = {common_pb2.DRAFT_SOURCE_MTP: "MTP", common_pb2.DRAFT_SOURCE_SUFFIX: "SUFFIX"}.get(chain.source, "NONE")
        m = self.metrics
        m.proposals.labels(source).inc()
        m.draft_tokens.labels(source).inc(len(chain.token_ids))
        m.draft_seconds.observe(chain.costs.draft_ms / 1e3)
        m.slot_misses.inc(chain.costs.expert_slot_misses)
        store = self.drafter.mtp_store()
        if store is not None and not store.all_resident:
            m.slot_hit_rate.set(store.counters.hit_rate)
        span.set_attributes({
            "tandem.request_id": session.session_id, "tandem.message": kind, "tandem.round_id": chain.round_id,
            "tandem.base_length": chain.base_length, "tandem.source": source,
            "tandem.drafts": len(chain.token_ids), "tandem.confidences": list(chain.confidences),
            "tandem.draft_ms": chain.costs.draft_ms, "tandem.slot_misses": chain.costs.expert_slot_misses,
        })


def timed(fn: Callable, *args):
    """(fn(*args), milliseconds it took): a worker job's own compute, without the hops around it."""
    started = time.perf_counter()
    result = fn(*args)
    return result, (time.perf_counter() - started) * 1e3


def peer_host(peer: str) -> str:
    """The client's address without its port ("ipv4:10.0.0.5:43210" → "ipv4:10.0.0.5")."""
    if peer.startswith("ipv6:[") and "]" in peer:
        return peer[: peer.index("]") + 1]
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def authenticates(settings: DrafterSettings) -> bool:
    """Whether every Draft call is authenticated before it reaches the handler (a bearer token
    checked by the interceptor, or client certificates checked in the TLS handshake)."""
    return bool(settings.auth_token) or settings.tls_client_ca is not None


def loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class DrafterServer(ServiceServer):
    """A drafter on a real port: start(), wait_loaded(), stop(grace)."""

    service_name = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name

    def __init__(self, settings: DrafterSettings, *, model=None) -> None:
        token = security.BearerTokenInterceptor(settings.auth_token, protected_methods=(DRAFT_METHOD, RECORD_METHOD)) \
            if settings.auth_token else None
        super().__init__(settings, interceptors=[token] if token else [])
        self.service = DrafterService(settings, model=model)
        if settings.local_socket:  # (the same token, checked on a local stream's metadata)
            self.local = LocalStreamServer(settings.local_socket, self.service.Draft, drafter_pb2.DraftUp,
                                           limit=MAX_MESSAGE_BYTES, check=token.check if token else None)

    def preflight(self) -> None:
        if self.service.model is None:
            require_model(self.settings.model)
        if not authenticates(self.settings) and not loopback(self.settings.host):
            log.warning("the drafter accepts any client: it listens beyond loopback without --auth-token or "
                        "--tls-client-ca (README, Deploy and scale)", host=self.settings.host)

    def register(self) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self.service, self.server)

    async def load(self) -> None:
        await self.service.load()

    @property
    def metrics_registry(self):
        return self.service.metrics.registry

    def begin_drain(self, finish_by: float) -> None:
        """Refuse new Draft streams; the open ones (their verifiers' requests) run on until
        they end or the grace period does, health NOT_SERVING meanwhile."""
        self.service.draining = True

    def in_flight(self) -> int:
        return sum(self.service.streams_by_peer.values())

    async def close(self) -> None:
        await self.service.mtp_batcher.close()
        self.service.worker.shutdown()


async def serve(settings: DrafterSettings) -> None:
    await run_until_signalled(lambda: DrafterServer(settings), "tandem-drafter")
