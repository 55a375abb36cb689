"""OpenAI's request fields, checked and mapped to a GenerationConfig (issue 19).

One policy for every field a client sends: it is served, or accepted because it cannot
change the output (`user`, `metadata`, ...: NEUTRAL), or refused with a 400 naming it.
Fields tandem lacks (`echo`, penalties, tools, ...) are refused unless left at
their neutral value, and so is any field it does not know: OpenAI's API refuses unrecognized
arguments too. vLLM instead ignores unknown fields with a log line; tandem does not, because a
misspelt sampling field (`temprature`) would then silently change what the client samples
from. tandem's own parameters travel as extra body fields, the way vLLM takes them (`top_k`,
`min_p`, `max_support`, `mode`, `gate`, `max_draft_tokens`, `coupled`, `speculation`,
`retention_schedule`, `retention_min_cum`, and `logprobs_mode`: raw, the default, or processed,
as vLLM's --logprobs-mode, here per request).

Every value is checked before it reaches the protocol: integers within their wire type
(int32, uint32, uint64), numbers finite, strings and booleans typed, so a bad value is a 400
naming the field the client sent, never a failure further in.
"""

from __future__ import annotations

import math
import reprlib
import secrets

from gateway_service.errors import ApiError, ClientNames, bad
from shared.client import MAX_TOP_LOGPROBS, GenerationConfig

INT32, UINT32, UINT64 = 2**31, 2**32, 2**64
SERVED = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
          "stream_options", "logprobs", "top_logprobs",
          # tandem's own
          "top_k", "min_p", "max_support", "mode", "gate", "max_draft_tokens", "coupled", "speculation",
          "retention_schedule", "retention_min_cum", "logprobs_mode"}
NEUTRAL = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
UNSUPPORTED = {  # fields that change the output, refused unless left at their neutral value
    "echo": (None, False), "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "suffix": (None, ""), "modalities": (None, ["text"]),
}
FIELDS = {"completions": SERVED | NEUTRAL | set(UNSUPPORTED) | {"prompt"},
          "chat": SERVED | NEUTRAL | set(UNSUPPORTED) | {"messages"}}
FLOATS = ("temperature", "top_p", "min_p", "retention_min_cum")
INTEGERS = {"seed": (0, UINT64), "top_k": (0, INT32), "max_support": (0, INT32), "max_draft_tokens": (0, INT32)}
_shortened = reprlib.Repr()  # a client's value in an error message: bounded, however large or deep
_shortened.maxlevel, _shortened.maxstring, _shortened.maxother, _shortened.maxlong = 2, 40, 40, 40
_show = _shortened.repr


def _integer(value: object, name: str, low: int, high: int) -> int:
    """An int in [low, high): JSON integers, and floats with no fractional part (as OpenAI takes 5.0)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"{name} must be an integer; got {_show(value)}")
    if not low <= value < high:
        raise bad(name, f"{name} must lie in [{low}, {high - 1}]; got {_show(value)}")
    return value


def _float(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(name, f"{name} must be a number; got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise bad(name, f"{name} must be a finite number; got {_show(value)}")
    return number


def _typed(body: dict, name: str, kind: type, what: str):
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise bad(name, f"{name} must be {what}; got {_show(value)}")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "stop must be a non-empty string or a list of them")
    return tuple(stops)


def check_fields(body: object, endpoint: str) -> dict:
    """The body as a dict whose every field is known (see the module's policy)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS[endpoint]:
            raise bad(name, f"unrecognized request argument: {_show(name)} (tandem refuses fields it does not serve)")
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise bad(name, f"{name} is not supported by tandem")
    return body


def client_names(body: dict, *, chat: bool) -> ClientNames:
    sent = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return ClientNames(prompt="messages" if chat else "prompt", max_tokens=sent, default_max_tokens=body.get(sent) is None)


def parse(body: dict, *, served_model: str, default_max_tokens: int, request_id: str,
          names: ClientNames) -> tuple[GenerationConfig, bool, bool]:
    """Validate the shared fields of a (chat) completion request; returns (config, stream, include_usage)."""
    model = body.get("model")
    if model is None:
        raise bad("model", "model is required")
    if model != served_model:
        raise ApiError(404, f"model {_show(model)} does not exist; this server serves {served_model!r}", param="model",
                       code="model_not_found")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise bad("n", f"n must be 1; got {_show(n)}")
    floats = {name: _float(body[name], name) for name in FLOATS if body.get(name) is not None}
    ints = {name: _integer(body[name], name, *bounds) for name, bounds in INTEGERS.items() if body.get(name) is not None}
    max_name = names["max_tokens"]
    max_tokens = body.get(max_name)
    # int32 on the wire; the verifier's own limit (and the context) are its to check
    max_tokens = default_max_tokens if max_tokens is None else _integer(max_tokens, max_name, 1, INT32)
    stream = _typed(body, "stream", bool, "a boolean") or False
    options = _typed(body, "stream_options", dict, "an object") or {}
    for name in ("mode", "gate", "retention_schedule"):
        _typed(body, name, str, "a string")
    for name in ("coupled", "speculation"):
        _typed(body, name, bool, "a boolean")
    seed = ints.get("seed")
    logprobs = _logprobs(body, chat=names["prompt"] == "messages")
    try:
        config = GenerationConfig(
            max_new_tokens=max_tokens,
            temperature=floats.get("temperature", 1.0),  # OpenAI's default
            top_k=ints.get("top_k", 0), top_p=floats.get("top_p"), min_p=floats.get("min_p", 0.0),
            # unset: a fresh seed per request, as other servers sample (the same seed gives the same tokens)
            seed=secrets.randbits(63) if seed is None else seed,
            max_support=ints.get("max_support", 0), mode=body.get("mode") or "exact", gate=body.get("gate") or "top",
            max_draft_tokens=ints.get("max_draft_tokens", 0), retention_schedule=body.get("retention_schedule"),
            retention_min_cum=floats.get("retention_min_cum", 0.0), speculation=body.get("speculation", True) is not False,
            coupled=bool(body.get("coupled", False)), stop=_stop(body), request_id=request_id,
            logprobs=logprobs, logprobs_mode=body.get("logprobs_mode") or "raw",
        )
    except ValueError as error:  # GenerationConfig's checks name the field first (mode, gate, ...)
        message = str(error)
        field = message.split(" ", 1)[0]
        param = max_name if field == "max_new_tokens" else field if field in FIELDS["chat"] else None
        raise bad(param, message.replace("max_new_tokens", max_name, 1)) from None
    return config, stream, bool(options.get("include_usage"))


def _logprobs(body: dict, *, chat: bool) -> int | None:
    """Alternatives per token (None: no logprobs). Completions: `logprobs` = n; chat: `logprobs`
    true, with `top_logprobs` = n (0 when absent), as OpenAI takes them."""
    _typed(body, "logprobs_mode", str, "a string")
    if chat:
        asked = _typed(body, "logprobs", bool, "a boolean")
        top = body.get("top_logprobs")
        if top is not None and not asked:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        num_top = None if not asked else 0 if top is None else _integer(top, "top_logprobs", 0, MAX_TOP_LOGPROBS + 1)
    else:
        if body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "top_logprobs belongs to chat completions; completions take logprobs = n")
        value = body.get("logprobs")
        num_top = None if value is None else _integer(value, "logprobs", 0, MAX_TOP_LOGPROBS + 1)
    if num_top is None and body.get("logprobs_mode") is not None:
        raise bad("logprobs_mode", "logprobs_mode applies only where logprobs are asked for")
    return num_top


def completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return completion_prompt({"prompt": prompt[0]})  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        for index, token in enumerate(prompt):
            if not 0 <= token < UINT32:  # the vocabulary's own bound is the verifier's to check
                raise bad("prompt", f"prompt[{index}] = {_show(token)} is not a token id (uint32)")
        return prompt
    raise bad("prompt", "prompt must be a non-empty string or a list of token ids (one prompt per request)")


def chat_messages(body: dict) -> list[dict]:
    """[{"role", "content"}] with text content; every message must carry content (OpenAI lets
    an assistant message go without only when it holds tool calls, which tandem does not serve)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    normalised = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad("messages", f"messages[{index}] must be an object")
        if message.get("tool_calls") or message.get("function_call"):
            raise bad("messages", f"messages[{index}]: tool calls are not supported by tandem")
        content = message.get("content")
        if content is None:
            raise bad("messages", f"messages[{index}].content is required")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise bad("messages", f"messages[{index}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        normalised.append({"role": message.get("role"), "content": content})
    return normalised
