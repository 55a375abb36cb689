"""The gateway's life around its requests: stopping as the verifier does (DESIGN §9), and
letting go of requests whose client left.

Drain (SIGTERM): `/health` answers 503 while the port stays open (a load balancer sees it),
new requests are refused with 503, in-flight ones run on; those still running near the end
of the grace period are ended by the gateway itself (a stream gets an error event and
`[DONE]`, a whole reply a 503), so that every response ends in OpenAI's shape and nothing is
cut mid-write when the server closes.

A client that disconnects cancels its request, whether streamed or not: the verifier call is
cancelled and its session freed at once instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from gateway_service.errors import shutting_down

T = TypeVar("T")
_END = object()


class ClientGone(Exception):
    """The HTTP client disconnected before its reply was ready."""


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0  # requests between arrival and their response's last byte
        self._stopping: asyncio.Future | None = None  # done: requests still running end now

    def _stop_future(self) -> asyncio.Future:
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        return self._stopping

    async def drain(self, grace: float) -> float:
        """Refuse new requests, let in-flight ones finish within `grace` seconds (those still
        running in its last moments are ended); returns the seconds left of the grace."""
        self.draining = True
        deadline = time.monotonic() + grace
        stopping = self._stop_future()
        ending = asyncio.get_running_loop().call_later(
            max(0.0, grace - min(1.0, grace / 4)),  # as the verifier: the last moments let final events out
            lambda: stopping.done() or stopping.set_result(None))
        try:
            while self.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            ending.cancel()
        return max(0.0, deadline - time.monotonic())

    async def events(self, source: AsyncIterator) -> AsyncIterator:
        """`source`'s events until the drain ends the request: then ApiError (shutdown), and
        `source` is cancelled (its verifier call with it)."""
        stopping = self._stop_future()
        try:
            while True:
                if stopping.done():
                    raise shutting_down()
                step = asyncio.ensure_future(anext(source, _END))
                try:
                    await asyncio.wait((step, stopping), return_when=asyncio.FIRST_COMPLETED)
                except BaseException:  # this request was cancelled (its client left)
                    await _cancel(step)
                    raise
                if not step.done():  # the drain ends it
                    await _cancel(step)
                    raise shutting_down()
                event = step.result()  # the verifier's error, if any, surfaces here
                if event is _END:
                    return
                yield event
        finally:
            await source.aclose()


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; ClientGone (and `work` cancelled) if the client disconnects first.
    Needs the request's body read already: what `receive` gives next is the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancel(gone)
        await _cancel(task)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel(task: asyncio.Future) -> None:
    """Cancel `task` and wait for it to end (its verifier call closed), without swallowing a
    cancellation of the caller itself."""
    if task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
