"""The verifier's side of one request's Draft stream, the per-round deadline, and the channel.

Every wait on the drafter is bounded: a chain that does not arrive before the round's
deadline costs one plain round. A stream that breaks (drafter killed, session evicted:
FAILED_PRECONDITION) is re-opened with the full committed context (re-sync) on the same
address — which may resolve to another replica — with an exponential backoff between
attempts (so an outage costs a few opens, and drafting resumes when the drafter is back).
The drafter is untrusted: at most MAX_QUEUED_CHAINS chains wait for the verifier; chains
for rounds already past are dropped on arrival and a flood pushes out the oldest (counted).

Draft-ahead (DESIGN §9): a chain may arrive before the commit it depends on, naming the
tokens it assumes the round emits. It is taken only if the committed tokens end with exactly
those (and its base length is the committed length); otherwise it is dropped and the chain
answering the commit is awaited. Hits and misses are counted (`ahead`), not as faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Callable

import grpc
import torch
from torch import Tensor

from shared import security
from shared.local_stream import LocalCall
from shared.protocol import PROTOCOL_VERSION, common_pb2, drafter_pb2, drafter_pb2_grpc, encode_hidden
from shared.service import MESSAGE_OPTIONS
from verifier_service.chains import max_chain_bytes
from verifier_service.rounds import RoundOutcome, Session
from verifier_service.settings import VerifierSettings

# Chains after a (re)open or a resume that get the deadline's upper bound and stay out of its
# history: the first pays the drafter's catch-up (MTP over the rounds it missed, when its
# chain needs MTP); the second may queue behind that catch-up when it ran after the chain.
LENIENT_CHAINS = 2
RESYNC_BACKOFF_S = (0.05, 5.0)  # first wait after a failed (re)open, and the cap it doubles up to
MAX_QUEUED_CHAINS = 4  # chains kept waiting for their round (the current one, or ahead of it)
HISTORY = 64
MIN_HISTORY = 8  # waits before the deadline adapts (until then: the upper bound)
# gRPC's own reconnect backoff grows to 120 s: a verifier started before its drafter (or left
# without one for a minute) then ignored a drafter that had come up for up to two minutes
# (bench/exact_identity.py on the H200: the first 38 of 64 requests, ~40 s, ran without
# drafts). Capped at the link's own re-sync backoff, a drafter that comes up is used within
# seconds.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", round(RESYNC_BACKOFF_S[1] * 1000))]
CHANNEL_OPTIONS = [*MESSAGE_OPTIONS, *RECONNECT_OPTIONS]


def drafter_channel(settings: VerifierSettings) -> grpc.aio.Channel:
    """One channel to the drafter address; round_robin spreads streams over resolved replicas."""
    config = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
    credentials = security.channel_credentials(settings.drafter_tls_ca, settings.drafter_tls_cert, settings.drafter_tls_key)
    # (a message larger than any valid chain is refused by gRPC before it is parsed: the stream
    # fails, the round goes plain, and the link reopens as after any broken stream)
    limit = max_chain_bytes(settings.max_draft_tokens_limit, settings.max_support_limit)
    options = [*[o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"],
               ("grpc.max_receive_message_length", limit), ("grpc.service_config", config)]
    return security.open_channel(settings.drafter, credentials, options)


class LocalDrafterStub:
    """The drafter's Draft streams over its Unix socket (shared.local_stream), in place of the
    gRPC stub's Draft: the link cannot tell them apart."""

    def __init__(self, path: str, limit: int) -> None:
        self.path, self.limit = path, limit

    def Draft(self, metadata=()) -> LocalCall:  # noqa: N802 (the gRPC stub's name)
        return LocalCall(self.path, drafter_pb2.DraftDown, metadata, self.limit)


def draft_stub(settings: VerifierSettings, channel: grpc.aio.Channel):
    """Where the link opens its Draft streams: the drafter's local socket, else its channel."""
    if settings.drafter_socket:
        return LocalDrafterStub(settings.drafter_socket, max_chain_bytes(settings.max_draft_tokens_limit,
                                                                         settings.max_support_limit))
    return drafter_pb2_grpc.DrafterStub(channel)


class DeadlineTracker:
    """Per-round chain deadline: fixed, or a margin above the recent p95 wait (shared by requests).

    The p95 is of model-drafted (MTP) chains and deadline misses once there are enough of
    them: suffix and empty chains — what a drafter sends when it sheds MTP drafts — come back
    at once, and their waits would shrink the deadline the next MTP chain gets, so that it
    is shed too (a loop measured with bench/drafter_load.py). Without that history (a drafter
    that only looks up suffixes) every wait counts."""

    def __init__(self, settings: VerifierSettings) -> None:
        self.settings = settings
        self.waits_ms: deque[float] = deque(maxlen=HISTORY)  # every chain's, and misses
        self.model_waits_ms: deque[float] = deque(maxlen=HISTORY)  # MTP chains' and misses

    def deadline_s(self, after_open: bool = False) -> float:
        """after_open: the first chain of a (re)opened stream, which also pays for the
        drafter's session setup (MTP catch-up over the whole context): it gets the upper
        bound, and its wait stays out of the p95 history."""
        s = self.settings
        if s.drafter_deadline_ms > 0:
            return s.drafter_deadline_ms / 1e3
        waits = self.model_waits_ms if len(self.model_waits_ms) >= MIN_HISTORY else self.waits_ms
        if after_open or len(waits) < MIN_HISTORY:
            return s.drafter_deadline_max_ms / 1e3
        ordered = sorted(waits)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return min(p95 + s.drafter_deadline_margin_ms, s.drafter_deadline_max_ms) / 1e3

    def record(self, wait_ms: float, *, model_drafted: bool = True) -> None:
        """A round's wait: model_drafted for an MTP chain or a deadline miss."""
        self.waits_ms.append(wait_ms)
        if model_drafted:
            self.model_waits_ms.append(wait_ms)


class DrafterHealth:
    """Whether the drafter answers, shared by every request: a metric, and one loud log line
    per distinct failure (a TLS mismatch or a wrong token would otherwise only show as
    requests running without drafts)."""

    def __init__(self, address: str, gauge, log) -> None:
        self.address = address
        self.gauge = gauge
        self.log = log
        self.logged: set[str] = set()

    def ok(self) -> None:
        self.gauge.set(1)

    def failed(self, reason: str) -> None:
        self.gauge.set(0)
        if reason not in self.logged and len(self.logged) < 32:
            self.logged.add(reason)
            self.log.warning("the drafter is unreachable or refuses streams: requests decode without drafts",
                             drafter=self.address, reason=reason[:300])


class DrafterLink:
    def __init__(self, stub: drafter_pb2_grpc.DrafterStub | LocalDrafterStub, deadlines: DeadlineTracker, metadata=(),
                 health: DrafterHealth | None = None) -> None:
        self.stub = stub
        self.health = health
        self.deadlines = deadlines
        self.metadata = tuple(metadata)
        self.call = None
        self.chains: deque[drafter_pb2.DraftChain] = deque()
        self.arrived = asyncio.Event()
        self.ahead = {"hit": 0, "miss": 0}  # chains drafted ahead: taken, dropped for a wrong assumption
        self.reader: asyncio.Task | None = None
        self.sending: asyncio.Task | None = None  # the last commit's write (writes go out in order)
        self.broken: str | None = "not opened"
        self.after_open = 0  # chains still due the lenient deadline (LENIENT_CHAINS after an open or resume)
        self.next_round = 0  # chains for earlier rounds are useless
        self.backoff_s = RESYNC_BACKOFF_S[0]
        self.retry_at = 0.0  # monotonic time before which no re-sync is attempted
        self.faults: dict[str, int] = {}
        # Rounds decoded without the drafter since its last commit (the governor detached it):
        # (round_id, emitted tokens, hidden rows), sent as one commit when it is asked again.
        self.held: list[tuple[int, list[int], Tensor]] = []

    def fault(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    @property
    def usable(self) -> bool:
        return self.broken is None

    async def open(self, message: drafter_pb2.DraftOpen, trace_context: dict[str, str] | None = None) -> int:
        """(Re)open the stream and send the full context; returns the bytes sent."""
        await self.close()
        self.chains = deque()
        self.held = []  # the open carries the whole context
        self.broken = None
        self.after_open = LENIENT_CHAINS
        self.call = self.stub.Draft(metadata=self.metadata)
        self.reader = asyncio.create_task(self._read(self.call))
        up = drafter_pb2.DraftUp(protocol_version=PROTOCOL_VERSION, open=message, trace_context=trace_context or {})
        await self._write(up)
        return up.ByteSize()

    async def resync(self, message_for_open: Callable[[], drafter_pb2.DraftOpen],
                     trace_context: Callable[[], dict[str, str]]) -> int:
        """Re-open a broken stream unless its backoff is still running; returns bytes sent. The
        open message (the whole context) is built only when it is sent.

        Each attempt doubles the wait before the next (up to RESYNC_BACKOFF_S[1]); a chain
        received on the stream resets it."""
        now = time.monotonic()
        if self.usable or now < self.retry_at:
            return 0
        self.retry_at = now + self.backoff_s
        self.backoff_s = min(2 * self.backoff_s, RESYNC_BACKOFF_S[1])
        self.fault("resync")
        return await self.open(message_for_open(), trace_context())

    def deliver(self, chain: drafter_pb2.DraftChain) -> None:
        """Queue a chain from the stream: stale ones are dropped, a full queue loses its oldest."""
        self.backoff_s = RESYNC_BACKOFF_S[0]  # the stream works
        if self.health is not None:
            self.health.ok()
        if chain.round_id < self.next_round:
            self._drop(chain)
            return
        if len(self.chains) >= MAX_QUEUED_CHAINS:
            self.chains.popleft()
            self.fault("chain_overflow")
        self.chains.append(chain)
        self.arrived.set()

    def _drop(self, chain: drafter_pb2.DraftChain) -> None:
        """A chain for a round already past: late (a fault), or drafted ahead for a round that
        did not wait for it (a miss)."""
        if chain.assumed_token_ids:
            self.ahead["miss"] += 1
        else:
            self.fault("stale_chain")

    def _take(self, round_id: int, token_ids: list[int]) -> drafter_pb2.DraftChain | None:
        """The first usable queued chain for `round_id` after the committed `token_ids`; drops
        the stale ones and those drafted ahead on a wrong assumption, keeps later rounds'."""
        kept: deque[drafter_pb2.DraftChain] = deque()
        found = None
        while self.chains:
            chain = self.chains.popleft()
            if found is not None or chain.round_id > round_id:
                kept.append(chain)
            elif chain.round_id < round_id:
                self._drop(chain)
            elif not chain.assumed_token_ids:
                found = chain
            elif chain.base_length == len(token_ids) and _ends_with(token_ids, chain.assumed_token_ids):
                self.ahead["hit"] += 1
                found = chain
            else:
                self.ahead["miss"] += 1
        self.chains = kept
        return found

    def take_ahead(self, round_id: int, base_length: int) -> drafter_pb2.DraftChain | None:
        """A chain drafted ahead for `round_id`, assuming tokens that follow `base_length`
        committed ones, if one has arrived (no wait); it leaves the queue."""
        for chain in self.chains:
            if (chain.round_id == round_id and chain.assumed_token_ids
                    and chain.base_length == base_length + len(chain.assumed_token_ids)):
                self.chains.remove(chain)
                return chain
        return None

    def put_back(self, chain: drafter_pb2.DraftChain) -> None:
        """A chain taken with take_ahead but not used: the round it is for takes it as usual."""
        self.chains.appendleft(chain)

    async def _read(self, call) -> None:
        try:
            async for message in call:
                if message.HasField("chain"):
                    self.deliver(message.chain)
            self.broken = "stream closed by the drafter"
        except grpc.aio.AioRpcError as error:
            self.broken = f"{error.code().name}: {error.details()}"
            if self.health is not None and error.code() != grpc.StatusCode.FAILED_PRECONDITION:  # (eviction: normal)
                self.health.failed(self.broken)
        except asyncio.CancelledError:
            self.broken = "closed"
            raise
        self.fault("stream_lost")
        self.arrived.set()  # a round waiting for a chain stops waiting: none will come

    async def _write(self, message: drafter_pb2.DraftUp) -> None:
        try:
            await self.call.write(message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
            self.broken = f"write failed: {error}"
            self.fault("stream_lost")

    async def commit(self, message: drafter_pb2.DraftCommit, trace_context: dict[str, str] | None = None,
                     at_once: bool = False) -> int:
        """Send a round's outcome; returns the bytes sent (0 when the stream is down). at_once: on
        a same-host stream, written before this returns where that needs no waiting."""
        if not self.usable:
            return 0
        # how long the next chain will be waited for (what the drafter sheds MTP drafts by)
        message.wait_ms = self.deadlines.deadline_s(after_open=self.after_open > 0) * 1e3
        up = drafter_pb2.DraftUp(protocol_version=PROTOCOL_VERSION, commit=message, trace_context=trace_context or {})
        # at_once (a request alone): the commit leaves before the round's event is written, not
        # behind it. In a batch a task writes it: the step's outcomes wake every request's
        # coroutine first, so the step's commits leave together, after all of them — late, but
        # as one batch for a drafter that batches its MTP work (drafter_service/batcher.py
        # takes what queued while its last job ran; commits one by one would start a job of one).
        # Not awaited: the round goes on while the write completes; the next write waits for it.
        if at_once and (self.sending is None or self.sending.done()) and self._write_nowait(up):
            self.sending = None
        else:
            self.sending = asyncio.ensure_future(self._write_after(self.sending, up))
        return up.ByteSize()

    def _write_nowait(self, message: drafter_pb2.DraftUp) -> bool:
        write = getattr(self.call, "write_nowait", None)  # (shared.local_stream.LocalCall; not gRPC's calls)
        return write is not None and write(message)

    async def flush(self) -> None:
        """Wait until every commit queued so far is written (or the stream broke)."""
        if self.sending is not None:
            await self.sending

    async def _write_after(self, previous: asyncio.Task | None, message: drafter_pb2.DraftUp) -> None:
        if previous is not None:
            await previous
        if self.usable:
            await self._write(message)

    async def ask(self, message_for_open: Callable[[], drafter_pb2.DraftOpen],
                  trace_context: Callable[[], dict[str, str]]) -> int:
        """Before a round that waits for a chain: open the stream at the request's first probe (it
        started plain), or re-open a broken one (`resync`); returns the bytes sent."""
        if self.call is None:
            return await self.open(message_for_open(), trace_context())
        return await self.resync(message_for_open, trace_context)

    async def tell(self, round_id: int, outcome: RoundOutcome, num_verified: int, ask_next: bool,
                   trace_context: Callable[[], dict[str, str]], draft_cap: int = 0, at_once: bool = False) -> int:
        """After a round: its commit when the next round asks for a chain, else held; held rounds
        go out with it as one commit (`resume`). draft_cap: the most drafts the next chain may
        hold (0: the session's limit); at_once: see `commit`. Returns the bytes sent."""
        if not ask_next or self.held:
            self.hold(round_id, outcome.emitted, outcome.hidden_rows)
            return await self.resume(trace_context(), draft_cap) if ask_next else 0
        return await self.commit(drafter_pb2.DraftCommit(
            round_id=round_id, num_accepted=outcome.num_accepted, emitted_token_ids=outcome.emitted,
            hidden=encode_hidden(outcome.hidden_rows), num_verified=num_verified,
            verify_ms=outcome.forward_ms + outcome.verify_ms, max_draft_tokens=draft_cap,
        ), trace_context(), at_once)

    def hold(self, round_id: int, emitted: list[int], hidden_rows: Tensor) -> None:
        """A round the drafter is not told about now (the next round decodes without it)."""
        if self.usable:
            self.held.append((round_id, list(emitted), hidden_rows))

    async def resume(self, trace_context: dict[str, str] | None = None, draft_cap: int = 0) -> int:
        """Tell the drafter every round it missed, as one commit; returns the bytes sent. Its
        next chain pays for catching up on them, so it gets the first chain's deadline."""
        if not self.held:
            return 0
        held, self.held = self.held, []
        emitted = [token for _, tokens, _ in held for token in tokens]
        hidden = torch.cat([rows for _, _, rows in held])
        self.after_open = LENIENT_CHAINS
        return await self.commit(drafter_pb2.DraftCommit(
            round_id=held[-1][0], num_rounds=len(held), emitted_token_ids=emitted, hidden=encode_hidden(hidden),
            max_draft_tokens=draft_cap,
        ), trace_context)

    async def next_chain(self, round_id: int, token_ids: list[int]) -> tuple[drafter_pb2.DraftChain | None, float]:
        """The chain for `round_id` after the committed `token_ids`, or None at the deadline."""
        if not self.usable:
            return None, 0.0
        self.next_round = round_id
        started = time.perf_counter()
        first = self.after_open > 0
        self.after_open = max(self.after_open - 1, 0)
        deadline = started + self.deadlines.deadline_s(after_open=first)
        while (chain := self._take(round_id, token_ids)) is None:
            if not self.usable:  # the stream broke (refused, or the drafter went away): decode plainly now
                return None, (time.perf_counter() - started) * 1e3
            remaining = deadline - time.perf_counter()
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout=max(remaining, 0.0))
            except TimeoutError:
                waited = (time.perf_counter() - started) * 1e3
                if not first:
                    self.deadlines.record(waited)
                self.fault("deadline")
                return None, waited
        waited = (time.perf_counter() - started) * 1e3
        if not first:
            self.deadlines.record(waited, model_drafted=chain.source == common_pb2.DRAFT_SOURCE_MTP)
        return chain, waited

    async def close(self) -> None:
        if self.sending is not None:  # (the writes already queued go out before the stream ends)
            sending, self.sending = self.sending, None
            with contextlib.suppress(Exception):
                await sending
        if self.call is not None:
            try:
                await self.call.done_writing()
            except Exception:  # the stream may already be gone
                pass
            self.call.cancel()
            self.call = None
        if self.reader is not None:
            self.reader.cancel()
            try:
                await self.reader
            except (asyncio.CancelledError, Exception):
                pass
            self.reader = None


def _ends_with(token_ids: list[int], tail) -> bool:
    return len(tail) <= len(token_ids) and token_ids[len(token_ids) - len(tail):] == list(tail)


def open_message(session: Session, round_id: int, draft_ahead: bool = True) -> drafter_pb2.DraftOpen:
    """The DraftOpen of a session: its committed tokens and hidden rows, sampling and speculation
    settings (opening a stream, or a re-sync)."""
    spec = session.spec
    s = spec.sampling
    return drafter_pb2.DraftOpen(
        session_id=spec.request_id,
        token_ids=session.token_ids,
        sampling=common_pb2.SamplingParams(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=spec.seed,
            max_support=s.max_support,
        ),
        speculation=common_pb2.SpeculationParams(
            mode=common_pb2.MODE_PROBABILISTIC if spec.mode.value == "probabilistic" else common_pb2.MODE_EXACT,
            gate=common_pb2.GATE_PICK if spec.gate.value == "pick" else common_pb2.GATE_TOP,
            max_draft_tokens=spec.max_draft_tokens,
            retention=common_pb2.RetentionParams(schedule=spec.retention_schedule, min_cum=spec.retention_min_cum),
            coupled=spec.coupled,
        ),
        max_new_tokens=spec.max_new_tokens,
        hidden=encode_hidden(session.hidden()) if session.hidden_rows else drafter_pb2.HiddenRows(),
        max_draft_tokens=spec.max_draft_tokens,
        next_round_id=round_id,
        draft_ahead=draft_ahead,
    )
