"""What both services' batchers share: a batch's job answers every caller in it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


async def answer(futures: list[asyncio.Future], job: Awaitable[list]) -> None:
    """Await a batch's job and give each caller's future its result, in order; a failure of
    the job reaches every caller still waiting, and cancelling the job cancels them all."""
    try:
        results = await job
    except asyncio.CancelledError:
        for future in futures:
            future.cancel()
        raise
    except Exception as error:  # every caller of the batch sees the failure
        for future in futures:
            if not future.done():
                future.set_exception(error)
        return
    for future, result in zip(futures, results, strict=True):
        if not future.done():
            future.set_result(result)
