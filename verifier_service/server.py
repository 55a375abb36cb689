"""The verifier gRPC service: Generate, health checking, reflection, graceful drain.

Each request: validate → open a session (prefill on the engine loop's thread) → open the
Draft stream → rounds of (await chain within the deadline, validate, retain, hand the round to
the engine loop, stream the committed tokens, commit to the drafter) → final event with stats.
Rounds the request's governor knows will be plain are granted to the engine loop, which runs
them on its own (verifier_service/loop.py); the coroutine streams their outcomes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kernels.speculative import Gate, Mode
from shared import security, telemetry
from shared.local_stream import LocalContext, LocalStreamServer, is_local_peer
from shared.threads import model_threads, set_step_threads, use_device, use_threads
from shared.metrics import VerifierMetrics
from shared.model import resident_bytes
from shared.model.registry import resolve_model
from shared.protocol import drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from shared.service import MAX_MESSAGE_BYTES, ServiceServer, require_model, run_until_signalled
from shared.tokenizer import load_tokenizer
from verifier_service.admission import Admission, AdmissionLimits, AdmissionRefused
from verifier_service.audit import HonestyAudit
from verifier_service.drafter_link import (DeadlineTracker, DrafterHealth, DrafterLink, draft_stub, drafter_channel,
                                          open_message)
from verifier_service.governor import Governor, GovernorSettings, Ledgers, Load
from verifier_service.engine import Engine
from verifier_service.lane import Lane
from verifier_service.loop import BatchSettings, EngineLoop, RoundsExhausted
from verifier_service.prefill import PrefillBatcher
from verifier_service.ranks import Ranks, engine_options, load_share, rank_threads
from verifier_service.records import Recorder, record_request
from verifier_service.request_rounds import RequestRounds, Running, merge_events, trace_context
from verifier_service.rounds import Session
from verifier_service.requests import RequestError, RequestSpec, parse_request
from verifier_service.settings import VerifierSettings
from verifier_service.stats import RequestStats, finish_span
from verifier_service.stops import Completion

log = structlog.get_logger("verifier")
RANK_LOST_EXIT = 70  # (EX_SOFTWARE) a follower rank ended under a serving verifier


class VerifierService(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, settings: VerifierSettings, model=None, tokenizer=None):
        self.settings = settings
        self.threads = rank_threads(settings) if settings.parallel > 1 else model_threads(
            settings.cpu_threads, device=settings.device, role="verifier", drafter=settings.drafter)
        self.worker = EngineLoop("verifier-model", BatchSettings(max_rounds=settings.max_sessions,
                                                                 gather_s=settings.batch_gather_ms / 1e3),
                                 on_step=self.metrics_step, on_drafting=self._drafting if self.threads.adapts else None,
                                 host_steps=settings.device == "cpu")
        self.model = model
        self.tokenizer = tokenizer
        self.ranks: Ranks | None = None  # the follower processes of a model split over processes
        self.ranks_stopping = False
        self.watchdog: asyncio.Task | None = None
        self.engine: Engine | None = None
        self.rounds: RequestRounds | None = None  # (once the engine is built)
        self.prefiller: PrefillBatcher | None = None
        self.admission = Admission(AdmissionLimits(settings.max_sessions, settings.max_queued, settings.queue_timeout_s))
        self.draining = False
        self.finish_by: float | None = None  # draining: requests end by then (time.monotonic())
        self.deadlines = DeadlineTracker(settings)
        self.draw_secret = settings.draw_secret.encode() if settings.draw_secret else secrets.token_bytes(32)
        self.audit = HonestyAudit()  # the drafter address's honesty in probabilistic mode
        self.governor_settings = GovernorSettings(min_hold=settings.governor_hold,
                                                  probe_share=settings.governor_probe_share)
        self.ledgers = Ledgers(self.governor_settings)  # what speculation realises lately, all requests, per load and kind
        self.metrics = VerifierMetrics()
        self.channel = drafter_channel(settings) if settings.drafter else None
        self.drafter = drafter_pb2_grpc.DrafterStub(self.channel) if self.channel else None
        self.draft_stub = draft_stub(settings, self.channel) if self.channel else None  # (Draft streams)
        # every finished request that may draft teaches the drafter's index of outputs its output
        self.recorder = Recorder(self.drafter, security.bearer_metadata(settings.drafter_token), self.metrics) \
            if self.drafter is not None else None
        self.metrics.queued.set_function(lambda: self.admission.queued)
        self.metrics.kv_blocks.set_function(lambda: self.admission.limits.kv_blocks)
        self.metrics.kv_blocks_held.set_function(lambda: self.admission.blocks_held)
        self.drafter_health = DrafterHealth(settings.drafter or "", self.metrics.drafter_reachable, log)
        self.metrics.drafter_reachable.set(-1 if self.channel is None else 0)
        self.metrics.engine_time(lambda: {state.value: s for state, s in self.worker.time_spent().items()})

    def _drafting(self, drafting: bool) -> None:
        """On the engine loop's thread: a drafter on this host works (or stopped): the native step
        yields it a core (torch's ops keep their count: shared/threads.py). Nothing here may
        raise into the loop."""
        set_step_threads(self.threads.drafting if drafting else self.threads.full)

    def metrics_step(self, num_rounds: int) -> None:
        self.metrics.batch_rounds.observe(num_rounds)

    @property
    def active(self) -> int:
        """Requests holding a session."""
        return self.admission.active

    def round_load(self) -> Load:
        """What a running request's rounds are measured under (its governor's ledger): alone, or
        beside other requests holding a session — decoding, or still in prefill (requests that
        arrive together share the steps from their first round, though their lanes join the
        engine loop one prefill at a time)."""
        return Load.of(self.admission.active - 1)

    async def probe_drafter(self, timeout_s: float = 3.0) -> None:
        """At start-up: say whether the drafter answers (and how the link is secured)."""
        s = self.settings
        try:
            await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:  # (a drafter without health checking answered)
                self.drafter_health.failed(f"start-up probe: {error.code().name}: {error.details()}")
                return
        self.drafter_health.ok()
        log.info("drafter reachable", drafter=s.drafter, tls=s.drafter_tls_ca is not None,
                 client_certificate=s.drafter_tls_cert is not None, token=s.drafter_token is not None)

    async def load(self) -> None:
        s = self.settings
        if self.threads.full is not None:  # (shared/threads.py: before any model work)
            await self.worker.run(use_threads, self.threads.full)  # (the engine loop's thread runs the ops)
            log.info("cpu threads", threads=self.threads.full, while_drafting=self.threads.drafting)
        group = None
        await self.worker.run(use_device, s.device)  # (rank 0 of a split model: its GPU is --device's)
        if s.parallel > 1:
            if self.model is not None:
                raise ValueError("parallel: a model handed in already loaded cannot be split over processes")
            self.ranks = Ranks(s)
            log.info("starting ranks", parallel=s.parallel, address=self.ranks.address)
            self.watchdog = asyncio.create_task(self._watch_ranks())  # (a follower that fails to start too)
            group = await self.worker.run(self.ranks.start)
        if self.model is None:
            path = resolve_model(s.model)
            log.info("loading model", path=str(path), device=s.device, dtype=s.dtype, quantize=s.quantize,
                     rank=None if group is None else f"0 of {s.parallel}")
            self.model = await self.worker.run(load_share, s, None if group is None else group.shard,
                                               s.device if group is None else group.device)
            self.tokenizer = load_tokenizer(path)
        self.engine = await self.worker.run(
            Engine, self.model, **engine_options(s, self.model), progress=lambda message: log.info(message),
            draw_secret=self.draw_secret, group=group,
        )
        plan = self.engine.kv_plan  # admission counts the pool's blocks from now on (no request ran yet)
        self.admission.limits = replace(self.admission.limits, kv_blocks=plan.num_blocks, kv_block_size=plan.block_size)
        self.worker.start(self.engine)
        self.rounds = RequestRounds(s, self.engine, self.worker, self.metrics, self.audit, self.draw_secret,
                                    streams_text=self.tokenizer is not None, round_load=self.round_load)
        self.prefiller = PrefillBatcher(self.worker, self.engine.prefill, s.prefill_chunk, on_job=self._prefill_job)
        self.metrics.model_bytes.set(model_bytes := resident_bytes(self.model))
        log.info("verifier ready", address=s.address, drafter=s.drafter, vocab=self.model.config.vocab_size,
                 path=self.engine.path, model_gib=round(model_bytes / 2**30, 3),
                 parallel=f"{s.parallel} ({s.parallel_dense} dense weights)" if s.parallel > 1 else None)
        if self.channel is not None:
            await self.probe_drafter()

    async def _watch_ranks(self, period_s: float = 1.0) -> None:
        """A follower that ended leaves rank 0 unable to finish any step: say so and leave, so the
        orchestrator restarts the verifier (requests in flight would otherwise wait forever)."""
        while True:
            await asyncio.sleep(period_s)
            dead = self.ranks.dead()
            if dead and not self.ranks_stopping:
                log.error("a follower rank ended; the verifier cannot step without it and exits", ranks=dead)
                os._exit(RANK_LOST_EXIT)

    def close_ranks(self) -> None:
        """At the end (off the event loop): the followers stop, rank 0 leaves the group."""
        if self.ranks is None:
            return
        self.ranks_stopping = True
        told = False
        if self.engine is not None:
            try:
                self.engine.shutdown()
                told = True
            except RuntimeError as error:  # (a follower already gone: nothing to tell it)
                log.warning("a follower rank could not be told to stop", ranks=self.ranks.dead(), error=str(error))
        self.ranks.stop(told=told)

    def _prefill_job(self, num_sessions: int, num_tokens: int) -> None:
        self.metrics.prefill_sessions.observe(num_sessions)
        self.metrics.prefill_tokens.inc(num_tokens)

    def _parse(self, request: verifier_pb2.GenerateRequest) -> RequestSpec:
        config = self.model.config
        return parse_request(
            request,
            settings=self.settings,
            tokenizer=self.tokenizer,
            vocab_size=config.vocab_size,
            max_context=self.engine.max_context,
            model_eos_ids=config.eos_token_ids,
            request_id=request.request_id or uuid.uuid4().hex,
        )

    async def Generate(
        self, request: verifier_pb2.GenerateRequest, context: grpc.aio.ServicerContext, parent=None
    ) -> AsyncIterator[verifier_pb2.GenerateEvent]:
        """parent: the caller's trace context where no gRPC instrumentation made it current
        (the local socket's metadata)."""
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry when health is SERVING")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is shutting down")
        try:  # off the event loop: tokenising a long text prompt must not stall other requests
            spec = await asyncio.to_thread(self._parse, request)
        except RequestError as error:
            refusal = error.code, error.message  # not the error: its traceback holds the request
        else:
            refusal = None
        if refusal is not None:
            del request  # not kept alive by the abort's traceback (see generate_raw)
            await context.abort(*refusal)
        asked_mode = spec.mode
        spec = self._verified_as(spec)
        arrived = time.perf_counter()
        kv_blocks = self.engine.kv_blocks(spec)
        try:
            queued_s = await self.admission.acquire(kv_blocks)
        except AdmissionRefused as refused:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused))
        if self.draining:  # it waited in the queue while the service began to stop
            self.admission.release(kv_blocks)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is shutting down")
        structlog.contextvars.bind_contextvars(request_id=spec.request_id)
        self.metrics.active.inc()
        link: DrafterLink | None = None
        governor: Governor | None = None
        opened: Session | None = None
        lane: Lane | None = None
        begun: asyncio.Future | None = None  # the next round's first half, under way
        completion: Completion | None = None
        tracer = telemetry.tracer("tandem.verifier")
        # The request's span is current only between yields, never while this generator is
        # suspended: gRPC may close it from another context (a client gone while an event
        # waits to be sent), where a context entered here could not be left.
        span = tracer.start_span("Generate", context=parent, attributes={"tandem.request_id": spec.request_id,
                                                         "tandem.mode": asked_mode.value,
                                                         "tandem.verified_as": spec.mode.value})
        try:
            with telemetry.use_span(span):
                stats = RequestStats(len(spec.prompt_ids), arrived, queued_s)
                span.set_attribute("tandem.queue_ms", queued_s * 1e3)
                with tracer.start_as_current_span("prefill", attributes={"tandem.prompt_tokens": len(spec.prompt_ids)}) \
                        as prefill_span:
                    session = opened = await self.worker.run(self.engine.begin, spec)
                    # Chunked and batched with other prompts: a job per chunk, rounds run between.
                    prefill_span.set_attribute("tandem.prefill_chunks", await self.prefiller.prefill(session))
                if self.drafter is not None and spec.speculate and self._may_draft(spec):
                    link = DrafterLink(self.draft_stub, self.deadlines, security.bearer_metadata(self.settings.drafter_token),
                                       self.drafter_health)
                governor = Governor(self.governor_settings, self.ledgers, drafting=link is not None,
                                    load=self.round_load(), sampled=not spec.sampling.greedy,
                                    max_tokens=spec.max_new_tokens) \
                    if self.settings.governor else None
                if link is not None and (governor is None or governor.next_speculates):  # else at its first probe
                    await link.open(open_message(session, 0, self.settings.draft_ahead), trace_context())
                completion = Completion(spec.max_new_tokens, spec.eos_token_ids, spec.stop_sequences, self.tokenizer)
            lane = self.worker.join(session)
            running = Running(session, lane, link, governor, completion, stats, num_tokens=len(session.token_ids))
            # A round's first half (its chain awaited, validated, handed to the engine loop) starts
            # as soon as the last round ended, before that round's event goes out: the device
            # does not wait for the event's way to the client.
            while running.may_go_on(self.finish_by):
                if begun is None:
                    begun = asyncio.ensure_future(self.rounds.begin_round(running, span))
                begun_round = await begun
                begun = None
                event = await self._ended(running, begun_round)
                # Plain rounds the loop already ran while this event was made go out with it: one
                # message for the run (the stream's writes, not the rounds, cost the host then).
                while (event is not None and self.rounds.next_is_ready_plain(running, event)
                       and running.may_go_on(self.finish_by)):
                    later = await self._ended(running, await self.rounds.begin_round(running, span))
                    if later is not None:
                        merge_events(event, later)
                if event is None:
                    break
                if running.may_go_on(self.finish_by):
                    begun = asyncio.ensure_future(self.rounds.begin_round(running, span))
                yield event
            faults = sum(v for k, v in (link.faults if link else {}).items() if k != "resync")
            message = stats.message(len(completion.token_ids), faults)
            if link is not None:
                message.ahead_hits, message.ahead_misses = link.ahead["hit"], link.ahead["miss"]
            if governor is not None:
                message.drafter_detaches = governor.detaches
            finish_span(span, message, completion.finish_reason)
            self.metrics.requests.labels(completion.finish_reason).inc()
            yield verifier_pb2.GenerateEvent(
                final=verifier_pb2.FinalEvent(finish_reason=completion.finish_reason, stats=message))
            log.info("request done", rounds=stats.rounds, tokens=len(completion.token_ids),
                     finish=completion.finish_reason, faults=link.faults if link else {})
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            self.metrics.requests.labels("cancelled").inc()
            log.info("request cancelled", tokens=len(completion.token_ids) if completion else 0)
            raise
        finally:
            if begun is not None:
                begun.cancel()
                with contextlib.suppress(BaseException):
                    await begun
            span.end()
            if lane is not None:
                lane.leave()
            if opened is not None:
                # On the loop's thread, behind any step of this session running there: a request
                # cancelled while its batch ran released its KV slot under that batch, which then
                # failed for every request in it (tests/verifier_service/test_concurrency.py).
                self.worker.submit(self.engine.close, opened)
            self.admission.release(kv_blocks)  # (the loop frees the blocks before any later begin)
            self.metrics.active.dec()
            if governor is not None:  # (cancelled requests too)
                governor.close()
                self.metrics.detaches.inc(governor.detaches)
                for why, count in governor.phases.items():
                    self.metrics.governor_phases.labels(why.value).inc(count)
            if link is not None:
                for kind, count in link.faults.items():
                    self.metrics.faults.labels(kind).inc(count)
                for outcome, count in link.ahead.items():
                    self.metrics.ahead.labels(outcome).inc(count)
                output = opened.token_ids[len(spec.prompt_ids):] if opened is not None else []
                if output:  # (its rounds drafted or not; a link means a drafter, hence a recorder)
                    with telemetry.use_span(span):  # (the drafter's record span joins the request's trace)
                        carrier = trace_context()
                    self.recorder.record(record_request(spec.request_id, spec.prompt_ids, output, carrier))
                await link.close()
            structlog.contextvars.unbind_contextvars("request_id")

    async def _ended(self, running: Running, begun_round) -> verifier_pb2.GenerateEvent | None:
        """A begun round's second half under its span (ended here), the round counted; None when the
        session decodes no more (a limit this coroutine did not see first: finish "length")."""
        try:
            with telemetry.use_span(begun_round.span):
                event = await self.rounds.end_round(running, begun_round)
        except RoundsExhausted:
            running.completion.finish_reason = "length"
            return None
        finally:
            begun_round.span.end()
        running.round_id += 1
        return event

    async def generate_raw(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[verifier_pb2.GenerateEvent]:
        """Generate over the wire: parse the request bytes, refusing malformed ones."""
        # After an abort, the frames it passed through stay alive until Python's next full
        # garbage collection (its traceback sits in a reference cycle), so no frame on the way
        # may hold the request: refused 10 MB requests would pile up (bench/flood.py).
        try:
            request = verifier_pb2.GenerateRequest.FromString(raw)
        except DecodeError as error:
            refusal = f"malformed GenerateRequest ({len(raw)} bytes): {error}"[:200]
        else:
            refusal = None
        del raw
        if refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        events = self.Generate(request, context)
        del request
        # aclosing: when the client goes away while this generator waits at its yield, the
        # inner one is closed here, in the request's own context — not later by the event
        # loop's finaliser in another (where its spans fail to detach and cleanup waits for GC)
        async with contextlib.aclosing(events) as events:
            async for event in events:
                yield event

    async def generate_local(self, requests: LocalContext, context: LocalContext) -> AsyncIterator[verifier_pb2.GenerateEvent]:
        """Generate over the local socket (`--local-socket`): the stream's one message is the
        request (parsed by the transport, a malformed one refused INVALID_ARGUMENT as on gRPC)."""
        request = await requests.read()
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the stream carried no GenerateRequest")
        parent = telemetry.extract_context(dict(context.metadata))  # (its trace's, as gRPC's instrumentation does)
        async with contextlib.aclosing(self.Generate(request, context, parent)) as events:
            del request
            async for event in events:
                yield event

    def _drafter_trusted(self) -> bool:
        """Whether the probabilistic rule may take this verifier's drafter at its word (DESIGN §10)."""
        s = self.settings
        authenticated = s.drafter_token is not None or s.drafter_tls_cert is not None
        return s.probabilistic_drafters == "any" or (s.probabilistic_drafters == "authenticated" and authenticated)

    def _verified_as(self, spec: RequestSpec) -> RequestSpec:
        """The request as its chains are verified: a probabilistic request with an untrusted
        drafter by the coupled exact rule (a draft is accepted only if it equals the target's own
        keyed draw, which the drafter is given to match), so no drafter can move its output law;
        decided once, at its start, from the settings alone."""
        if spec.mode != Mode.PROBABILISTIC or not spec.speculate or self.drafter is None or self._drafter_trusted():
            return spec
        return dataclasses.replace(spec, mode=Mode.EXACT, gate=Gate.TOP, coupled=True)

    def _may_draft(self, spec: RequestSpec) -> bool:
        """Exact mode may use any drafter; probabilistic mode (a trusted drafter) only one the
        honesty audit has not rejected."""
        return spec.mode != Mode.PROBABILISTIC or self.audit.rejected is None

class VerifierServer(ServiceServer):
    """A verifier on a real port: start(), wait_loaded(), stop(grace)."""

    service_name = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
    front_method = "Generate"

    def __init__(self, settings: VerifierSettings, *, model=None, tokenizer=None) -> None:
        token = security.BearerTokenInterceptor(settings.auth_token) if settings.auth_token else None
        super().__init__(settings, interceptors=[token] if token else [])
        self.service = VerifierService(settings, model=model, tokenizer=tokenizer)
        path = self.local_path()
        if path:  # (the same token, checked on a local stream's metadata)
            self.local = LocalStreamServer(path, self.service.generate_local, verifier_pb2.GenerateRequest,
                                           limit=MAX_MESSAGE_BYTES, check=token.check if token else None)
        self.offered_socket = path if path and self.offers_local() else ""  # (GetServerInfo's, on this host)

    def preflight(self) -> None:
        if self.service.model is None:
            require_model(self.settings.model)

    def register(self) -> None:
        # Generate takes raw bytes and parses them itself, so a malformed message is answered
        # INVALID_ARGUMENT (gRPC's own deserialiser would fail it as UNKNOWN).
        handler = grpc.unary_stream_rpc_method_handler(
            self.service.generate_raw, response_serializer=verifier_pb2.GenerateEvent.SerializeToString)
        info = grpc.unary_unary_rpc_method_handler(
            self.server_info, request_deserializer=verifier_pb2.GetServerInfoRequest.FromString,
            response_serializer=verifier_pb2.ServerInfo.SerializeToString)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(self.service_name, {"Generate": handler, "GetServerInfo": info}),))

    async def server_info(self, request: verifier_pb2.GetServerInfoRequest,
                          context: grpc.aio.ServicerContext) -> verifier_pb2.ServerInfo:
        """The local socket, for a caller on this host only (its path means nothing elsewhere)."""
        return verifier_pb2.ServerInfo(local_socket=self.offered_socket if is_local_peer(context.peer()) else "")

    async def load(self) -> None:
        await self.service.load()

    @property
    def metrics_registry(self):
        return self.service.metrics.registry

    def begin_drain(self, finish_by: float) -> None:
        """Refuse new requests; requests still running at `finish_by` end with finish reason
        "shutdown" and their final event."""
        self.service.draining = True
        self.service.finish_by = finish_by

    def in_flight(self) -> int:
        return self.service.active + self.service.admission.queued

    async def close(self) -> None:
        if self.service.prefiller is not None:
            await self.service.prefiller.close()
        if self.service.recorder is not None:
            await self.service.recorder.drain()
        if self.service.channel is not None:
            await self.service.channel.close()
        self.service.worker.shutdown()
        if self.service.watchdog is not None:
            self.service.watchdog.cancel()
        await asyncio.to_thread(self.service.close_ranks)


async def serve(settings: VerifierSettings) -> None:
    """Run until SIGTERM/SIGINT, then drain gracefully."""
    await run_until_signalled(lambda: VerifierServer(settings), "tandem-verifier")
