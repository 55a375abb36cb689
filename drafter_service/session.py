"""One request's drafting state: committed tokens, the MTP cache, the suffix index, the
planner snapshot taken at open, and the plan of the chain in flight (to learn from)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kernels.retention import RetentionPolicy
from kernels.sampling import DEFAULT_MAX_SUPPORT, SamplingParams
from kernels.speculative import Gate, Mode
from shared.protocol import common_pb2, drafter_pb2
from drafter_service.planner import Estimates, Plan
from drafter_service.proposers.mtp import MTPState
from drafter_service.proposers.suffix import SuffixIndex


@dataclass
class DraftSession:
    session_id: str
    sampling: SamplingParams
    seed: int
    mode: Mode
    gate: Gate
    coupled: bool
    policy: RetentionPolicy
    max_drafts: int
    snapshot: Estimates
    suffix: SuffixIndex
    mtp: MTPState | None
    round_id: int
    in_flight: Plan | None = None  # the plan of the last chain sent (learned from at commit)
    opened_with: int = 0  # committed tokens at open (the prompt): the rest is this session's output
    draft_ahead: bool = False  # the verifier takes chains drafted ahead, and this drafter sends them
    ahead: drafter_pb2.DraftChain | None = None  # the chain drafted ahead and sent, not yet judged
    ahead_plan: Plan | None = None
    chain_cap: int = 0  # the verifier's cap on the next chain (its load gate; 0: none)

    @property
    def tokens(self) -> list[int]:
        return self.suffix.tokens

    @property
    def chain_limit(self) -> int:
        """The most drafts the next chain may hold."""
        return min(self.max_drafts, self.chain_cap) if self.chain_cap else self.max_drafts


def session_params(message: drafter_pb2.DraftOpen) -> tuple[SamplingParams, Mode, Gate, RetentionPolicy]:
    """The request's sampling and speculation settings; ValueError naming a bad one."""
    s = message.sampling
    sampling = SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p, max_support=s.max_support or DEFAULT_MAX_SUPPORT,
    )
    spec = message.speculation
    mode = Mode.PROBABILISTIC if spec.mode == common_pb2.MODE_PROBABILISTIC else Mode.EXACT
    gate = Gate.PICK if spec.gate == common_pb2.GATE_PICK else Gate.TOP
    schedule = spec.retention.schedule or None
    policy = RetentionPolicy.parse(schedule, spec.retention.min_cum, min_p=sampling.min_p)
    return sampling, mode, gate, policy


class SessionStore:
    """Bounded sessions, least recently used evicted first.

    Sessions are held by identity (each belongs to the stream that opened it), never looked
    up by their session id: another stream opening the same id gets a session of its own and
    cannot take over or displace this one (issue 12, item 5)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._sessions: OrderedDict[int, DraftSession] = OrderedDict()
        self.evictions = 0

    def put(self, session: DraftSession) -> int:
        """Hold `session` (most recently used); returns how many sessions this evicted."""
        self._sessions[id(session)] = session
        self._sessions.move_to_end(id(session))
        evicted = 0
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)
            evicted += 1
        self.evictions += evicted
        return evicted

    def holds(self, session: DraftSession) -> bool:
        return self._sessions.get(id(session)) is session

    def touch(self, session: DraftSession) -> bool:
        """Whether `session` is still held (and mark it used)."""
        if not self.holds(session):
            return False
        self._sessions.move_to_end(id(session))
        return True

    def remove(self, session: DraftSession) -> None:
        if self.holds(session):
            del self._sessions[id(session)]

    def __len__(self) -> int:
        return len(self._sessions)
