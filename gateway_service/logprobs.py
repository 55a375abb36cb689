"""OpenAI's logprobs shapes from the verifier's per-token log-probabilities.

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (each position's
alternatives as {token text: logprob}, the chosen token included, as vLLM does). Chat:
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

A token's text is its own bytes, decoded on their own: a token that holds part of a UTF-8
character reads as U+FFFD there, while `bytes` (chat) carries the exact bytes, as OpenAI's
do. Byte-level BPE vocabularies (GPT-2 style) map their symbols back to bytes; any other
tokenizer's tokens are taken as their decoded text. A log-probability of minus infinity
(a token the processed law gives no mass, never a streamed one) is sent as -9999.0, as
OpenAI and vLLM send it: JSON has no infinity.
"""

from __future__ import annotations

import functools
import math

from tokenizers import decoders

from shared.client import TokenLogprob

NO_MASS = -9999.0


def _byte_symbols() -> dict[str, int]:
    """Byte-level BPE's printable symbol for each byte value, inverted (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[chr(byte)] = byte
        else:
            symbols[chr(256 + extra)] = byte
            extra += 1
    return symbols


class TokenTexts:
    """Each token id's bytes and text under one tokenizer (cached)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._symbols = _byte_symbols()

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one instance per gateway)
    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self.byte_level and all(c in self._symbols for c in piece):
            return bytes(self._symbols[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _number(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_MASS


def completion_logprobs(logprobs: list[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict:
    """The completions API's logprobs object; offset: characters of the completion before these tokens."""
    tokens, offsets = [], []
    for x in logprobs:
        offsets.append(offset)
        tokens.append(texts.text(x.token_id))
        offset += len(tokens[-1])
    top = []
    for x in logprobs:
        alternatives = {texts.text(t): _number(lp) for t, lp in x.top}
        alternatives.setdefault(texts.text(x.token_id), _number(x.logprob))
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [_number(x.logprob) for x in logprobs], "top_logprobs": top,
            "text_offset": offsets}


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    raw = texts.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": _number(logprob), "bytes": list(raw)}


def chat_logprobs(logprobs: list[TokenLogprob], texts: TokenTexts, num_top: int) -> dict:
    """The chat API's logprobs object (num_top: the request's top_logprobs)."""
    return {"content": [{**_entry(texts, x.token_id, x.logprob),
                         "top_logprobs": [_entry(texts, t, lp) for t, lp in x.top[:num_top]]} for x in logprobs]}
