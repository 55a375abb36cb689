"""A session's rounds in the engine loop (verifier_service.loop, whose docstring says how the
loop steps lanes; DESIGN §9, "The engine loop").

A lane is made by `EngineLoop.join` and used from the event loop: its coroutine hands in turns
(`turn`), grants plain rounds the loop runs on its own (`grant`), hands in a follower (`follow`)
and reads outcomes in round order (`outcome`). The rest runs on the loop's thread under the
loop's lock: whether the lane has a round ready (`_ready`), which (`_take`), and what a round's
outcome does to its follower (`_ran`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from verifier_service.rounds import RoundOutcome, RoundRequest

if TYPE_CHECKING:
    from verifier_service.loop import EngineLoop


class Lane:
    """One session's rounds in the loop. Made by EngineLoop.join; used from the event loop."""

    def __init__(self, loop: EngineLoop, session: Any, aloop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.session = session
        self._aloop = aloop
        self._outcomes: asyncio.Queue[RoundOutcome | BaseException] = asyncio.Queue()
        # guarded by the loop's lock:
        self._turns: deque[RoundRequest] = deque()  # rounds handed in, not yet run
        self._plain_left = 0  # granted plain rounds not yet run
        self._unread = 0  # outcomes run, not yet read
        self._committed = 0  # rounds run (every round: turns and granted ones, in order)
        self._follower: tuple[int, list[int], RoundRequest] | None = None  # (after round, assumed emitted, round)
        self._owed_s = 0.0  # lane-seconds the other lanes waited for this one (a step's gather), not yet charged
        # seconds this lane waited for other lanes (a step's gather) or other sessions' jobs (a
        # prefill chunk between its steps), not yet refunded
        self._waited_s = 0.0
        self._drafting = False  # its last round verified drafts (until a granted plain round): its drafter works
        self.left = False

    def turn(self, request: RoundRequest) -> None:
        """Hand in the lane's next round (after every granted one)."""
        if request.session is not self.session:
            raise ValueError("a lane runs its own session's rounds")
        with self._loop._cond:
            self._turns.append(request)
            self._loop._cond.notify()

    def follow(self, round_index: int, emitted: list[int], request: RoundRequest) -> bool:
        """Run `request` right after round `round_index` (counted from the lane's first round) if
        that round emits exactly `emitted`. False: too late (that round already ran), nothing
        is kept."""
        if request.session is not self.session:
            raise ValueError("a lane runs its own session's rounds")
        with self._loop._cond:
            # In a batch the other lanes keep the device busy, and a lane running ahead of them
            # splits the step they would share (H200, 8 sessions: 4.8 rounds a step against 7.0).
            if self.left or self._committed > round_index or len(self._loop._lanes) > 1:
                return False
            self._follower = (round_index, list(emitted), request)
            return True

    def grant(self, num_rounds: int) -> None:
        """Let the loop run `num_rounds` more plain rounds of this lane on its own."""
        if num_rounds < 0:
            raise ValueError(f"num_rounds {num_rounds} must be >= 0")
        if num_rounds:
            with self._loop._cond:
                self._plain_left += num_rounds
                self._loop._cond.notify()

    async def outcome(self) -> RoundOutcome:
        """The next round's outcome, in round order (a failed step raises its error)."""
        result = await self._outcomes.get()
        with self._loop._cond:
            self._unread -= 1
            if self._plain_left:  # a lane held by its lead may run again
                self._loop._cond.notify()
        if isinstance(result, BaseException):
            raise result
        return result

    def has_outcome(self) -> bool:
        """Whether the next outcome is waiting already (`outcome` returns without waiting)."""
        return not self._outcomes.empty()

    def leave(self) -> None:
        """The session runs no more rounds (idempotent); rounds not yet run are dropped."""
        with self._loop._cond:
            if not self.left:
                self.left = True
                self._turns.clear()
                self._plain_left = 0
                self._follower = None
                self._loop._lanes.pop(id(self.session), None)
                self._loop._cond.notify()

    # -- on the loop's thread, under its lock --

    def _ready(self, max_lead: int) -> bool:
        if self.left:
            return False
        if self._turns:
            return True
        return self._plain_left > 0 and self._unread < max_lead and self.session.may_decode()

    def _take(self) -> RoundRequest:
        self._unread += 1
        if self._turns:
            request = self._turns.popleft()
            self._drafting = self._drafting or bool(request.drafts)
            return request
        self._drafting = False
        self._plain_left -= 1
        # another granted round follows: enqueue its step before this one is read
        return RoundRequest(self.session, [], None, decode_ahead=self._plain_left > 0)

    def _ran(self, result: RoundOutcome | BaseException) -> None:
        """Under the loop's lock, when a round of this lane ran: its follower, if its round's
        outcome is what it assumed, becomes the next turn."""
        index = self._committed
        self._committed += 1
        follower, self._follower = self._follower, None
        if follower is None or self.left:
            return
        after, emitted, request = follower
        if after == index and not isinstance(result, BaseException) and list(result.emitted) == emitted:
            self._turns.appendleft(request)
        elif after > index:  # (for a later round)
            self._follower = follower

    def _deliver(self, result: RoundOutcome | BaseException) -> None:  # (on the event loop)
        self._outcomes.put_nowait(result)


def deliver_all(pairs: list[tuple[Lane, Any]]) -> None:
    """Each pair's outcome to its lane, unless it left (on the lanes' event loop)."""
    for lane, result in pairs:
        if not lane.left:
            lane._deliver(result)
