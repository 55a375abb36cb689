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
call is made.
"""

from __future__ import annotations

import asyncio
import operator
import os
import stat
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Self

import grpc

from shared.protocol import (
    PROTOCOL_VERSION,
    common_pb2,
    verifier_pb2,
    verifier_pb2_grpc,
)
from shared import telemetry
from shared.local_stream import LocalCall, loopback_target
from shared.security import bearer_metadata, open_channel

__all__ = [
    "MAX_MESSAGE_BYTES",
    "AsyncVerifierClient",
    "Generation",
    "GenerationAccumulator",
    "GenerationConfig",
    "VerifierClient",
    "VerifierError",
    "round_to_dict",
    "source_name",
    "stats_to_dict",
]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest message either way on the client's channels."""
DISCOVERY_TIMEOUT_S = 5.0  # the longest a first call waits for the verifier to name its local socket

_MODES = {"exact": common_pb2.MODE_EXACT, "probabilistic": common_pb2.MODE_PROBABILISTIC}
_GATES = {"top": common_pb2.GATE_TOP, "pick": common_pb2.GATE_PICK}
_LOGPROB_MODES = {"raw": verifier_pb2.LOGPROB_MODE_RAW, "processed": verifier_pb2.LOGPROB_MODE_PROCESSED}
MAX_TOP_LOGPROBS = 20  # (the verifier's bound: kernels.logprobs)
_SOURCE_PREFIX = "DRAFT_SOURCE_"

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class GenerationConfig:
    """Everything a `Generate` request carries besides the prompt.

    Zeros mean "off" or "server default" exactly as in the protocol (common.proto); `top_p`
    None leaves the optional field unset (1.0, off). `speculation=False` asks the verifier
    to decode without drafts (plain decoding, the baseline).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    min_p: float = 0.0
    seed: int = 0
    max_support: int = 0
    mode: str = "exact"  # exact | probabilistic
    gate: str = "top"  # top | pick (probabilistic mode only)
    max_draft_tokens: int = 0
    retention_schedule: str | None = None
    retention_min_cum: float = 0.0
    speculation: bool = True
    coupled: bool = False
    eos_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    request_id: str = ""
    logprobs: int | None = None  # alternatives per token, [0, 20]; None: no log-probabilities
    logprobs_mode: str = "raw"  # raw (the model's distribution) | processed (the law the token is drawn from)

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}; got {self.mode!r}")
        if self.gate not in _GATES:
            raise ValueError(f"gate must be one of {sorted(_GATES)}; got {self.gate!r}")
        if self.logprobs_mode not in _LOGPROB_MODES:
            raise ValueError(f"logprobs_mode must be one of {sorted(_LOGPROB_MODES)}; got {self.logprobs_mode!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must lie in [0, {MAX_TOP_LOGPROBS}]; got {self.logprobs}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must lie in [0, 2**64); got {self.seed}")
        for name in ("max_new_tokens", "top_k", "max_support", "max_draft_tokens"):  # int32 on the wire
            if not 0 <= getattr(self, name) < 2**31:
                raise ValueError(f"{name} must lie in [0, 2**31); got {getattr(self, name)}")
        # Options that would do nothing in the chosen mode are refused, not ignored.
        if self.gate == "pick" and self.mode == "exact":
            raise ValueError("gate = pick is an admission rule of probabilistic mode; mode = exact (use --mode probabilistic)")
        if self.coupled and self.mode == "probabilistic":
            raise ValueError("coupled drafting belongs to exact mode; mode = probabilistic")
        # Lists are accepted for convenience; tuples keep the config hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for index, sequence in enumerate(stop):
            if not isinstance(sequence, str) or not sequence:
                raise ValueError(f"stop[{index}] = {sequence!r}: stop sequences are non-empty strings")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "eos_token_ids", tuple(_token_ids(self.eos_token_ids, "eos_token_ids")))

    def to_request(self, prompt: Prompt) -> verifier_pb2.GenerateRequest:
        """The `GenerateRequest` for `prompt`: text (`prompt_text`) or token ids (`prompt_ids`)."""
        request = verifier_pb2.GenerateRequest(
            protocol_version=PROTOCOL_VERSION,
            max_new_tokens=self.max_new_tokens,
            request_id=self.request_id,
        )
        if isinstance(prompt, str):
            request.prompt_text = prompt
        elif isinstance(prompt, bytes | bytearray):
            raise TypeError("prompt must be a str or a sequence of token ids, not bytes")
        else:
            request.prompt_ids.ids.extend(_token_ids(prompt, "prompt"))

        sampling = request.sampling
        sampling.temperature = self.temperature
        sampling.top_k = self.top_k
        if self.top_p is not None:
            sampling.top_p = self.top_p
        sampling.min_p = self.min_p
        sampling.seed = self.seed
        sampling.max_support = self.max_support

        request.stop.eos_token_ids.extend(self.eos_token_ids)
        request.stop.stop_sequences.extend(self.stop)

        speculation = request.speculation
        speculation.mode = _MODES[self.mode]
        speculation.gate = _GATES[self.gate]
        speculation.max_draft_tokens = self.max_draft_tokens
        speculation.retention.schedule = self.retention_schedule or ""
        speculation.retention.min_cum = self.retention_min_cum
        speculation.disable = not self.speculation
        speculation.coupled = self.coupled
        if self.logprobs is not None:
            request.logprobs.num_top = self.logprobs
            request.logprobs.mode = _LOGPROB_MODES[self.logprobs_mode]
        return request


def _token_ids(values: Iterable[int], what: str) -> list[int]:
    ids = []
    for value in values:
        try:
            token = operator.index(value)  # ints (numpy ints too), never floats or strings
        except TypeError:
            raise TypeError(f"{what} token ids must be integers; got {value!r}") from None
        if not 0 <= token < 2**32:
            raise ValueError(f"{what} token ids must lie in [0, 2**32); got {token}")
        ids.append(token)
    return ids


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target, its rank, and the most likely
    alternatives at its position (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]

    @classmethod
    def from_event(cls, event: verifier_pb2.GenerateEvent) -> list[TokenLogprob]:
        return [cls(token, x.logprob, x.rank, tuple(zip(x.top_token_ids, x.top_logprobs)))
                for token, x in zip(event.token_ids, event.logprobs)]


@dataclass
class Generation:
    """A finished request: the committed tokens, their text, why it stopped, and statistics.

    `text` is None when the server sent no text (a verifier without a tokenizer).
    `finish_reason` is "" when the stream ended without a final event. `logprobs`: one per
    token where the request asked for them (GenerationConfig.logprobs), else None.
    """

    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: dict
    rounds: list[dict] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


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


def source_name(source: int) -> str:
    """"MTP", "SUFFIX", "NONE", "UNSPECIFIED"; an enum value this version does not know reads as its number."""
    try:
        name = common_pb2.DraftSource.Name(source)
    except ValueError:
        return str(source)
    return name.removeprefix(_SOURCE_PREFIX)


def round_to_dict(info: verifier_pb2.RoundInfo) -> dict:
    return {
        "round_id": info.round_id,
        "source": source_name(info.source),
        "proposed": info.proposed,
        "retained": info.retained,
        "accepted": info.accepted,
        "verify_ms": info.verify_ms,
        "draft_wait_ms": info.draft_wait_ms,
        "speculative": info.speculative,
        "num_rounds": max(info.num_rounds, 1),  # (plain rounds ready together: one event)
    }


def stats_to_dict(stats: verifier_pb2.RequestStats) -> dict:
    return {
        "rounds": stats.rounds,
        "proposed": stats.proposed,
        "retained": stats.retained,
        "accepted": stats.accepted,
        "mean_accepted_length": stats.mean_accepted_length,
        "ttft_ms": stats.ttft_ms,
        "queue_ms": stats.queue_ms,
        "tokens_per_s": stats.tokens_per_s,
        "acceptance_by_source": {name: stats.acceptance_by_source[name] for name in sorted(stats.acceptance_by_source)},
        "drafter_faults": stats.drafter_faults,
        "speculative_rounds": stats.speculative_rounds,
        "drafter_detaches": stats.drafter_detaches,
        "ahead_hits": stats.ahead_hits,
        "ahead_misses": stats.ahead_misses,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
    }


class GenerationAccumulator:
    """Folds `GenerateEvent`s into a `Generation` (for callers that consume `stream()` themselves)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.rounds: list[dict] = []
        self.final: verifier_pb2.FinalEvent | None = None
        self.logprobs: list[TokenLogprob] | None = None

    def add(self, event: verifier_pb2.GenerateEvent) -> None:
        self.token_ids.extend(event.token_ids)
        if event.logprobs:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(TokenLogprob.from_event(event))
        if event.HasField("text_delta"):  # the verifier has a tokenizer (the delta may be "")
            self.text_parts.append(event.text_delta)
        if event.HasField("round"):
            self.rounds.append(round_to_dict(event.round))
        if event.HasField("final"):
            self.final = event.final

    def result(self) -> Generation:
        final = self.final if self.final is not None else verifier_pb2.FinalEvent()
        return Generation(
            token_ids=list(self.token_ids),
            text="".join(self.text_parts) if self.text_parts else None,
            finish_reason=final.finish_reason,
            stats=stats_to_dict(final.stats),
            rounds=list(self.rounds),
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )


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
