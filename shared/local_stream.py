"""A bidirectional message stream between two processes of one host, over a Unix-domain socket
and without gRPC: the drafter link's same-host transport (DESIGN §9, "The same-host link").

A gRPC stream's round trip costs more than twice what length-prefixed frames on a Unix socket
cost (bench/link_floor.py, docs/PERFORMANCE.md: HTTP/2 and gRPC's own machinery, not the
socket), and a speculative round pays it once. Where the drafter runs beside the verifier, the
Draft stream can take this path; the messages are the same protobuf messages, and everything
else (Record, health, metrics, trace context inside the messages) stays on gRPC.

One connection is one stream, with gRPC's semantics as the two sides use them:

    client → server: METADATA (first: a JSON list of [key, value]), MESSAGE..., END (done writing)
    server → client: MESSAGE..., STATUS (last: a JSON {"code": name, "details": text})

A frame is a 4-byte big-endian payload length, a kind byte, then the payload. A frame longer
than the receiving side's limit ends the stream (RESOURCE_EXHAUSTED), as gRPC refuses a message
over its receive limit before parsing it. The handler is the gRPC servicer's method itself:
`LocalContext` is the part of `grpc.aio.ServicerContext` it uses (read, abort, peer), and the
client's `LocalCall` the part of a gRPC stream call the link uses (write, done_writing, cancel,
iteration), failing with `grpc.aio.AioRpcError` as a gRPC call does. The socket is created
owner-only (0600): same-user processes only; a bearer token, where the server has one, is
checked on the METADATA frame as on gRPC metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import socket
import stat
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

HEADER = struct.Struct(">IB")  # payload length, kind
METADATA, MESSAGE, END, STATUS = 1, 2, 3, 4
METADATA_LIMIT = 64 * 1024  # bytes of a METADATA or STATUS frame
PEER = "unix:local"


class FrameTooLarge(Exception):
    pass


def is_local_peer(peer: str) -> bool:
    """Whether a gRPC peer string (`context.peer()`: "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000",
    "unix:...") is a process on this host: a loopback address or a Unix socket."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
    else:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def loopback_target(target: str) -> bool:
    """Whether a client's gRPC target names one server on this host by itself ("127.0.0.1:50051",
    "localhost:50051", "[::1]:50051"): not a name resolved to several (dns:///, a list)."""
    if "://" in target or "," in target or target.startswith(("ipv4:", "ipv6:", "unix:")):
        return False
    host = target.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


async def read_frame(reader: asyncio.StreamReader, limit: int) -> tuple[int, bytes] | None:
    """The next (kind, payload), None at a clean end of the connection; FrameTooLarge (read no
    further) for a payload over `limit`, asyncio.IncompleteReadError for a cut frame."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            return None
        raise
    length, kind = HEADER.unpack(header)
    if length > (limit if kind == MESSAGE else METADATA_LIMIT):
        raise FrameTooLarge(f"a frame of {length} bytes is over the limit ({limit} bytes)")
    return kind, await reader.readexactly(length)


def _status_frame(code: grpc.StatusCode, details: str) -> bytes:
    return frame(STATUS, json.dumps({"code": code.name, "details": details}).encode())


# -- the server's side --------------------------------------------------------------------------

class StreamAborted(Exception):
    """Raised by LocalContext.abort, as grpc.aio's abort raises: the handler ends there."""


class LocalContext:
    """What a stream handler uses of grpc.aio.ServicerContext, over one connection; also the
    request iterator (the same reads)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request_type,
                 limit: int) -> None:
        self._reader, self._writer = reader, writer
        self._request_type, self._limit = request_type, limit
        self.status_sent = False
        self.metadata: list[tuple[str, str]] = []

    async def read_metadata(self) -> None:
        got = await read_frame(self._reader, self._limit)
        if got is None or got[0] != METADATA:
            raise ValueError("the stream did not begin with its metadata")
        pairs = json.loads(got[1])
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, str) for v in p)
                                                  for p in pairs):
            raise ValueError("metadata must be a list of [key, value] strings")
        self.metadata = [(key, value) for key, value in pairs]

    async def read(self):
        """The next request message, or grpc.aio.EOF once the client is done writing (or gone)."""
        try:
            got = await read_frame(self._reader, self._limit)
        except (asyncio.IncompleteReadError, ConnectionError):
            return grpc.aio.EOF
        if got is None or got[0] == END:
            return grpc.aio.EOF
        kind, payload = got
        if kind != MESSAGE:
            await self.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected frame kind {kind} on the stream")
        try:
            return self._request_type.FromString(payload)
        except DecodeError:
            await self.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {self._request_type.__name__} "
                                                               f"({len(payload)} bytes)")

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._requests()

    async def _requests(self) -> AsyncIterator[Any]:
        while (message := await self.read()) is not grpc.aio.EOF:
            yield message

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        await self.send_status(code, details)
        raise StreamAborted(f"{code.name}: {details}")

    async def send_status(self, code: grpc.StatusCode, details: str) -> None:
        if self.status_sent:
            return
        self.status_sent = True
        with contextlib.suppress(ConnectionError):
            self._writer.write(_status_frame(code, details))
            await self._writer.drain()

    def peer(self) -> str:
        return PEER


Handler = Callable[[Any, LocalContext], AsyncIterator[Any]]


class LocalStreamServer:
    """Serves one stream-stream method on a Unix socket, a connection per stream. `check`: the
    rejection message for a stream's metadata, or None to serve it (a bearer token check)."""

    def __init__(self, path: str, handler: Handler, request_type, *, limit: int,
                 check: Callable[[Sequence[tuple[str, str]]], str | None] | None = None) -> None:
        self.path, self._handler, self._request_type = path, handler, request_type
        self._limit, self._check = limit, check
        self._server: asyncio.AbstractServer | None = None
        self._streams: set[asyncio.Task] = set()
        self.served = 0  # streams handed to the handler (past the metadata and its check)

    async def start(self) -> None:
        """Bind the socket, owner-only; a stale socket file (no server behind it) is replaced,
        a live one or any other file is an OSError."""
        path = Path(self.path)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise OSError(f"{self.path} exists and is not a socket")
            if answers(self.path):
                raise OSError(f"{self.path}: another server listens on it")
            path.unlink()
        old_mask = os.umask(0o177)  # created 0600: no window where another user may connect
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        finally:
            os.umask(old_mask)

    async def close(self) -> None:
        """Stop accepting, end the streams still open (their clients see the connection end)."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._streams):
            task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._streams.add(task)
        context = LocalContext(reader, writer, self._request_type, self._limit)
        try:
            try:
                await context.read_metadata()
            except (ValueError, FrameTooLarge, asyncio.IncompleteReadError, ConnectionError) as error:
                await context.send_status(grpc.StatusCode.INVALID_ARGUMENT, f"{error}"[:200])
                return
            refusal = self._check(context.metadata) if self._check is not None else None
            if refusal is not None:
                await context.send_status(grpc.StatusCode.UNAUTHENTICATED, refusal)
                return
            self.served += 1
            async with contextlib.aclosing(self._handler(context, context)) as responses:
                async for response in responses:
                    writer.write(frame(MESSAGE, response.SerializeToString()))
                    await writer.drain()
            await context.send_status(grpc.StatusCode.OK, "")
        except StreamAborted:
            pass  # (its status went out)
        except FrameTooLarge as error:
            await context.send_status(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except ConnectionError:
            pass  # the client went away
        except Exception as error:  # noqa: BLE001 (the client hears it as gRPC's UNKNOWN)
            await context.send_status(grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"[:200])
        finally:
            self._streams.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def answers(path: str) -> bool:
    """Whether a server listens on the Unix socket at `path` (a connect the kernel completes at
    once, whatever the server's event loop is doing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


# -- the client's side --------------------------------------------------------------------------

def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class LocalCall:
    """One stream to a LocalStreamServer, used as a grpc.aio stream-stream call is: write(),
    done_writing(), cancel(), `async for` over the responses; failures are AioRpcError."""

    def __init__(self, path: str, response_type, metadata: Sequence[tuple[str, str]], limit: int) -> None:
        self.path, self._response_type, self._limit = path, response_type, limit
        self._connection = asyncio.ensure_future(self._connect([list(pair) for pair in metadata]))
        self._cancelled = False

    async def _connect(self, metadata: list[list[str]]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError as error:
            raise _error(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {self.path}: {error.strerror or error}") from None
        writer.write(frame(METADATA, json.dumps(metadata).encode()))
        return reader, writer

    async def connect(self) -> None:
        """Wait for the connection (its metadata sent): UNAVAILABLE where nothing listens at the
        path, before anything of the call left this process."""
        await self._writer()

    async def _writer(self) -> asyncio.StreamWriter:
        if self._cancelled:
            raise _error(grpc.StatusCode.CANCELLED, "the stream was cancelled")
        return (await self._connection)[1]

    async def write(self, message) -> None:
        writer = await self._writer()
        try:
            writer.write(frame(MESSAGE, message.SerializeToString()))
            await writer.drain()
        except ConnectionError as error:
            raise _error(grpc.StatusCode.UNAVAILABLE, f"the stream to {self.path} broke: {error}") from None

    def write_nowait(self, message) -> bool:
        """Write `message` now, from the caller's own step, where `write` would not wait either
        (the connection is up, its transport's buffer below the high-water mark): the bytes leave
        before the caller's next await rather than when a task scheduled behind the event loop's
        other work runs. False (nothing written): use `write`. Call it only while no earlier
        `write` is still pending, or the order is lost."""
        connection = self._connection
        if self._cancelled or not connection.done() or connection.cancelled() or connection.exception() is not None:
            return False
        transport = connection.result()[1].transport
        if transport.is_closing() or transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
            return False
        transport.write(frame(MESSAGE, message.SerializeToString()))
        return True

    async def done_writing(self) -> None:
        writer = await self._writer()
        with contextlib.suppress(ConnectionError):
            writer.write(frame(END, b""))
            await writer.drain()

    def cancel(self) -> bool:
        if self._cancelled:
            return False
        self._cancelled = True
        if self._connection.done():
            if not self._connection.cancelled() and self._connection.exception() is None:
                self._connection.result()[1].close()
        else:
            self._connection.cancel()
        return True

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Any]:
        reader, _ = await self._connection
        while True:
            try:
                got = await read_frame(reader, self._limit)
            except FrameTooLarge as error:
                raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"received a message over the limit: {error}") from None
            except (asyncio.IncompleteReadError, ConnectionError):
                got = None
            if got is None:
                code = grpc.StatusCode.CANCELLED if self._cancelled else grpc.StatusCode.UNAVAILABLE
                raise _error(code, f"the stream to {self.path} ended without a status")
            kind, payload = got
            if kind == MESSAGE:
                try:
                    response = self._response_type.FromString(payload)
                except DecodeError:
                    raise _error(grpc.StatusCode.INTERNAL, f"malformed {self._response_type.__name__} "
                                                           f"({len(payload)} bytes)") from None
                yield response
            elif kind == STATUS:
                code, details = parse_status(payload)
                if code == grpc.StatusCode.OK:
                    return
                raise _error(code, details)
            else:
                raise _error(grpc.StatusCode.INTERNAL, f"unexpected frame kind {kind} from the server")


def parse_status(payload: bytes) -> tuple[grpc.StatusCode, str]:
    try:
        status = json.loads(payload)
        return grpc.StatusCode[status["code"]], str(status.get("details", ""))
    except (ValueError, KeyError, TypeError):
        return grpc.StatusCode.INTERNAL, "malformed status from the server"
