"""Turn a GenerateRequest into a validated request spec, or a status naming the bad field."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from kernels.retention import RetentionPolicy
from kernels.sampling import DEFAULT_MAX_SUPPORT, SamplingParams
from kernels.speculative import Gate, Mode
from shared.protocol import MAX_ID_LENGTH, PROTOCOL_VERSION, common_pb2, verifier_pb2
from verifier_service.logprobs import LogprobMode, LogprobSpec
from verifier_service.settings import VerifierSettings

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
PROMPT_TEXT_BYTES_PER_TOKEN = 32  # prompt_text may hold max_context * this many UTF-8 bytes
MAX_MESSAGE_LENGTH = 400  # error messages are cut here (bad values are quoted short anyway)


class RequestError(Exception):
    """A request the server refuses; carries the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> RequestError:
    if len(message) > MAX_MESSAGE_LENGTH:
        message = message[: MAX_MESSAGE_LENGTH - 3] + "..."
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    mode: Mode
    gate: Gate
    speculate: bool
    coupled: bool
    max_draft_tokens: int
    retention: RetentionPolicy
    retention_schedule: str
    retention_min_cum: float
    eos_token_ids: frozenset[int]
    stop_sequences: tuple[str, ...]
    logprobs: LogprobSpec | None = None  # None: the events carry none


def parse_request(
    request: verifier_pb2.GenerateRequest,
    *,
    settings: VerifierSettings,
    tokenizer,
    vocab_size: int,
    max_context: int,
    model_eos_ids: tuple[int, ...],
    request_id: str,
) -> RequestSpec:
    if request.protocol_version not in (0, PROTOCOL_VERSION):
        raise _invalid(f"protocol_version {request.protocol_version} is not supported (this server speaks {PROTOCOL_VERSION})")
    if len(request.request_id) > MAX_ID_LENGTH:
        raise _invalid(f"request_id has {len(request.request_id)} characters; at most {MAX_ID_LENGTH}")
    which = request.WhichOneof("prompt")
    if which == "prompt_text":
        if tokenizer is None:
            raise _invalid("prompt_text needs a tokenizer and this model has none; send prompt_ids")
        size = len(request.prompt_text.encode("utf-8"))
        if size > max_context * PROMPT_TEXT_BYTES_PER_TOKEN:
            raise _invalid(f"prompt_text has {size} bytes; at most {max_context * PROMPT_TEXT_BYTES_PER_TOKEN} "
                           f"({PROMPT_TEXT_BYTES_PER_TOKEN} per token of the {max_context}-token context)")
        prompt_ids = tuple(tokenizer.encode(request.prompt_text).ids)
    elif which == "prompt_ids":
        prompt_ids = request.prompt_ids.ids
    else:
        prompt_ids = ()
    if not prompt_ids:
        raise _invalid("prompt is empty: give prompt_text or prompt_ids")
    if len(prompt_ids) >= max_context:  # before touching every id: a huge prompt is refused at once
        raise _invalid(f"prompt has {len(prompt_ids)} tokens; the context holds {max_context}, so at most {max_context - 1}")
    prompt_ids = tuple(prompt_ids)
    for index, token in enumerate(prompt_ids):
        if token >= vocab_size:
            raise _invalid(f"prompt_ids[{index}] = {token} is out of range [0, {vocab_size})")
    limit = settings.max_new_tokens_limit
    if not 1 <= request.max_new_tokens <= limit:
        raise _invalid(f"max_new_tokens must lie in [1, {limit}]; got {request.max_new_tokens}")
    if len(prompt_ids) + request.max_new_tokens > max_context:  # refused, not cut short (as OpenAI and vLLM)
        raise _invalid(f"max_new_tokens {request.max_new_tokens} does not fit: the context holds {max_context} tokens "
                       f"and the prompt has {len(prompt_ids)}, so at most {max_context - len(prompt_ids)}")

    s = request.sampling
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not 0 <= s.max_support <= settings.max_support_limit:
        raise _invalid(f"sampling.max_support must lie in [0, max_support_limit = {settings.max_support_limit}] "
                       f"(0 = default {DEFAULT_MAX_SUPPORT}); got {s.max_support}")
    try:
        sampling = SamplingParams(
            temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(top_p), min_p=float(s.min_p),
            max_support=int(s.max_support) or DEFAULT_MAX_SUPPORT,
        )
    except ValueError as error:
        raise _invalid(f"sampling.{error}") from None

    spec = request.speculation
    mode = {common_pb2.MODE_UNSPECIFIED: Mode.EXACT, common_pb2.MODE_EXACT: Mode.EXACT,
            common_pb2.MODE_PROBABILISTIC: Mode.PROBABILISTIC}.get(spec.mode)
    if mode is None:
        raise _invalid(f"speculation.mode {spec.mode} is not a known Mode")
    gate = {common_pb2.GATE_UNSPECIFIED: Gate.TOP, common_pb2.GATE_TOP: Gate.TOP, common_pb2.GATE_PICK: Gate.PICK}.get(spec.gate)
    if gate is None:
        raise _invalid(f"speculation.gate {spec.gate} is not a known Gate")
    if gate == Gate.PICK and mode == Mode.EXACT:
        raise _invalid("speculation.gate = GATE_PICK applies to probabilistic mode; speculation.mode is exact")
    if spec.coupled and mode == Mode.PROBABILISTIC:
        raise _invalid("speculation.coupled applies to exact mode; speculation.mode is probabilistic")
    max_draft = spec.max_draft_tokens or settings.max_draft_tokens
    if not 0 <= max_draft <= settings.max_draft_tokens_limit:
        raise _invalid(f"speculation.max_draft_tokens must lie in [0, {settings.max_draft_tokens_limit}]; got {spec.max_draft_tokens}")
    schedule = spec.retention.schedule if spec.retention.schedule else None
    min_cum = float(spec.retention.min_cum)
    if not math.isfinite(min_cum):
        raise _invalid(f"speculation.retention.min_cum {min_cum!r} is not finite")
    try:
        retention = RetentionPolicy.parse(schedule, min_cum, min_p=sampling.min_p)
    except ValueError as error:
        raise _invalid(f"speculation.{error}") from None

    for index, token in enumerate(request.stop.eos_token_ids):
        if token >= vocab_size:
            raise _invalid(f"stop.eos_token_ids[{index}] = {token} is out of range [0, {vocab_size})")
    stops = tuple(request.stop.stop_sequences)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _invalid(f"stop.stop_sequences has {len(stops)} strings; at most {MAX_STOP_SEQUENCES}")
    for index, stop in enumerate(stops):
        if not 0 < len(stop) <= MAX_STOP_LENGTH:
            raise _invalid(f"stop.stop_sequences[{index}] = {stop[:40]!r}{'...' if len(stop) > 40 else ''} must have 1 to {MAX_STOP_LENGTH} characters")
    if stops and tokenizer is None:
        raise _invalid("stop.stop_sequences need a tokenizer and this model has none")
    return RequestSpec(
        logprobs=_logprobs(request),
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_new_tokens=int(request.max_new_tokens),
        sampling=sampling,
        seed=int(s.seed),
        mode=mode,
        gate=gate,
        speculate=not spec.disable and max_draft > 0,
        coupled=bool(spec.coupled),
        max_draft_tokens=max_draft,
        retention=retention,
        retention_schedule=spec.retention.schedule,
        retention_min_cum=min_cum,
        eos_token_ids=frozenset(request.stop.eos_token_ids) | frozenset(model_eos_ids),
        stop_sequences=stops,
    )


def _logprobs(request: verifier_pb2.GenerateRequest) -> LogprobSpec | None:
    if not request.HasField("logprobs"):
        return None
    params = request.logprobs
    mode = {verifier_pb2.LOGPROB_MODE_UNSPECIFIED: LogprobMode.RAW, verifier_pb2.LOGPROB_MODE_RAW: LogprobMode.RAW,
            verifier_pb2.LOGPROB_MODE_PROCESSED: LogprobMode.PROCESSED}.get(params.mode)
    if mode is None:
        raise _invalid(f"logprobs.mode {params.mode} is not a known LogprobMode")
    try:
        return LogprobSpec(num_top=int(params.num_top), mode=mode)
    except ValueError as error:
        raise _invalid(f"logprobs.{error}") from None
