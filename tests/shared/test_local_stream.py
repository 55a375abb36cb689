"""The same-host stream transport (shared.local_stream): a LocalStreamServer and LocalCall on a
real Unix socket, with gRPC's semantics as the drafter link uses them."""

import asyncio
import os
import shutil
import socket
import stat
import struct
import tempfile

import grpc
import pytest

from shared.local_stream import (HEADER, MESSAGE, METADATA, LocalCall, LocalStreamServer, frame, is_local_peer,
                                 loopback_target)
from shared.protocol import common_pb2
from shared.security import BearerTokenInterceptor

LIMIT = 4096


@pytest.fixture
def socket_path():
    directory = tempfile.mkdtemp(prefix="tandem-ls-")  # (short: a Unix socket path is at most 107 bytes)
    yield f"{directory}/s.sock"
    shutil.rmtree(directory, ignore_errors=True)


def message(*ids: int) -> common_pb2.SparseRow:
    return common_pb2.SparseRow(token_ids=list(ids))


async def doubler(requests, context):
    """Answers each request with its ids doubled; "abort" (id 0) ends the stream with
    FAILED_PRECONDITION, id 1 raises, id 2 sends a message over the client's limit."""
    async for request in requests:
        ids = list(request.token_ids)
        if ids == [0]:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "session evicted: re-open")
        if ids == [1]:
            raise RuntimeError("boom")
        if ids == [2]:
            yield message(*range(LIMIT))
            continue
        yield message(*(2 * i for i in ids))


async def serve(path, handler=doubler, **kwargs) -> LocalStreamServer:
    server = LocalStreamServer(path, handler, common_pb2.SparseRow, limit=LIMIT, **kwargs)
    await server.start()
    return server


def call(path, metadata=()) -> LocalCall:
    return LocalCall(path, common_pb2.SparseRow, metadata, LIMIT)


async def drain(stream: LocalCall, timeout_s: float = 10.0) -> None:
    """Read the stream to its end (bounded: a stream that never ends fails the test)."""
    async def read_all():
        async for _ in stream:
            pass

    await asyncio.wait_for(read_all(), timeout_s)


async def test_messages_go_both_ways_in_order_and_end_with_ok(socket_path):
    server = await serve(socket_path)
    try:
        stream = call(socket_path)
        replies = aiter(stream)
        for i in range(3, 8):
            await stream.write(message(i, i + 100))
            assert list((await anext(replies)).token_ids) == [2 * i, 2 * i + 200]
        await stream.done_writing()
        with pytest.raises(StopAsyncIteration):  # the handler saw the end of the requests: status OK
            await anext(replies)
        assert server.served == 1
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600  # owner-only
    finally:
        await server.close()
    assert not os.path.exists(socket_path)


@pytest.mark.parametrize("ids, code, details", [
    ([0], grpc.StatusCode.FAILED_PRECONDITION, "session evicted: re-open"),
    ([1], grpc.StatusCode.UNKNOWN, "RuntimeError: boom"),
    ([2], grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit"),
])
async def test_the_handler_s_ends_reach_the_client_as_grpc_errors(socket_path, ids, code, details):
    server = await serve(socket_path)
    try:
        stream = call(socket_path)
        await stream.write(message(*ids))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await drain(stream)
        assert error.value.code() == code and details in error.value.details()
    finally:
        await server.close()


async def test_a_request_over_the_limit_ends_the_stream_unparsed(socket_path):
    seen = []

    async def recorder(requests, context):
        async for request in requests:
            seen.append(request)
            yield request

    server = await serve(socket_path, recorder)
    try:
        stream = call(socket_path)
        await stream.write(message(*range(LIMIT)))  # ~8 KB of varints
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await drain(stream)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not seen
    finally:
        await server.close()


@pytest.mark.parametrize("sent, refusal", [("Bearer s3cret", None), ("Bearer wrong", "invalid bearer token"),
                                           (None, "missing bearer token")])
async def test_a_bearer_token_is_checked_before_the_handler(socket_path, sent, refusal):
    server = await serve(socket_path, check=BearerTokenInterceptor("s3cret").check)
    try:
        stream = call(socket_path, [("authorization", sent)] if sent else [])
        await stream.write(message(4))
        if refusal is None:
            assert list((await anext(aiter(stream))).token_ids) == [8]
            assert server.served == 1
        else:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await drain(stream)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED and refusal in error.value.details()
            assert server.served == 0
        stream.cancel()
    finally:
        await server.close()


async def test_no_server_is_unavailable(socket_path):
    stream = call(socket_path)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stream.write(message(1))
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and socket_path in error.value.details()
    with pytest.raises(grpc.aio.AioRpcError):
        await drain(stream)


async def test_closing_the_server_ends_open_streams(socket_path):
    waiting = asyncio.Event()

    async def slow(requests, context):
        async for request in requests:
            waiting.set()
            await asyncio.sleep(60)
            yield request

    server = await serve(socket_path, slow)
    stream = call(socket_path)
    await stream.write(message(5))
    await asyncio.wait_for(waiting.wait(), 5)
    await server.close()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await drain(stream)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "without a status" in error.value.details()


async def test_a_stale_socket_is_replaced_a_live_one_or_a_file_refused(socket_path):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(socket_path)  # bound, never listening: what a killed process leaves
    stale.close()
    server = await serve(socket_path)
    try:
        with pytest.raises(OSError, match="another server listens"):
            await serve(socket_path)
    finally:
        await server.close()
    with open(socket_path, "w") as file:
        file.write("not a socket")
    with pytest.raises(OSError, match="is not a socket"):
        await serve(socket_path)


async def test_malformed_frames_are_refused(socket_path):
    server = await serve(socket_path)
    try:
        for first in (frame(METADATA, b'{"not": "a list"}'), frame(MESSAGE, b"")):
            reader, writer = await asyncio.open_unix_connection(socket_path)
            writer.write(first)
            length, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
            status = await reader.readexactly(length)
            assert b"INVALID_ARGUMENT" in status
            writer.close()
        # a request that is not a SparseRow
        reader, writer = await asyncio.open_unix_connection(socket_path)
        writer.write(frame(METADATA, b"[]") + frame(MESSAGE, b"\xff\xff\xff"))
        length, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
        assert b"malformed SparseRow" in await reader.readexactly(length)
        writer.close()
        assert struct.calcsize(">IB") == HEADER.size == 5
    finally:
        await server.close()



async def test_write_nowait_sends_before_the_caller_awaits_again(socket_path, frames_on):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a bare peer: it reads what arrived, no event loop
    listener.bind(socket_path)
    listener.listen(1)
    try:
        stream = call(socket_path)
        assert not stream.write_nowait(message(1))  # not connected yet: nothing written, use write
        await stream.write(message(2))
        conn, _ = listener.accept()
        conn.settimeout(5)
        assert stream.write_nowait(message(3)) and stream.write_nowait(message(4))
        # no await since the two calls: their bytes are on the socket already, behind the first
        frames = frames_on(conn, 4)
        assert [kind for kind, _ in frames] == [METADATA, MESSAGE, MESSAGE, MESSAGE]
        assert [list(common_pb2.SparseRow.FromString(payload).token_ids) for _, payload in frames[1:]] == [[2], [3], [4]]
        stream.cancel()
        assert not stream.write_nowait(message(5))
        conn.close()
    finally:
        listener.close()


@pytest.mark.parametrize("peer, local", [
    ("ipv4:127.0.0.1:5000", True), ("ipv4:127.3.2.1:1", True), ("ipv6:[::1]:5000", True),
    ("ipv6:[::ffff:127.0.0.1]:5000", True), ("unix:/tmp/x.sock", True), ("unix:", True),
    ("ipv4:10.0.0.7:5000", False), ("ipv6:[2001:db8::1]:5000", False), ("ipv6:[::ffff:10.0.0.7]:1", False),
    ("ipv4:not-an-address:1", False), ("", False), ("dns:localhost", False)])
def test_a_peer_on_this_host_is_a_loopback_address_or_a_unix_socket(peer, local):
    assert is_local_peer(peer) is local


@pytest.mark.parametrize("target, loopback", [
    ("127.0.0.1:50051", True), ("localhost:50051", True), ("[::1]:50051", True), ("127.0.0.2:1", True),
    ("10.0.0.7:50051", False), ("verifier:50051", False), ("dns:///localhost:50051", False),
    ("ipv4:127.0.0.1:50051", False), ("ipv4:127.0.0.1:1,127.0.0.1:2", False), ("unix:/tmp/v.sock", False)])
def test_a_target_names_one_loopback_server_or_not(target, loopback):
    assert loopback_target(target) is loopback
