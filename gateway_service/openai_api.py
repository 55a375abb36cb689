"""OpenAI's request and response shapes, mapped to ours (issue 19).

Requests: the OpenAI parameters we support (`max_tokens`, `temperature`, `top_p`, `seed`,
`stop`, `n` = 1, `stream`, `stream_options.include_usage`) plus tandem's own as extra body
fields, the way vLLM takes them (`top_k`, `min_p`, `max_support`, `mode`, `gate`,
`max_draft_tokens`, `coupled`, `speculation`, `retention_schedule`, `retention_min_cum`).
Anything else that would change the output (`logprobs`, `echo`, `best_of`, penalties,
`logit_bias`, tools, ...) is refused by name rather than ignored. Errors have OpenAI's
shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import re
import secrets

import grpc

from shared.client import Generation, GenerationConfig, VerifierError

UNSUPPORTED = {  # fields that change the output, refused unless left at their neutral value
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "response_format": (None, {"type": "text"}),
    "suffix": (None, ""),
}
NUMBERS = {"temperature": float, "top_p": float, "min_p": float, "retention_min_cum": float,
           "seed": int, "top_k": int, "max_support": int, "max_draft_tokens": int}
# The verifier names fields by their place in GenerateRequest; clients know OpenAI's names.
VERIFIER_FIELDS = [
    ("max_new_tokens", "max_tokens"), ("sampling.temperature", "temperature"), ("sampling.top_p", "top_p"),
    ("sampling.top_k", "top_k"), ("sampling.min_p", "min_p"), ("sampling.max_support", "max_support"),
    ("sampling.seed", "seed"), ("stop.stop_sequences", "stop"), ("speculation.max_draft_tokens", "max_draft_tokens"),
    ("speculation.retention.min_cum", "retention_min_cum"), ("speculation.retention", "retention_schedule"),
    ("speculation.gate", "gate"), ("speculation.coupled", "coupled"), ("speculation.mode", "mode"),
    ("prompt_text", "prompt"), ("prompt_ids", "prompt"), ("prompt", "prompt"), ("the context holds", "prompt"),
]
STATUS = {  # gRPC status of the verifier → (HTTP status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.UNAUTHENTICATED: (502, "server_error"),  # the gateway's own credentials are wrong
    grpc.StatusCode.PERMISSION_DENIED: (502, "server_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    @classmethod
    def from_verifier(cls, error: VerifierError, prompt_param: str = "prompt") -> ApiError:
        status, kind = STATUS.get(error.code, (502, "server_error"))
        param = None
        if error.code == grpc.StatusCode.INVALID_ARGUMENT:
            param = next((ours for theirs, ours in VERIFIER_FIELDS if error.message.startswith(theirs)), None)
            param = prompt_param if param == "prompt" else param
        return cls(status, f"{error.code.name}: {error.message}", param=param, kind=kind, code=error.code.name.lower())


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def _number(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not float(value).is_integer()):
        raise bad(name, f"{name} must be {'an integer' if kind is int else 'a number'}; got {value!r}")
    return kind(value)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "stop must be a non-empty string or a list of them")
    return tuple(stops)


def parse(body: object, *, served_model: str, default_max_tokens: int, request_id: str) -> tuple[GenerationConfig, bool, bool]:
    """Validate the shared fields of a (chat) completion request; returns (config, stream, include_usage)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise bad("model", "model is required")
    if model != served_model:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {served_model!r}", param="model",
                       code="model_not_found")
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise bad(name, f"{name} is not supported by tandem")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise bad("n", f"n must be 1; got {n!r}")
    numbers = {name: _number(body, name, kind) for name, kind in NUMBERS.items()}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("max_tokens", f"max_tokens must be a positive integer; got {max_tokens!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "stream_options must be an object")
    for name in ("mode", "gate", "retention_schedule"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad(name, f"{name} must be a string")
    for name in ("coupled", "speculation"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad(name, f"{name} must be a boolean")
    seed = numbers["seed"]
    try:
        config = GenerationConfig(
            max_new_tokens=max_tokens,
            temperature=1.0 if numbers["temperature"] is None else numbers["temperature"],  # OpenAI's default
            top_k=numbers["top_k"] or 0, top_p=numbers["top_p"], min_p=numbers["min_p"] or 0.0,
            # unset: a fresh seed per request, as other servers sample (the same seed gives the same tokens)
            seed=secrets.randbits(63) if seed is None else seed,
            max_support=numbers["max_support"] or 0, mode=body.get("mode") or "exact", gate=body.get("gate") or "top",
            max_draft_tokens=numbers["max_draft_tokens"] or 0, retention_schedule=body.get("retention_schedule"),
            retention_min_cum=numbers["retention_min_cum"] or 0.0, speculation=body.get("speculation", True) is not False,
            coupled=bool(body.get("coupled", False)), stop=_stop(body), request_id=request_id,
        )
    except ValueError as error:
        message = str(error)
        name = re.match(r"\w+", message)
        raise bad({"max_new_tokens": "max_tokens"}.get(name.group(0), name.group(0)) if name else None, message) from None
    return config, stream, bool(options.get("include_usage"))


def completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return completion_prompt({"prompt": prompt[0]})  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return prompt
    raise bad("prompt", "prompt must be a non-empty string or a list of token ids (one prompt per request)")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    normalised = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad("messages", f"messages[{index}] must be an object")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise bad("messages", f"messages[{index}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        normalised.append({"role": message.get("role"), "content": "" if content is None else content})
    return normalised


def usage(generation: Generation) -> dict:
    """OpenAI's usage plus tandem's speculative statistics."""
    stats = generation.stats
    return {
        "prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["completion_tokens"],
        "total_tokens": stats["prompt_tokens"] + stats["completion_tokens"],
        "rounds": stats["rounds"], "mean_accepted_length": stats["mean_accepted_length"],
        "acceptance_by_source": stats["acceptance_by_source"], "proposed": stats["proposed"],
        "accepted": stats["accepted"], "drafter_faults": stats["drafter_faults"],
    }


def finish_reason(reason: str) -> str:
    return {"stop": "stop", "length": "length", "stop_sequence": "stop"}.get(reason, reason or "stop")
