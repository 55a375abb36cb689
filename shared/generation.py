"""What a Generate call asks and what it returns, as Python values: `GenerationConfig` (the
request's options, validated before any call, mapped onto a `GenerateRequest`), `Generation` (a
finished call's tokens, text, stats and rounds) and the accumulator that folds a stream's events
into one. Both clients (shared/client.py) speak these; they hold no channel."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.protocol import PROTOCOL_VERSION, common_pb2, verifier_pb2

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
