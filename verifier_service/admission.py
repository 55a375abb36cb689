"""Admission: sessions and KV blocks run, a bounded FIFO queue waits, the rest are refused.

A request runs while it holds a session and the KV blocks of its whole length (prompt +
completion + one window, shared.model.kv_cache), so a request admitted never runs out of KV
memory mid-way. Up to `max_sessions` requests run, within the pool's `kv_blocks`; up to
`max_queued` more wait in arrival order, each at most `timeout_s`; a request beyond that,
one whose wait runs out, or one larger than the whole pool is refused with a message naming
the limit. A finished request hands what it held to the oldest waiters that now fit (the
oldest first: a large request is not overtaken for ever by small ones).
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
    kv_blocks: int = 0  # blocks of the KV pool (0: not counted)
    kv_block_size: int = 1  # positions per block (for messages)

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions {self.max_sessions} must be >= 1")
        if self.max_queued < 0:
            raise ValueError(f"max_queued {self.max_queued} must be >= 0")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"queue timeout {self.timeout_s!r} must be finite and > 0")
        if self.kv_blocks < 0 or self.kv_block_size < 1:
            raise ValueError(f"kv_blocks {self.kv_blocks} must be >= 0 and kv_block_size {self.kv_block_size} >= 1")


@dataclass(eq=False)
class _Waiter:
    granted: asyncio.Future
    blocks: int


class Admission:
    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.active = 0
        self.blocks_held = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.granted.done())

    def _fits(self, blocks: int) -> bool:
        limits = self.limits
        return self.active < limits.max_sessions and (
            not limits.kv_blocks or self.blocks_held + blocks <= limits.kv_blocks)

    def _take(self, blocks: int) -> None:
        self.active += 1
        self.blocks_held += blocks

    async def acquire(self, blocks: int = 0) -> float:
        """Wait for a session and `blocks` KV blocks; returns the seconds spent queued. Raises
        AdmissionRefused."""
        limits = self.limits
        if limits.kv_blocks and blocks > limits.kv_blocks:
            raise AdmissionRefused(
                f"the request needs {blocks} KV blocks ({blocks * limits.kv_block_size} positions: prompt + "
                f"max_new_tokens + a window of drafts) and the whole pool has {limits.kv_blocks} "
                f"(kv_cache_tokens = {limits.kv_blocks * limits.kv_block_size}): shorten the prompt or max_new_tokens")
        if not self.queued and self._fits(blocks):
            self._take(blocks)
            return 0.0
        if self.queued >= limits.max_queued:
            raise AdmissionRefused(
                f"too many sessions: {self.active} in flight (max_sessions = {limits.max_sessions}), "
                f"{self.blocks_held} of {limits.kv_blocks or 'unlimited'} KV blocks held, and "
                f"{self.queued} queued (max_queued = {limits.max_queued})")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), blocks)
        self._waiters.append(waiter)
        started = loop.time()
        try:
            async with asyncio.timeout(limits.timeout_s):
                await waiter.granted
        except TimeoutError:
            if not self._holds(waiter):
                raise AdmissionRefused(
                    f"no session within {limits.timeout_s:g} s in the queue (queue_timeout_s; max_sessions = "
                    f"{limits.max_sessions}, {self.active} in flight, {self.blocks_held} of "
                    f"{limits.kv_blocks or 'unlimited'} KV blocks held)") from None
        except asyncio.CancelledError:
            if self._holds(waiter):  # handed a session as the caller gave up: pass it on
                self.release(blocks)
            raise
        return loop.time() - started

    def _holds(self, waiter: _Waiter) -> bool:
        """Whether `waiter` was handed its session (else it leaves the queue)."""
        if waiter.granted.done() and not waiter.granted.cancelled():
            return True
        waiter.granted.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        self._hand_on()  # a large request leaving the head may let smaller ones behind it in
        return False

    def release(self, blocks: int = 0) -> None:
        """A session ends: what it held passes to the oldest waiters that fit, or becomes free."""
        self.active -= 1
        self.blocks_held -= blocks
        self._hand_on()

    def _hand_on(self) -> None:
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.granted.done():
                self._waiters.popleft()
                continue
            if not self._fits(waiter.blocks):
                return
            self._waiters.popleft()
            self._take(waiter.blocks)
            waiter.granted.set_result(None)
