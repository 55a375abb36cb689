"""Admission: a fixed number of sessions run, a bounded FIFO queue waits, the rest are refused.

Sessions are the verifier's capacity (each holds a KV slot allocated when the service
starts, so admitting never allocates). Up to `max_sessions` requests run; up to `max_queued`
more wait in arrival order, each at most `timeout_s`; a request beyond that, or one whose
wait runs out, is refused with a message naming the limit. A finished request hands its
session straight to the oldest waiter.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass


class AdmissionRefused(Exception):
    """No session for this request (the message says which limit)."""


@dataclass(frozen=True)
class AdmissionLimits:
    max_sessions: int
    max_queued: int
    timeout_s: float

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions {self.max_sessions} must be >= 1")
        if self.max_queued < 0:
            raise ValueError(f"max_queued {self.max_queued} must be >= 0")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"queue timeout {self.timeout_s!r} must be finite and > 0")


class Admission:
    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self) -> float:
        """Wait for a session; returns the seconds spent queued. Raises AdmissionRefused."""
        limits = self.limits
        if self.active < limits.max_sessions and not self.queued:
            self.active += 1
            return 0.0
        if self.queued >= limits.max_queued:
            raise AdmissionRefused(
                f"too many sessions: {self.active} in flight (max_sessions = {limits.max_sessions}) and "
                f"{self.queued} queued (max_queued = {limits.max_queued})")
        loop = asyncio.get_running_loop()
        granted = loop.create_future()
        self._waiters.append(granted)
        started = loop.time()
        try:
            async with asyncio.timeout(limits.timeout_s):
                await granted
        except TimeoutError:
            if not self._holds(granted):
                raise AdmissionRefused(
                    f"no session within {limits.timeout_s:g} s in the queue (queue_timeout_s; max_sessions = "
                    f"{limits.max_sessions}, all in flight)") from None
        except asyncio.CancelledError:
            if self._holds(granted):  # handed a session as the caller gave up: pass it on
                self.release()
            raise
        return loop.time() - started

    def _holds(self, granted: asyncio.Future) -> bool:
        """Whether `granted` was handed a session (else it leaves the queue)."""
        if granted.done() and not granted.cancelled():
            return True
        granted.cancel()
        try:
            self._waiters.remove(granted)
        except ValueError:
            pass
        return False

    def release(self) -> None:
        """A session ends: the oldest waiter takes it over, or it becomes free."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1
