"""A request's rounds, as its coroutine runs them (DESIGN §1, §9): the first half of a round
(the drafter's chain awaited within its deadline, validated, retained, handed to the engine
loop, the rounds the governor knows are plain granted to it), the second half (the outcome
read, the tokens streamed, the commit told to the drafter, metrics and the round's span).

The Generate handler (verifier_service/server.py) starts a round's first half as soon as the
last round ended, before that round's event goes out. While a verify round of a request alone
in the loop runs, the chain the drafter drafted ahead for the next round is handed to the loop
as its follower (verifier_service/loop.py: it runs only if the round emitted what the chain
assumed), in exact mode only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from kernels.speculative import Gate, Mode
from shared import telemetry
from shared.metrics import VerifierMetrics
from shared.protocol import common_pb2, drafter_pb2, encode_logprobs, verifier_pb2
from verifier_service.audit import HonestyAudit, accept_key
from verifier_service.chains import ChainFault, retain, validate_chain
from verifier_service.drafter_link import DrafterLink, open_message
from verifier_service.engine import Engine
from verifier_service.governor import Governor, Load
from verifier_service.lane import Lane
from verifier_service.loop import EngineLoop
from verifier_service.rounds import RoundOutcome, RoundRequest, Session
from verifier_service.settings import VerifierSettings
from verifier_service.stats import RequestStats
from verifier_service.stops import Completion

log = structlog.get_logger("verifier")
SOURCE_ENUM = {"MTP": common_pb2.DRAFT_SOURCE_MTP, "SUFFIX": common_pb2.DRAFT_SOURCE_SUFFIX, "NONE": common_pb2.DRAFT_SOURCE_NONE}


@dataclass
class Begun:
    """A round's first half (VerifierService._begin_round): its chain, handed to the engine loop."""

    span: object  # the round's span (ended by the Generate loop)
    started: float
    speculate: bool
    raw: drafter_pb2.DraftChain | None
    chain: object  # the validated, retained chain (verifier_service.chains), or None
    proposed: int  # drafts the drafter sent (0: none, or an invalid chain)
    wait_ms: float
    bytes_up: int
    load: Load = Load.ALONE  # the load its governor decides for (else: under which it began)
    followed: bool = False  # it ran as the follower of the round before (its chain came with that round's)


@dataclass
class Follower:
    """The next round, handed to the engine loop before this one's outcome (Lane.follow): it
    runs if this round emits `emitted` (what the drafter's chain drafted ahead assumed)."""

    round_id: int  # the round it follows
    emitted: list[int]
    raw: drafter_pb2.DraftChain
    chain: object  # validated, retained
    proposed: int
    ran: bool = False  # (known once the round it follows is read)


@dataclass
class Running:
    """A request past its prefill, as its rounds see it."""

    session: Session
    lane: Lane
    link: DrafterLink | None
    governor: Governor | None
    completion: Completion
    stats: RequestStats
    round_id: int = 0  # the next round's
    granted_until: int = 0  # rounds before this one are granted to the engine loop (plain)
    num_tokens: int = 0  # committed tokens this coroutine has read (prompt and completion)
    follower: Follower | None = None

    def may_go_on(self, finish_by: float | None) -> bool:
        """Whether another round may start (else the completion's finish reason says why)."""
        completion = self.completion
        if completion.finish_reason is not None:
            return False
        if self.num_tokens - 1 >= self.session.cache.max_length:  # (the cache holds all but the head)
            completion.finish_reason = "length"
        elif finish_by is not None and time.monotonic() >= finish_by:
            completion.finish_reason = "shutdown"  # the service is stopping
        return completion.finish_reason is None

    def plain_ahead(self) -> int | None:
        """Rounds after the current one that will certainly be plain (None: all)."""
        if self.link is None:
            return None
        return self.governor.plain_ahead() if self.governor is not None else 0


def trace_context() -> dict[str, str]:
    """The current span's context, for a message to the drafter."""
    carrier: dict[str, str] = {}
    telemetry.inject_context(carrier)
    return carrier


class RequestRounds:
    """The rounds of every request of one verifier (what they share: settings, the engine and
    its loop, metrics, the honesty audit, the draws' secret)."""

    def __init__(self, settings: VerifierSettings, engine: Engine, loop: EngineLoop, metrics: VerifierMetrics,
                 audit: HonestyAudit, draw_secret: bytes, streams_text: bool,
                 round_load: Callable[[], Load]) -> None:
        self.settings = settings
        self.engine = engine
        self.loop = loop
        self.metrics = metrics
        self.audit = audit
        self.draw_secret = draw_secret
        self.streams_text = streams_text  # (a tokenizer: events carry text deltas)
        self.round_load = round_load  # what a round begins under (VerifierService.round_load)

    def _audited(self, chain, session: Session, link: DrafterLink):
        """The chain if probabilistic mode may use it; its draws feed the honesty audit."""
        spec = session.spec
        if chain is None or spec.mode != Mode.PROBABILISTIC:
            return chain
        if self.audit.rejected is not None:  # decided before this chain's own draws are seen
            link.fault("audit_rejected")
            return None
        if chain.q_rows is not None and spec.gate == Gate.TOP:
            key = accept_key(self.draw_secret, spec.seed)
            if self.audit.observe_drafts(spec.seed, key, len(session.token_ids), chain.token_ids, chain.q_rows):
                log.warning("drafter rejected for probabilistic rounds by the honesty audit",
                            drafter=self.settings.drafter, reason=self.audit.rejected)
                self.metrics.faults.labels("audit_rejected").inc()
        return chain

    async def begin_round(self, running: Running, parent) -> Begun:
        """A round's first half: chain (bounded wait) → validate → retain → hand the round to the
        engine loop. A round granted to the loop (plain) only opens here: the loop runs it."""
        if not telemetry.traced(parent):  # tracing off: the request's no-op span stands for the round's
            return await self._begin_round_in(running, parent)
        span = telemetry.start_light_span("tandem.verifier", "round", parent, {"tandem.round_id": running.round_id})
        try:
            with telemetry.use_span(span):
                return await self._begin_round_in(running, span)
        except BaseException:
            span.end()
            raise

    async def _begin_round_in(self, running: Running, span) -> Begun:
        session, link, governor = running.session, running.link, running.governor
        spec, round_id = session.spec, running.round_id
        started = time.perf_counter()
        granted = round_id < running.granted_until
        load = self.round_load()
        # (a request without a drafter still runs the governor: its rounds teach the server the plain cost)
        speculate = (governor.begin(started, load) if governor is not None else True) and link is not None
        if governor is not None:
            load = governor.load  # (what its decisions follow: a load changes after a streak of rounds)
        if granted and speculate:
            raise RuntimeError(f"round {round_id} was granted as plain, but the governor speculates")
        follower, running.follower = running.follower, None
        if follower is not None and follower.ran:  # the loop runs it already
            if not speculate:
                raise RuntimeError(f"round {round_id} followed its chain drafted ahead, but the governor decodes plainly")
            link.next_round = round_id
            self._grant(running)
            return Begun(span, started, True, follower.raw, follower.chain, follower.proposed, 0.0, 0, load, followed=True)
        chain, raw, wait_ms, bytes_up = None, None, 0.0, 0
        if speculate:
            bytes_up += await link.ask(lambda: open_message(session, round_id, self.settings.draft_ahead), trace_context)
            raw, wait_ms = await link.next_chain(round_id, session.token_ids)
            if raw is not None:
                chain = self._checked(raw, session, round_id, link)
        proposed = chain.proposed if chain else 0
        if chain is not None:
            chain = retain(chain, mode=spec.mode, gate=spec.gate, policy=spec.retention,
                           limit=min(spec.max_draft_tokens, session.capacity_left))
            chain = self._audited(chain, session, link)
        if not granted:
            running.lane.turn(RoundRequest(session, chain.token_ids if chain else [], chain.q_rows if chain else None))
        self._grant(running)
        return Begun(span, started, speculate, raw, chain, proposed, wait_ms, bytes_up, load)

    @staticmethod
    def _grant(running: Running) -> None:
        """Rounds the governor already knows will be plain go to the loop now: it runs the next
        one as soon as this one is committed (its step enqueued before this one is read)."""
        round_id = running.round_id
        ahead = running.plain_ahead()
        left = running.session.spec.max_new_tokens - len(running.completion.token_ids) - 1  # (what the next rounds may stream)
        until = round_id + 1 + (left if ahead is None else min(ahead, left))
        if until > running.granted_until:
            running.lane.grant(until - max(running.granted_until, round_id + 1))
            running.granted_until = until

    def _may_follow(self, running: Running, begun: Begun) -> bool:
        """Whether the round after this verify round may be handed in before its outcome: exact
        mode (probabilistic chains feed the honesty audit as they are used), the request alone in
        the engine loop, the next round asks the drafter too."""
        spec = running.session.spec
        return (self.settings.draft_ahead and begun.chain is not None and spec.mode == Mode.EXACT
                and self.loop.num_lanes == 1  # (Lane.follow: in a batch, lanes do not follow)
                and running.link is not None and running.link.usable
                and (running.governor is None or running.governor.next_speculates))

    def _follow(self, running: Running) -> bool:
        """Hand the loop the next round, from a chain drafted ahead if one has arrived; whether
        the chain was taken (handed in, or dropped as invalid or too late)."""
        session, link, round_id = running.session, running.link, running.round_id
        spec = session.spec
        raw = link.take_ahead(round_id + 1, running.num_tokens)
        if raw is None:
            return False
        emitted = list(raw.assumed_token_ids)
        chain = self._checked(raw, session, round_id + 1, link, base_length=raw.base_length)
        if chain is None:  # (invalid, or empty)
            return True
        capacity = session.cache.max_length - running.num_tokens - len(emitted)  # (after this round: all but its head)
        proposed = chain.proposed
        chain = retain(chain, mode=spec.mode, gate=spec.gate, policy=spec.retention,
                       limit=min(spec.max_draft_tokens, capacity))
        if chain.token_ids and running.lane.follow(round_id, emitted,
                                                   RoundRequest(session, chain.token_ids, chain.q_rows)):
            running.follower = Follower(round_id, emitted, raw, chain, proposed)
        else:  # too late (the round ran already): the next round takes it as any chain drafted ahead
            link.put_back(raw)  # (a drafter whose assumption held sends no other chain for that round)
        return True

    async def _outcome(self, running: Running, begun: Begun) -> RoundOutcome:
        """This round's outcome; meanwhile, where it may, the next round is handed to the loop as
        soon as the drafter's chain drafted ahead for it arrives (DESIGN §9)."""
        lane, link = running.lane, running.link
        if not self._may_follow(running, begun) or self._follow(running):
            return await lane.outcome()
        outcome = asyncio.ensure_future(lane.outcome())
        try:
            while not outcome.done() and link.usable:
                link.arrived.clear()
                arrived = asyncio.ensure_future(link.arrived.wait())
                await asyncio.wait((outcome, arrived), return_when=asyncio.FIRST_COMPLETED)
                arrived.cancel()
                if not outcome.done() and self._follow(running):
                    break
            return await outcome
        except BaseException:
            outcome.cancel()
            raise

    async def end_round(self, running: Running, begun: Begun) -> verifier_pb2.GenerateEvent:
        """A round's second half: its outcome → stream it, tell the drafter; the round's event."""
        session, link, governor, completion, stats = \
            running.session, running.link, running.governor, running.completion, running.stats
        spec, round_id = session.spec, running.round_id
        speculate, chain, proposed, bytes_up = begun.speculate, begun.chain, begun.proposed, begun.bytes_up
        drafts = chain.token_ids if chain else []
        outcome = await self._outcome(running, begun)
        running.num_tokens += len(outcome.emitted)
        follower = running.follower
        if follower is not None:  # (the loop made the same comparison)
            follower.ran = list(outcome.emitted) == follower.emitted
            link.ahead["hit" if follower.ran else "miss"] += 1
        source = chain.source if chain else "NONE"
        tokens, delta = completion.extend(outcome.emitted)
        # committed: the tokens delivered, and the eos or stop token that ended the request
        stats.round(source, proposed, len(drafts), outcome.num_accepted, len(tokens) + (completion.finish_reason == "stop"),
                    speculative=speculate)
        if tokens and stats.first_token_at is None:
            stats.first_token_at = time.perf_counter()
            self.metrics.ttft_seconds.observe(stats.first_token_at - stats.started)
        if governor is not None:
            governor.end(len(outcome.emitted), outcome.cost_to_others_s, outcome.cost_from_others_s)
        if link is not None and completion.finish_reason is None:  # (told when it is next asked, if not now)
            ask_next = governor is None or governor.next_speculates
            bytes_up += await link.tell(round_id, outcome, outcome.num_verified, ask_next, trace_context,
                                        at_once=self.loop.num_lanes == 1)
        self._observe(begun, outcome, source, len(drafts), tokens, bytes_up, spec.max_draft_tokens)
        verify_ms = outcome.forward_ms + outcome.verify_ms
        return verifier_pb2.GenerateEvent(
            token_ids=tokens,
            text_delta=delta if self.streams_text else None,  # set: the client knows text is streamed
            logprobs=encode_logprobs(outcome.logprobs, len(tokens)) if outcome.logprobs is not None else None,
            round=verifier_pb2.RoundInfo(
                round_id=round_id, source=SOURCE_ENUM[source], proposed=proposed, retained=len(drafts),
                accepted=outcome.num_accepted, verify_ms=verify_ms, draft_wait_ms=begun.wait_ms, speculative=speculate,
            ),
        )

    @staticmethod
    def next_is_ready_plain(running: Running, event: verifier_pb2.GenerateEvent) -> bool:
        """Whether the round after a plain round's `event` is granted and its outcome already
        waits: its tokens may go out in the same event (merge_events)."""
        return (not event.round.speculative and running.round_id < running.granted_until
                and running.follower is None and running.lane.has_outcome())

    def _observe(self, begun: Begun, outcome: RoundOutcome, source: str, retained: int, tokens: list[int],
                 bytes_up: int, max_drafts: int) -> None:
        """A round's metrics and span attributes."""
        raw, wait_ms = begun.raw, begun.wait_ms
        draft_ms = raw.costs.draft_ms if raw is not None else 0.0
        self.metrics.round_done(tokens=len(tokens), emitted=len(outcome.emitted), seconds=time.perf_counter() - begun.started,
                                speculative=begun.speculate, source=source, retained=retained,
                                accepted=outcome.num_accepted, slot_hit_rate=self.engine.slot_hit_rate())
        if not begun.span.is_recording():  # (tracing off: no attributes to build, a round at a time)
            return
        begun.span.set_attributes({
            "tandem.speculative": begun.speculate, "tandem.load": begun.load.value, "tandem.followed": begun.followed,
            "tandem.source": source,
            "tandem.proposed": begun.proposed, "tandem.retained": retained,
            "tandem.verified": outcome.num_verified, "tandem.accepted": outcome.num_accepted,
            "tandem.emitted": len(outcome.emitted),
            "tandem.confidences": list(raw.confidences[:max_drafts]) if raw is not None else [],
            "tandem.draft_ms": draft_ms, "tandem.rpc_ms": max(wait_ms - draft_ms, 0.0), "tandem.wait_ms": wait_ms,
            "tandem.verify_ms": outcome.forward_ms + outcome.verify_ms, "tandem.bytes_up": bytes_up,
            "tandem.cost_to_others_ms": outcome.cost_to_others_s * 1e3,
            "tandem.cost_from_others_ms": outcome.cost_from_others_s * 1e3,
            "tandem.bytes_down": raw.ByteSize() if raw is not None else 0,
            "tandem.drafter_slot_misses": raw.costs.expert_slot_misses if raw is not None else 0,
            "tandem.verifier_slot_misses": outcome.slot_misses,
        })

    def _checked(self, raw: drafter_pb2.DraftChain, session: Session, round_id: int, link: DrafterLink,
                 base_length: int | None = None):
        """The chain validated for round `round_id` after `base_length` committed tokens (default:
        the session's), None when empty or invalid (a fault, logged)."""
        spec = session.spec
        try:
            return validate_chain(
                raw, round_id=round_id, base_length=len(session.token_ids) if base_length is None else base_length,
                vocab_size=self.engine.vocab_size,
                max_drafts=spec.max_draft_tokens, max_support=spec.sampling.max_support,
            )
        except ChainFault as fault:
            link.fault("invalid_chain")
            log.warning("dropped draft chain", request_id=spec.request_id, round_id=round_id, reason=str(fault))
            return None


def merge_events(event: verifier_pb2.GenerateEvent, later: verifier_pb2.GenerateEvent) -> None:
    """Append the next plain round's event to `event` (one message for both; RoundInfo.num_rounds
    counts them, round_id stays the first's, the times add up)."""
    event.token_ids.extend(later.token_ids)
    if later.HasField("text_delta"):
        event.text_delta = event.text_delta + later.text_delta
    event.logprobs.extend(later.logprobs)
    first, second = event.round, later.round
    first.num_rounds = max(first.num_rounds, 1) + max(second.num_rounds, 1)
    first.proposed += second.proposed
    first.retained += second.retained
    first.accepted += second.accepted
    first.verify_ms += second.verify_ms
    first.draft_wait_ms += second.draft_wait_ms
    first.speculative = first.speculative or second.speculative
