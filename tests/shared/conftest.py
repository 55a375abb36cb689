"""Fixtures of tests/shared: the fake verifier, served in the test's loop or in a thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.shared.fake_verifier import FakeVerifier, _start



@pytest.fixture
async def aio_verifier():
    """A fake verifier in the test's own event loop (for the async client)."""
    servicer = FakeVerifier()
    server, port = await _start(servicer)
    yield f"127.0.0.1:{port}", servicer
    await server.stop(None)


@pytest.fixture(scope="module")
def thread_verifier():
    """A fake verifier on its own event loop in a background thread (for the blocking client
    and the CLI, which would otherwise block the loop serving them)."""
    servicer = FakeVerifier()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port = asyncio.run_coroutine_threadsafe(_start(servicer), loop).result(timeout=10)
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
