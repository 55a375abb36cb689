"""The model worker: one dedicated thread per device that runs all model code.

The gRPC event loop never runs model code; handlers `await worker.run(fn, ...)`. Jobs run in
submission order, so requests interleave round by round on the one device.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

R = TypeVar("R")


class ModelWorker:
    def __init__(self, name: str = "model-worker") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., R], *args, **kwargs) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def submit(self, fn: Callable[..., object], *args) -> None:
        """Queue fn(*args) behind the jobs already queued, without waiting for it (housekeeping
        that must not race the model code, e.g. from a `finally` that cannot await)."""
        self._executor.submit(fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
