"""Request bodies: bounded in size (`--max-body-mb`, 413 past it) and parsed as JSON without
stalling the event loop (a large body is decoded on a worker thread, so `/health`,
`/v1/models` and other requests' streams go on meanwhile)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from gateway_service.errors import ApiError, bad

# Bodies past this size are decoded on a worker thread; smaller ones (nearly all requests)
# decode faster than a thread hop takes.
THREAD_DECODE_BYTES = 64 << 10
T = TypeVar("T")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes (the gateway's --max-body-mb)",
                    code="request_too_large")


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")  # json.loads would take NaN and Infinity


def decode(raw: bytes) -> object:
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except RecursionError:  # json's decoder recurses per nesting level
        raise bad(None, "the request body nests too deeply") from None
    except ValueError:  # JSONDecodeError, invalid UTF-8, an integer of thousands of digits
        raise bad(None, "the request body is not valid JSON") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The body; ApiError 413 past `limit` bytes (before reading when the client declares
    its length, as soon as it is crossed otherwise)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def decoded(raw: bytes, then: Callable[[object], T]) -> T:
    """`then(the body as JSON)`: decoding and what `then` does with it (checks, the chat
    template) run on a worker thread when the body is large, here otherwise."""
    if len(raw) > THREAD_DECODE_BYTES:
        return await asyncio.to_thread(lambda: then(decode(raw)))
    return then(decode(raw))
