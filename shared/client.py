"""A Python client for the verifier's `Generate` stream, async (`grpc.aio`) and sync.

    async with AsyncVerifierClient("localhost:50051") as client:
        result = await client.generate("Once upon a time", GenerationConfig(max_new_tokens=32))
        async for event in client.stream([1, 2, 3], GenerationConfig(temperature=0.7, seed=7)):
            ...

    with VerifierClient("localhost:50051") as client:
        result = client.generate([1, 2, 3], GenerationConfig())

On the verifier's host the async client streams Generate over the verifier's local socket, which
the verifier names when first asked (`AsyncVerifierClient`'s `discover_local`; DESIGN §9).

Both clients raise `VerifierError` (the gRPC status code and the server's message) for every
failed call, including a verifier that cannot be reached (UNAVAILABLE) or a deadline that
passed (DEADLINE_EXCEEDED). A bad `GenerationConfig` raises ValueError/TypeError before any
call is made. The request and result types live in shared/generation.py and are imported from
here as well.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator, Iterator
from typing import Self

import grpc

from shared.protocol import verifier_pb2, verifier_pb2_grpc
from shared import telemetry
from shared.generation import (  # (re-exported: callers import them from here)
    MAX_TOP_LOGPROBS,
    Generation,
    GenerationAccumulator,
    GenerationConfig,
    Prompt,
    TokenLogprob,
    round_to_dict,
    source_name,
    stats_to_dict,
)
from shared.local_stream import LocalCall, loopback_target
from shared.security import bearer_metadata, open_channel

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_TOP_LOGPROBS",
    "AsyncVerifierClient",
    "Generation",
    "GenerationAccumulator",
    "GenerationConfig",
    "Prompt",
    "TokenLogprob",
    "VerifierClient",
    "VerifierError",
    "round_to_dict",
    "source_name",
    "stats_to_dict",
]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest message either way on the client's channels."""
DISCOVERY_TIMEOUT_S = 5.0  # the longest a first call waits for the verifier to name its local socket

class VerifierError(Exception):
    """A failed `Generate` call: the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> VerifierError:
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = error.details() if callable(getattr(error, "details", None)) else None
        return cls(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN, details or str(error))


def _channel_options(extra) -> list[tuple[str, object]]:
    options = {
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
        "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    }
    options.update(dict(extra or ()))  # the caller's options win
    return list(options.items())


class AsyncVerifierClient:
    """`grpc.aio` client of `Verifier.Generate`. The channel opens on first use (inside the
    running event loop); `timeout` is the deadline of each whole call, in seconds.

    Generate streams take a verifier's local socket on this host where there is one (the same
    events and errors without gRPC's per-event cost; health checks stay on `target`):
    `local_socket`, a path; else, with `discover_local` (the default) and a plain-text target
    naming one loopback address ("127.0.0.1:50051", "localhost:50051"), the one the verifier
    names when first asked (GetServerInfo). A discovered socket that no longer answers is
    dropped (that call goes over gRPC) and asked for again at the next call."""

    def __init__(
        self, target: str, *, timeout: float | None = None, channel_options=None,
        credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
        local_socket: str | None = None, discover_local: bool = True,
    ) -> None:
        if local_socket is not None and not local_socket:
            raise ValueError("local_socket must not be empty (leave it unset for gRPC)")
        self.target = target
        self.timeout = timeout
        self.local_socket = local_socket  # the socket Generate streams take now; None: gRPC
        self._explicit_local = local_socket is not None
        self._discover = (discover_local and local_socket is None and credentials is None
                          and loopback_target(target))
        self._discovery: asyncio.Lock | None = None
        self._options = _channel_options(channel_options)
        self._credentials = credentials
        self._metadata = bearer_metadata(token)
        self._channel: grpc.aio.Channel | None = None
        self._stub: verifier_pb2_grpc.VerifierStub | None = None

    def _get_stub(self) -> verifier_pb2_grpc.VerifierStub:
        if self._stub is None:
            self._channel = open_channel(self.target, self._credentials, self._options)
            self._stub = verifier_pb2_grpc.VerifierStub(self._channel)
        return self._stub

    async def _local_path(self) -> str | None:
        """The local socket to stream over, asking the verifier first where not yet known."""
        if self._discover and self.local_socket is None:
            if self._discovery is None:
                self._discovery = asyncio.Lock()
            async with self._discovery:  # (concurrent first calls ask once)
                if self._discover and self.local_socket is None:
                    await self._ask_verifier()
        return self.local_socket

    async def _ask_verifier(self) -> None:
        timeout = DISCOVERY_TIMEOUT_S if self.timeout is None else min(self.timeout, DISCOVERY_TIMEOUT_S)
        try:
            info = await self._get_stub().GetServerInfo(verifier_pb2.GetServerInfoRequest(), timeout=timeout,
                                                        metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:  # a verifier that offers none
                self._discover = False
            return  # (else not reachable yet, say: asked again at the next call)
        self._discover = False
        try:  # (a path from another host's verifier, behind a forwarded port, is not one here)
            if info.local_socket and stat.S_ISSOCK(os.stat(info.local_socket).st_mode):
                self.local_socket = info.local_socket
        except OSError:
            pass

    async def stream(self, prompt: Prompt, config: GenerationConfig) -> AsyncIterator[verifier_pb2.GenerateEvent]:
        """The request's events as they arrive; leaving the loop early cancels the call
        (wrap in `contextlib.aclosing` to cancel at once rather than when collected)."""
        request = config.to_request(prompt)
        path = await self._local_path()
        call = await self._connect_local(path) if path is not None else None
        if call is not None:
            async for event in self._stream_local(call, request):
                yield event
            return
        call = self._get_stub().Generate(request, timeout=self.timeout, metadata=self._metadata)
        try:
            async for event in call:
                yield event
        except grpc.RpcError as error:
            raise VerifierError.from_rpc_error(error) from error
        finally:
            call.cancel()  # no-op once the call is done

    async def _connect_local(self, path: str) -> LocalCall | None:
        """A call on the local socket, connected; None where a discovered socket no longer answers
        (the verifier restarted, say: forgotten, asked for again next time), so this call takes gRPC."""
        carrier: dict[str, str] = {}
        telemetry.inject_context(carrier)  # (the caller's trace, which gRPC's instrumentation carries on a port)
        call = LocalCall(path, verifier_pb2.GenerateEvent, [*self._metadata, *carrier.items()], MAX_MESSAGE_BYTES)
        try:
            async with asyncio.timeout(self.timeout):
                await call.connect()
        except (grpc.RpcError, TimeoutError) as error:
            call.cancel()
            if self._explicit_local:
                if isinstance(error, TimeoutError):
                    raise VerifierError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
                raise VerifierError.from_rpc_error(error) from error
            self.local_socket, self._discover = None, True
            return None
        return call

    async def _stream_local(self, call: LocalCall, request: verifier_pb2.GenerateRequest
                            ) -> AsyncIterator[verifier_pb2.GenerateEvent]:
        deadline = None if self.timeout is None else asyncio.get_running_loop().time() + self.timeout
        try:
            async with asyncio.timeout_at(deadline):  # (the whole call's deadline, as gRPC's)
                await call.write(request)
                await call.done_writing()
            events = aiter(call)
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        event = await anext(events)
                except StopAsyncIteration:
                    return
                yield event
        except TimeoutError:
            raise VerifierError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except grpc.RpcError as error:
            raise VerifierError.from_rpc_error(error) from error
        finally:
            call.cancel()

    async def generate(self, prompt: Prompt, config: GenerationConfig) -> Generation:
        accumulator = GenerationAccumulator()
        async for event in self.stream(prompt, config):
            accumulator.add(event)
        return accumulator.result()

    async def serving(self, timeout: float = 2.0) -> bool:
        """Whether the verifier's health check answers SERVING (False when unreachable or loading)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._get_stub()
        health = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Verifier"), timeout=timeout,
                                       metadata=self._metadata)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


class VerifierClient:
    """Blocking client of `Verifier.Generate`; `timeout` is the deadline of each whole call."""

    def __init__(
        self, target: str, *, timeout: float | None = None, channel_options=None,
        credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = bearer_metadata(token)
        options = _channel_options(channel_options)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._stub = verifier_pb2_grpc.VerifierStub(self._channel)

    def stream(self, prompt: Prompt, config: GenerationConfig) -> Iterator[verifier_pb2.GenerateEvent]:
        """The request's events as they arrive; closing the iterator early cancels the call."""
        request = config.to_request(prompt)
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as error:
            raise VerifierError.from_rpc_error(error) from error
        finally:
            call.cancel()

    def generate(self, prompt: Prompt, config: GenerationConfig) -> Generation:
        accumulator = GenerationAccumulator()
        for event in self.stream(prompt, config):
            accumulator.add(event)
        return accumulator.result()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
